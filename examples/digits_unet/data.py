"""scikit-learn's bundled 8x8 handwritten digits as a LightningDataModule.

:func:`sklearn.datasets.load_digits` reads ``digits.csv.gz``, a file shipped inside the
scikit-learn package itself (``sklearn/datasets/data/``), so nothing is downloaded: 1797 grey
images of 8x8 pixels with values 0..16, ten classes. scikit-learn is imported only when the data
is built, so the model can be imported without it.

The split is fixed by ``seed`` (a random permutation, the first ``val_fraction`` held out), and
the pixels are standardised with the mean and standard deviation of the training images.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl


def load_digit_tensors() -> Tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits as ``(images (N, 1, 8, 8) float32 in 0..16, labels (N,) int64)``.

    Example:
        >>> images, labels = load_digit_tensors()
        >>> tuple(images.shape), tuple(labels.shape), int(labels.max())
        ((1797, 1, 8, 8), (1797,), 9)
    """
    from sklearn.datasets import load_digits  # data shipped inside scikit-learn, no download

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    labels = torch.as_tensor(digits.target, dtype=torch.long)
    return images, labels


class DigitsDataModule(pl.LightningDataModule):
    """The 8x8 digits, split into training and validation images with a fixed seed.

    Args:
        batch_size: training images per batch (the pipeline cuts each into microbatches).
        val_batch_size: validation images per batch.
        val_fraction: the share of the images held out for validation.
        seed: picks the split and the order of the training batches.
        num_workers: DataLoader workers.
    """

    def __init__(self, batch_size: int = 64, val_batch_size: int = 256, val_fraction: float = 0.2,
                 seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        images, labels = load_digit_tensors()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.hparams.seed))
        num_val = int(round(len(labels) * self.hparams.val_fraction))
        val, train = order[:num_val], order[num_val:]
        mean, std = images[train].mean(), images[train].std()
        images = (images - mean) / std
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])

    def train_dataloader(self) -> DataLoader:
        # Under PipeStrategy every stage of a pipeline must see the same batches. Lightning swaps
        # this shuffle for a DistributedSampler over the pipeline replicas, seeded on every rank
        # by seed_everything (PL_GLOBAL_SEED), so the stages agree; the generator serves plain runs.
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
                          generator=generator, num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.val_batch_size, num_workers=self.hparams.num_workers)
