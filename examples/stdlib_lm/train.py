"""Train ``ByteLM`` on the Python standard library's sources with LightningCLI.

    python examples/stdlib_lm/train.py fit --config examples/stdlib_lm/config.yaml

Importing :mod:`lightning_pipe` registers the strategy names ``pipe`` and one per schedule
(``pipe_1f1b``, ``pipe_gpipe``, ``pipe_zb_h1``, ... as README.md lists them), so
``--trainer.strategy=pipe`` works as well as the ``class_path`` form in the config. Lightning's launcher re-runs this script once per rank.
"""

import os
import sys

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning_pipe  # noqa: E402,F401  (registers the strategy names)
from examples.stdlib_lm.data import StdlibTextDataModule  # noqa: E402
from examples.stdlib_lm.model import ByteLM  # noqa: E402


def main() -> None:
    cli = LightningCLI(ByteLM, StdlibTextDataModule)
    if cli.subcommand == "fit":
        summary = closing_summary(cli.trainer)  # on every rank: trainer.log_dir is a collective
        if cli.trainer.is_global_zero:
            print(summary)


def closing_summary(trainer) -> str:
    """What the run ended with and where it left its files."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    lines = [f"trained {trainer.global_step} steps: " + ", ".join(
        f"{name} {metrics[name]:.3f}" for name in ("train_loss", "val_loss", "val_bpb") if name in metrics)]
    lines.append(f"logs:       {trainer.log_dir}/metrics.csv")
    checkpoint = trainer.checkpoint_callback
    path = checkpoint and (checkpoint.last_model_path or checkpoint.best_model_path)
    if path:
        lines.append(f"checkpoint: {path}")
    for callback in trainer.callbacks:
        for path in getattr(callback, "paths", []):
            lines.append(f"timeline:   {path}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
