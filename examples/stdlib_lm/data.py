"""Byte-level text from the Python standard library's own ``.py`` sources.

Every Python install ships its standard library as source, so this data set needs no download:
the files under ``os.path.dirname(os.__file__)`` (without ``site-packages`` and the test suites),
taken in sorted order of their relative paths until ``max_bytes`` bytes are read. The text is
tokenized as raw bytes (vocabulary 256). The last ``val_fraction`` of the bytes is held out for
validation; the rest is cut into fixed-length training windows. The selection depends only on the
Python version, not on the machine.
"""

from __future__ import annotations

import os
from typing import List, Optional

import torch
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl

SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_directory() -> str:
    """Where this interpreter's standard library sources are."""
    return os.path.dirname(os.__file__)


def stdlib_source_files(root: Optional[str] = None) -> List[str]:
    """The standard library's ``.py`` files, as sorted paths relative to ``root``."""
    root = root or stdlib_directory()
    paths = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in SKIPPED_DIRECTORIES]
        paths.extend(os.path.relpath(os.path.join(directory, f), root) for f in files if f.endswith(".py"))
    return sorted(paths)


def read_stdlib_bytes(max_bytes: int = 2_000_000, root: Optional[str] = None) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the sorted standard library sources, as a uint8 tensor.

    Files are joined with a blank line; the last file is cut at ``max_bytes``.

    Example:
        >>> text = read_stdlib_bytes(1000)
        >>> text.dtype, text.numel()
        (torch.uint8, 1000)
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = root or stdlib_directory()
    chunks, total = [], 0
    for path in stdlib_source_files(root):
        with open(os.path.join(root, path), "rb") as f:
            chunk = f.read(max_bytes - total) + b"\n\n"
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    if len(data) < max_bytes:
        raise ValueError(f"the standard library at {root} holds only {len(data)} bytes of .py sources; lower max_bytes")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteWindows(Dataset):
    """Windows of ``seq_len + 1`` bytes at ``stride``; item ``i`` is ``(input, target)`` shifted by one byte."""

    def __init__(self, data: torch.Tensor, seq_len: int, stride: int, offset: int = 0) -> None:
        if data.numel() < offset + seq_len + 1:
            raise ValueError(f"{data.numel()} bytes are too few for one window of {seq_len + 1} bytes")
        self.data = data.long()
        self.seq_len = seq_len
        self.stride = stride
        self.offset = offset
        self.length = (data.numel() - offset - seq_len - 1) // stride + 1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        start = self.offset + index * self.stride
        window = self.data[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class StdlibTextDataModule(pl.LightningDataModule):
    """Next-byte prediction on the Python standard library's sources (no download).

    Args:
        max_bytes: how many bytes of sorted stdlib sources to read.
        seq_len: bytes per training window (the model's context length).
        batch_size: windows per batch.
        val_fraction: the share of the bytes, taken from the end, held out for validation.
        seed: picks the training windows' start offset and shuffles them.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        max_bytes: int = 2_000_000,
        seq_len: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.train_set: Optional[ByteWindows] = None
        self.val_set: Optional[ByteWindows] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        data = read_stdlib_bytes(hp.max_bytes)
        split = int(len(data) * (1.0 - hp.val_fraction))
        offset = int(torch.randint(hp.seq_len, (1,), generator=torch.Generator().manual_seed(hp.seed)))
        self.train_set = ByteWindows(data[:split], hp.seq_len, stride=hp.seq_len, offset=offset)
        self.val_set = ByteWindows(data[split:], hp.seq_len, stride=hp.seq_len)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True,
                          generator=generator, num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
