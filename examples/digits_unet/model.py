"""``DigitsUNet``: a small U-Net with residual conv blocks and BatchNorm, for 8x8 digit images.

The body is one ``nn.Sequential`` whose layers pass one tensor each; the U-Net's long skip
connections do not go through that chain. They are declared with :func:`lightning_pipe.skip.skippable`:
a :class:`Down` layer ``yield stash("skip", x)`` before it downsamples, and the matching
:class:`Up` layer takes it back with ``x = yield pop("skip")``. Both levels use the same two
classes and the same skip name; each level's pair is put in its own :class:`~lightning_pipe.skip.Namespace`
with ``.isolate(ns)`` so the two ``"skip"`` tensors stay apart (C is ``width``)::

    body[0] stem         ResBlock                           -> 8x8 x C
    body[1] Down(outer)  stash its 8x8 x C input, pool      -> 4x4 x 2C  ---------+
    body[2] Down(inner)  stash its 4x4 x 2C input, pool     -> 2x2 x 4C  ----+    |
    body[3] middle       ResBlock                           -> 2x2 x 4C      |    |
    body[4] Up(inner)    upsample, pop 4x4 x 2C, concat     -> 4x4 x 2C  <---+    |
    body[5] Up(outer)    upsample, pop 8x8 x C, concat      -> 8x8 x C   <--------+

Under :class:`lightning_pipe.PipeStrategy` the body is split across stages; a stashed tensor
travels straight from the stage that stashes it to the stage that pops it (and its gradient
straight back). With ``deferred_batch_norm=True`` the BatchNorms' running statistics are
updated once per batch rather than once per microbatch. Without a pipeline the same module runs
as an ordinary LightningModule. The head (global average pool, Linear to 10 classes) is outside
the body (and deliberately not an ``nn.Sequential``, so that ``body`` is the only candidate
PipeStrategy finds); it runs on the last stage with the loss. The data is scikit-learn's bundled digits
(see :mod:`examples.digits_unet.data`; no download).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Accuracy

import lightning.pytorch as pl

from lightning_pipe.skip import Namespace, pop, skippable, stash

NUM_CLASSES = 10


class ResBlock(nn.Module):
    """Two 3x3 conv + BatchNorm layers with a residual connection (1x1 conv when the width changes)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = (
            nn.Identity() if in_channels == out_channels else
            nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


@skippable(stash=["skip"])
class Down(nn.Module):
    """Stash the input as ``"skip"``, halve the resolution (max pool), then a residual block."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.block = ResBlock(in_channels, out_channels)

    def forward(self, x: torch.Tensor):
        yield stash("skip", x)
        return self.block(F.max_pool2d(x, 2))


@skippable(pop=["skip"])
class Up(nn.Module):
    """Double the resolution (nearest), concatenate the popped ``"skip"``, then a residual block."""

    def __init__(self, in_channels: int, skip_channels: int, out_channels: int) -> None:
        super().__init__()
        self.block = ResBlock(in_channels + skip_channels, out_channels)

    def forward(self, x: torch.Tensor):
        skip = yield pop("skip")
        x = F.interpolate(x, size=skip.shape[-2:], mode="nearest")
        return self.block(torch.cat([x, skip], dim=1))


class Head(nn.Module):
    """Global average pool and a Linear layer to the class logits."""

    def __init__(self, channels: int, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.linear = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.mean(dim=(2, 3)))


def unet_body(width: int = 16) -> nn.Sequential:
    """The six-layer body: stem, Down, Down, middle, Up, Up (8x8 -> 4x4 -> 2x2 -> 4x4 -> 8x8)."""
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        ResBlock(1, width),                                     # 8x8, C
        Down(width, 2 * width).isolate(outer),                  # stash 8x8 C -> 4x4, 2C
        Down(2 * width, 4 * width).isolate(inner),              # stash 4x4 2C -> 2x2, 4C
        ResBlock(4 * width, 4 * width),                         # 2x2, 4C
        Up(4 * width, 2 * width, 2 * width).isolate(inner),     # pop 4x4 2C -> 4x4, 2C
        Up(2 * width, width, width).isolate(outer),             # pop 8x8 C -> 8x8, C
    )


class DigitsUNet(pl.LightningModule):
    """Classify 8x8 digits with a U-Net body and a pooled linear head.

    Args:
        width: channels at full resolution (doubled at each of the two downsamplings).
        lr: AdamW learning rate (peak of a cosine decay over the run).
        weight_decay: AdamW weight decay.
    """

    def __init__(self, width: int = 16, lr: float = 3e-3, weight_decay: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = unet_body(width)
        self.head = Head(width)  # not an nn.Sequential, so PipeStrategy finds `body` on its own
        self.val_acc = Accuracy(task="multiclass", num_classes=NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(images))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.val_acc(logits, labels)
        self.log("val_acc", self.val_acc, prog_bar=True)  # the Metric object: Lightning computes it per epoch

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        total = int(min(self.trainer.estimated_stepping_batches, 10**9))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
