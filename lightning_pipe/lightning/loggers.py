"""Logger calls in the code after the body, which runs on a process that is not global rank 0.

Under PipeStrategy the code of a step after the body call runs on the last stage only. Lightning's
loggers write on global rank 0 alone (``logger.experiment`` is a dummy elsewhere, and
``log_image``/``log_metrics``... are ``rank_zero_only``), so a step that logs media there
(``self.logger.experiment.add_image(...)`` in ``validation_step``, ``self.logger.log_image(...)``)
does nothing, where under DDP global rank 0 runs the whole step and logs. ``self.log`` is not
affected: its values are gathered to every rank (see :mod:`.logs`).

Writing from the last stage instead would open a second writer (a second wandb or MLflow run, a
CSV file written by two processes), so nothing is sent; :func:`watched` warns once instead,
naming what was used and where to move it. It wraps the trainer's loggers while the last stage
runs the user's step, on the pipeline of replica 0 when its last stage is not global rank 0.
Reading the logger (``save_dir``, ``log_dir``) does not warn, and neither does a use before the
body call, which the first stage (global rank 0) runs too.

The same holds for any code after the body that runs on global rank 0 only (``if
self.trainer.is_global_zero:``, ``self.print``): while :func:`watched` is on, PipeStrategy's
``is_global_zero`` calls :func:`rank_read`, which warns once when the user's code read it there
(Lightning's own reads, which go through other functions of its own, do not warn). A read of
``global_rank`` does not warn: it names files as often as it picks rank 0, and what is done with
it cannot be seen; nor do ``@rank_zero_only`` functions, which read a number set at setup.
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import lightning.fabric
import lightning.pytorch
import lightning_utilities
import torch

_warned = {"done": False, "rank": False}
_watching: Optional[tuple] = None  # (hook, rank, after_body) while watched() is on
# the properties that lead from the user's code to the strategy's is_global_zero, and Lightning's `print`
_RANK_GETTERS = frozenset({"is_global_zero", "print"})
_LIBRARIES = tuple(os.path.dirname(path) + os.sep for path in (
    lightning.pytorch.__file__, lightning.fabric.__file__, lightning_utilities.__file__, torch.__file__,
    os.path.dirname(os.path.abspath(__file__))))  # lightning_pipe's own folder


class _Watched:
    """A logger as the last stage's step sees it: warns on the first use that would write after the body, then
    delegates. ``after_body()`` tells whether the step has called the body yet (the code before it also runs on
    the first stage, global rank 0, where the logger writes)."""

    def __init__(self, logger: Any, hook: str, rank: int, after_body: Callable[[], bool]) -> None:
        object.__setattr__(self, "_logger", logger)
        object.__setattr__(self, "_where", (hook, rank, after_body))

    @property
    def __class__(self) -> type:  # isinstance(self.logger, WandbLogger) stays true
        return type(object.__getattribute__(self, "_logger"))

    def __getattr__(self, name: str) -> Any:
        value = getattr(object.__getattribute__(self, "_logger"), name)
        hook, rank, after_body = object.__getattribute__(self, "_where")
        writes = name == "experiment" or (name.startswith("log_") and callable(value))  # not log_dir
        if writes and not _warned["done"] and after_body():
            _warned["done"] = True
            warnings.warn(
                f"{hook} used the logger's `{name}` after the body call. Under PipeStrategy that code runs on the last "
                f"stage's process (global rank {rank}), and Lightning's loggers write on global rank 0 only, so it "
                "does nothing. Log values with self.log (gathered to every rank), and media (images, tables) from a "
                "hook that runs on every rank: on_train_batch_end / on_validation_batch_end get the step's merged "
                "outputs, and on_validation_epoch_end the attributes the steps built",
                stacklevel=2,
            )
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_logger"), name, value)


@contextmanager
def watched(trainer: Any, hook: str, rank: int, after_body: Callable[[], bool]) -> Iterator[None]:
    """While the user's step runs on the last stage: ``trainer.loggers`` warn on a use that writes after the body,
    and so does the user's code reading the process's rank there (:func:`rank_read`)."""
    global _watching
    loggers, outer = trainer._loggers, _watching
    trainer._loggers = [_Watched(logger, hook, rank, after_body) for logger in loggers]
    _watching = (hook, rank, after_body)
    try:
        yield
    finally:
        trainer._loggers, _watching = loggers, outer


def rank_read() -> None:
    """Called by PipeStrategy's ``is_global_zero``: warn once if the user's code read it after the body call while
    :func:`watched` is on (its caller, through Lightning's ``is_global_zero`` and ``print`` only, is not library
    code)."""
    if _watching is None or _warned["rank"]:
        return
    hook, rank, after_body = _watching
    frame, what, depth = sys._getframe(2), "is_global_zero", 3  # above the strategy's property
    while frame is not None and frame.f_code.co_name in _RANK_GETTERS \
            and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, what, depth = frame.f_back, frame.f_code.co_name, depth + 1
    if frame is None or frame.f_code.co_filename.startswith(_LIBRARIES) or not after_body():
        return
    _warned["rank"] = True
    warnings.warn(
        f"{hook} {'called `self.print`' if what == 'print' else 'read `is_global_zero`'} after the body call. "
        f"Under PipeStrategy that code runs on the last stage's process (global rank {rank}), not on global rank 0, "
        "so what you run on rank 0 only there does not run at all. Do it in a hook that runs on every rank "
        "(on_train_batch_end / on_validation_batch_end get the step's merged outputs), or before the body call, "
        "which global rank 0 runs",
        stacklevel=depth,  # the user's line
    )
