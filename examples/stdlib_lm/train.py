"""Train ``ByteLM`` on the Python standard library's sources with LightningCLI.

    python examples/stdlib_lm/train.py fit --config examples/stdlib_lm/config.yaml

Importing :mod:`lightning_pipe` registers the strategy names ``pipe``, ``pipe_1f1b`` and
``pipe_gpipe``, so ``--trainer.strategy=pipe`` works as well as the ``class_path`` form in the
config. Lightning's launcher re-runs this script once per rank.
"""

import os
import sys

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning_pipe  # noqa: E402,F401  (registers the strategy names)
from examples.stdlib_lm.data import StdlibTextDataModule  # noqa: E402
from examples.stdlib_lm.model import ByteLM  # noqa: E402


def main() -> None:
    LightningCLI(ByteLM, StdlibTextDataModule)


if __name__ == "__main__":
    main()
