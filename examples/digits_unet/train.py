"""Train ``DigitsUNet`` on scikit-learn's bundled 8x8 digits with ``PipeStrategy`` on CPU processes.

    python examples/digits_unet/train.py                             # 2 processes, 2 stages
    python examples/digits_unet/train.py --devices 3 --pipe-size 3   # 3 stages
    python examples/digits_unet/train.py --devices 4 --pipe-size 2   # 2 stages x 2 replicas

The images come from :func:`sklearn.datasets.load_digits`, which reads a file shipped inside the
scikit-learn package (no download); ``pip install scikit-learn`` if it is missing. The strategy is
``PipeStrategy(pipe_size, num_microbatches, deferred_batch_norm=True, checkpoint="except_last")``:
the U-Net body's skip connections cross stages, its BatchNorms update their running statistics
once per batch, and every microbatch but the last recomputes its forward in backward. Lightning's
launcher re-runs this script once per rank. At the end rank 0 prints the final validation
accuracy twice: as logged through the pipeline during ``fit``, and recomputed in this process by
the whole trained model that ``fit`` gathered back into the LightningModule; then how many times
the BatchNorms' running statistics were updated (once per step). CSV logs and a checkpoint of the
whole model go to ``<root>/digits_unet/version_N/``.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_pipe import PipeStrategy  # noqa: E402
from examples.digits_unet.data import DigitsDataModule  # noqa: E402
from examples.digits_unet.model import DigitsUNet  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes")
    parser.add_argument("--pipe-size", type=int, default=2, help="pipeline stages (must divide --devices)")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per batch")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeline schedule")
    parser.add_argument("--max-epochs", type=int, default=15, help="passes over the training images")
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch (per pipeline replica)")
    parser.add_argument("--width", type=int, default=16, help="channels at full resolution")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (cosine decay)")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation, data split and order")
    parser.add_argument("--root", default="lightning_logs", help="where the CSV logs and checkpoints go")
    return parser.parse_args(argv)


@torch.no_grad()
def accuracy_in_process(model: DigitsUNet, data: DigitsDataModule) -> float:
    """Accuracy of the (whole, gathered) model on the validation images, without any pipeline."""
    model.eval()
    images, labels = data.val_set.tensors
    return (model(images).argmax(1) == labels).float().mean().item()


def main(argv=None) -> None:
    args = parse(argv)
    pl.seed_everything(args.seed)  # every rank builds the same model; rank 0's weights are broadcast anyway
    data = DigitsDataModule(batch_size=args.batch_size, seed=args.seed)
    model = DigitsUNet(width=args.width, lr=args.lr)
    strategy = PipeStrategy(pipe_size=args.pipe_size, num_microbatches=args.microbatches, schedule=args.schedule,
                            deferred_batch_norm=True, checkpoint="except_last")
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.max_epochs,
        logger=CSVLogger(args.root, name="digits_unet"), log_every_n_steps=10,
        enable_model_summary=False, default_root_dir=args.root,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    if trainer.is_global_zero:
        logged = trainer.callback_metrics
        print(f"trained {trainer.global_step} steps in {seconds:.1f} s: "
              f"final val_loss {logged['val_loss'].item():.4f}, final val_acc {logged['val_acc'].item():.4f}")
        print(f"gathered model in one process: val_acc {accuracy_in_process(model, data):.4f}")
        tracked = {int(m.num_batches_tracked) for m in model.modules() if hasattr(m, "num_batches_tracked")}
        print(f"BatchNorm running statistics updated {sorted(tracked)} times ({trainer.global_step} steps)")


if __name__ == "__main__":
    main()
