"""tests/lightning_app.py with an injected failure, run as a script by tests/test_scaling.py.

``python tests/fault_app.py --fail-rank 3 --fail-epoch 1 --fail-batch 1 --fail-how raise <lightning_app args>``
trains ``lightning_app.Regressor`` but makes global rank 3 raise ``RuntimeError("injected failure on
global rank 3")`` (or, with ``--fail-how kill``, SIGKILL itself) at the start of training_step for
that epoch and batch (``--fail-in hook``: in its ``on_train_batch_end``, which fails that rank
alone). ``--on-exception-checkpoint`` adds Lightning's ``OnExceptionCheckpoint`` (a collective in
``on_exception``), writing into ``on_exception/`` beside the stamp file. ``--fail-rank -1`` fails
every rank; ``--catch`` catches the error around ``fit``, waits ``CAUGHT_WAIT_S`` and writes
``alive_<rank>`` beside the stamp file, as a script going on after a failure would. Lightning's
launcher re-executes this script, so every rank gets the flags.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightning_app  # noqa: E402
from lightning.pytorch.callbacks import OnExceptionCheckpoint  # noqa: E402


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, required=True)
    parser.add_argument("--fail-epoch", type=int, default=0)
    parser.add_argument("--fail-batch", type=int, default=1)
    parser.add_argument("--fail-how", choices=["raise", "kill"], default="raise")
    parser.add_argument("--fail-in", choices=["step", "hook"], default="step")
    parser.add_argument("--on-exception-checkpoint", action="store_true")
    parser.add_argument("--catch", action="store_true")
    return parser.parse_known_args(argv)


FAULT = argparse.Namespace(fail_rank=-2, fail_epoch=0, fail_batch=0, fail_how="raise", fail_in="step",
                           on_exception_checkpoint=False, catch=False)  # set by parse()
CAUGHT_WAIT_S = 8.0  # longer than PipeStrategy's grace before it ends the ranks still running


class FaultyRegressor(lightning_app.Regressor):
    def _fail_here(self, batch_idx):
        rank = self.global_rank if FAULT.fail_rank == -1 else FAULT.fail_rank
        if (self.global_rank, self.current_epoch, batch_idx) == (rank, FAULT.fail_epoch, FAULT.fail_batch):
            with open(os.environ["FAULT_STAMP"], "w") as stamp:  # when the failure happened (wall clock)
                stamp.write(repr(time.time()))
            if FAULT.fail_how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on global rank {self.global_rank}")

    def training_step(self, batch, batch_idx):
        if FAULT.fail_in == "step":
            self._fail_here(batch_idx)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if FAULT.fail_in == "hook":
            self._fail_here(batch_idx)

    def configure_callbacks(self):
        if not FAULT.on_exception_checkpoint:
            return []
        return [OnExceptionCheckpoint(os.path.join(os.path.dirname(os.environ["FAULT_STAMP"]), "on_exception"))]


if __name__ == "__main__":
    FAULT, APP_ARGS = parse()
    lightning_app.Regressor = FaultyRegressor  # main() builds the model by this name
    if not FAULT.catch:
        lightning_app.main(APP_ARGS)
        sys.exit(0)
    try:
        lightning_app.main(APP_ARGS)
    except RuntimeError as error:
        time.sleep(CAUGHT_WAIT_S)
        folder = os.path.dirname(os.environ["FAULT_STAMP"])
        with open(os.path.join(folder, f"alive_{os.environ.get('LOCAL_RANK', '0')}"), "w") as alive:
            alive.write(str(error))
