"""Every stage of a pipeline must load the same batch: a fingerprint of it, checked every step.

Under PipeStrategy each process of a pipeline loads the batch itself: the first stage feeds the
body from it, the last stage computes the loss from it. If they load different batches, the
loss pairs one batch's outputs with another's labels and training goes on, silently wrong.
Lightning's sampler gives every stage of a pipeline the same batches (``num_replicas`` is the
number of replicas), but what it does not control can differ by process: an ``IterableDataset``
or a sampler sharded by global rank (``trainer.global_rank``, ``dist.get_rank()``,
``split_dataset_by_node``), a random transform seeded per process. Nothing a library can inspect
tells these apart from correct code, so the batches themselves are compared: each rank takes a
fingerprint of its batch, the last stage's travels with the step's results (no extra message),
and every other rank compares it with its own and raises :class:`~lightning_pipe.errors.
BatchMismatchError` on a difference.

The fingerprint reads at most :data:`SAMPLES` evenly spaced values of each tensor (a few
microseconds, whatever the batch's size), weighted by position so that a reordering shows too,
plus each tensor's shape and dtype and the batch's numbers and strings. It is kept as a tensor on
the batch's device until it is compared, after the step, so that it adds no device
synchronization.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping
from typing import Any, List, Optional, Tuple

import torch

from lightning_pipe.errors import BatchMismatchError

SAMPLES = 1024  # values read per tensor
_RTOL = 1e-9  # of the sum of magnitudes: rounding moves a sum far less, a different batch far more


class Fingerprint:
    """A batch's fingerprint: per tensor a weighted sum of sampled values; the structure, as text."""

    __slots__ = ("sums", "structure")

    def __init__(self, sums: List[torch.Tensor], structure: str) -> None:
        self.sums = sums
        self.structure = structure

    def value(self) -> Tuple[Tuple[Tuple[float, float], ...], int]:
        """``(per-tensor (sum, sum of magnitudes), crc32 of the structure)`` as Python numbers (synchronizes
        with the device)."""
        return tuple((float(s[0]), float(s[1])) for s in self.sums), zlib.crc32(self.structure.encode())


def fingerprint(batch: Any) -> Fingerprint:
    """The fingerprint of ``batch`` (tensors, numbers and strings in dicts, lists, tuples, dataclasses).

    Example:
        >>> a = {"x": torch.arange(6.0).reshape(3, 2), "y": torch.tensor([0, 1, 1])}
        >>> same(fingerprint(a).value(), fingerprint({k: v.clone() for k, v in a.items()}).value())
        True
        >>> same(fingerprint(a).value(), fingerprint({"x": a["x"].flip(0), "y": a["y"]}).value())
        False
    """
    sums: List[torch.Tensor] = []
    parts: List[str] = []
    _walk(batch, sums, parts)
    return Fingerprint(sums, "|".join(parts))


def _walk(value: Any, sums: List[torch.Tensor], parts: List[str]) -> None:
    if isinstance(value, torch.Tensor):
        parts.append(f"T{tuple(value.shape) if not value.is_nested else 'nested'}{value.dtype}{value.layout}")
        if value.layout == torch.strided and not value.is_nested and not value.is_quantized:
            sums.append(_tensor_sum(value))  # a sparse, nested or quantized tensor: its shape only
    elif isinstance(value, Mapping):
        for key, item in value.items():
            parts.append(f"K{key!r}")
            _walk(item, sums, parts)
    elif isinstance(value, (list, tuple)):
        parts.append(f"L{len(value)}")
        for item in value:
            _walk(item, sums, parts)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            parts.append(f"K{field.name}")
            _walk(getattr(value, field.name), sums, parts)
    elif isinstance(value, (str, bytes, int, float, bool)) or value is None:
        parts.append(repr(value))
    # anything else (a PIL image, an object whose repr holds its address) is not compared


def _tensor_sum(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=flat.device)
    sample = flat[:: max(flat.numel() // SAMPLES, 1)][:SAMPLES].to(torch.float64)
    weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
    terms = torch.nan_to_num(sample, nan=0.5, posinf=1e30, neginf=-1e30) * weights
    return torch.stack([terms.sum(), terms.abs().sum()])


def same(a: tuple, b: tuple) -> bool:
    """Whether two fingerprint values (:meth:`Fingerprint.value`) describe the same batch.

    Sums may differ in their last bits where two processes reduce in another order (another CPU's
    vector width): the tolerance is relative to the sum of the terms' magnitudes.
    """
    (sums_a, structure_a), (sums_b, structure_b) = a, b
    return structure_a == structure_b and len(sums_a) == len(sums_b) and all(
        abs(x - y) <= _RTOL * max(mx, my) and math.isclose(mx, my, rel_tol=_RTOL)
        for (x, mx), (y, my) in zip(sums_a, sums_b))


def check(mine: Fingerprint, last: Optional[Tuple[Tuple[float, ...], int]], hook: str, step: int, rank: int,
          last_rank: int) -> None:
    """Raise :class:`BatchMismatchError` if this rank's batch is not the last stage's (``last``)."""
    if last is None or same(mine.value(), last):
        return
    raise BatchMismatchError(
        f"{hook} at step {step}: the batch this process (global rank {rank}) loaded differs from the one the last "
        f"stage's process (global rank {last_rank}) loaded. Every process of a pipeline must load the same batch: the "
        "last stage would pair the body's outputs for one batch with another's labels. Shard data by replica, not by "
        "process: Lightning's sampler does (`trainer.strategy.distributed_sampler_kwargs`); an IterableDataset or a "
        "sampler of your own should use `trainer.strategy.dp_rank` and `trainer.strategy.dp_size` where it uses the "
        "global rank and world size (`split_dataset_by_node` included), and a random transform must not be seeded "
        "by process"
    )
