"""Every stage of a pipeline must load the same batch: a fingerprint of it, checked every step.

Under PipeStrategy each process of a pipeline loads the batch itself: the first stage feeds the
body from it, the last stage computes the loss from it. If they load different batches, the
loss pairs one batch's outputs with another's labels and training goes on, silently wrong.
Lightning's sampler gives every stage of a pipeline the same batches (``num_replicas`` is the
number of replicas), but what it does not control can differ by process: an ``IterableDataset``
or a sampler sharded by global rank (``trainer.global_rank``, ``dist.get_rank()``,
``split_dataset_by_node``), a random transform seeded per process. Nothing a library can inspect
tells these apart from correct code, so the batches themselves are compared: each rank takes a
fingerprint of its batch, the last stage's travels with the step's results (a few numbers per
tensor, no extra message), and every other rank compares it with its own and raises
:class:`~lightning_pipe.errors.BatchMismatchError` on a difference. The first batch of each step
hook (``training_step``, ``validation_step``, ...) since the strategy's setup is compared by every
rank, before its step (:func:`check_together`), so that a batch sharded or drawn by process stops
every rank with that error, the last stage's included.

The fingerprint reads at most :data:`SAMPLES` evenly spaced values of each of the batch's first
:data:`TENSORS` tensors (the values themselves, never a copy of the tensor), weighted by position
so that a reordering shows too, plus every tensor's shape, dtype and layout and the batch's
numbers and strings. Values computed with other rounding on another process (a GPU transform
under ``cudnn.benchmark``, another CPU's vector width) still compare equal: the tolerance is a few
units in the last place of the tensor's dtype, relative to the values' magnitudes; a different
sample or draw differs far more. On an accelerator the sums are copied to the host as soon as they
are computed, and the comparison after the step waits for that copy only, not for the step.

From its second training step on, a rank other than the last reads its values where it first
waits in the step, not before the step (:func:`fingerprint` with ``deferred``): at its start the
whole pipeline waits for the first stage. The first step is read before it runs: a step may write
into its batch in place, and from the first write on, each run of the step gets a copy of its
microbatch (see :class:`~lightning_pipe.lightning.steps.StepRunner`). A write into the batch
before the read (a step that starts writing only later; a microbatch's slice counts its own
writes, so the pipeline's record of its slices tells of those) leaves that step's fingerprint without a value; it is not
compared, and the rank reads its values before its later steps.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lightning_pipe.errors import BatchMismatchError
from lightning_pipe.microbatch import written_since

SAMPLES = 1024  # values read per tensor
TENSORS = 16  # tensors read per batch (the rest: shape and dtype only)
_ULPS = 16  # tolerance, in units of the dtype's last place, relative to the sum of magnitudes
_EXACT = 1e-12  # for integers and booleans: only the float64 sums' own rounding

Value = Tuple[Tuple[Tuple[float, float, float], ...], int]  # per tensor (sum, sum of magnitudes, rtol); structure


class Fingerprint:
    """A batch's fingerprint: per sampled tensor a weighted sum and the sum of magnitudes; the structure.

    Taken in two parts: the structure and the tensors to read when it is made, the sums when
    :meth:`compute` runs (at once, or later in the step where the rank would otherwise wait: see
    :func:`fingerprint`). A tensor written into in between (the step changed its batch in place)
    leaves the fingerprint without a value (:attr:`written`): it is not compared.
    """

    __slots__ = ("_tensors", "_versions", "_tolerances", "_structure", "_copies", "written")

    def __init__(self, tensors: List[torch.Tensor], tolerances: List[float], structure: str) -> None:
        self._tensors = tensors
        self._versions = [(t, t._version) for t in tensors if not t.is_inference()]  # an inference tensor has none
        self._tolerances = tolerances
        self._structure = structure
        self._copies: Optional[List[Tuple[torch.Tensor, Any]]] = None  # per device: the sums on the host, copy event
        self.written = False

    def compute(self, written: bool = False) -> None:
        """Read the sampled values now (a second call does nothing); ``written``: the caller saw a write into the
        batch's memory that the batch's own tensors do not count (a microbatch's slice has its own version)."""
        if self._copies is not None or self.written:
            return
        if written or written_since(self._versions):
            self.written = True
            return
        self._copies = []
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for t in self._tensors:
            by_device.setdefault(t.device, []).append(_tensor_sums(t))
        for device, group in by_device.items():
            stacked = torch.stack(group)
            if device.type == "cuda":
                event = torch.cuda.Event()
                host = stacked.to("cpu", non_blocking=True)
                event.record()
                self._copies.append((host, event))
            else:
                self._copies.append((stacked.cpu(), None))
        self._tensors = self._versions = []  # the batch is not kept beyond what is read

    def value(self) -> Optional[Value]:
        """The fingerprint as Python numbers (None if :attr:`written`): waits for its own copy to the host, not for
        later work."""
        self.compute()
        if self.written:
            return None
        rows: List[List[float]] = []
        for host, event in self._copies:
            if event is not None:
                event.synchronize()
            rows.extend(host.tolist())
        return (tuple((s, m, t) for (s, m), t in zip(rows, self._tolerances)),
                zlib.crc32(self._structure.encode()))


def fingerprint(batch: Any, deferred: bool = False) -> Fingerprint:
    """The fingerprint of ``batch`` (tensors, numbers and strings in dicts, lists, tuples, dataclasses).

    With ``deferred``, the values are read when :meth:`Fingerprint.compute` is called, not now, if
    no tensor of the batch is an inference tensor (which has no version to tell a write by).

    Example:
        >>> a = {"x": torch.arange(6.0).reshape(3, 2), "y": torch.tensor([0, 1, 1])}
        >>> same(fingerprint(a).value(), fingerprint({k: v.clone() for k, v in a.items()}).value())
        True
        >>> same(fingerprint(a).value(), fingerprint({"x": a["x"].flip(0), "y": a["y"]}).value())
        False
        >>> later = fingerprint(a, deferred=True)
        >>> _ = a["x"].mul_(2)  # written into before its values were read: no value, not compared
        >>> later.value() is None, later.written
        (True, True)
    """
    tensors: List[torch.Tensor] = []
    tolerances: List[float] = []
    parts: List[str] = []
    _walk(batch, tensors, tolerances, parts)
    made = Fingerprint(tensors, tolerances, "|".join(parts))
    if not deferred or len(made._versions) < len(tensors):
        made.compute()
    return made


def _walk(value: Any, tensors: List[torch.Tensor], tolerances: List[float], parts: List[str]) -> None:
    if isinstance(value, torch.Tensor):
        parts.append(f"T{tuple(value.shape) if not value.is_nested else 'nested'}{value.dtype}{value.layout}")
        readable = value.layout == torch.strided and not value.is_nested and not value.is_quantized
        if readable and len(tensors) < TENSORS:  # a sparse, nested or quantized tensor: its shape only
            tensors.append(value)
            inexact = value.dtype.is_floating_point or value.is_complex()
            tolerances.append(_ULPS * torch.finfo(value.dtype).eps if inexact else _EXACT)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            parts.append(f"K{key!r}")
            _walk(item, tensors, tolerances, parts)
    elif isinstance(value, (list, tuple)):
        parts.append(f"L{len(value)}")
        for item in value:
            _walk(item, tensors, tolerances, parts)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            parts.append(f"K{field.name}")
            _walk(getattr(value, field.name), tensors, tolerances, parts)
    elif isinstance(value, (str, bytes, int, float, bool)) or value is None:
        parts.append(repr(value))
    # anything else (a PIL image, an object whose repr holds its address) is not compared


def _tensor_sums(tensor: torch.Tensor) -> torch.Tensor:
    """``[weighted sum, sum of magnitudes]`` of up to SAMPLES values of ``tensor`` in row-major order (float64)."""
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    n = t.numel()
    if n == 0:
        return torch.zeros(2, dtype=torch.float64, device=t.device)
    step = max(n // SAMPLES, 1)
    if t.is_contiguous():
        sample = t.view(-1)[::step][:SAMPLES]
    else:  # index the values themselves: reshape would copy the whole tensor (an expanded mask, channels_last)
        index = torch.arange(0, n, step, device=t.device)[:SAMPLES]
        sample = t[torch.unravel_index(index, t.shape)]
    sample = torch.nan_to_num(sample.to(torch.float64), nan=0.5, posinf=1e300, neginf=-1e300)
    return torch.stack([sample, sample.abs()]) @ _weights(sample.numel(), t.device)  # weights <= 1: no overflow


@functools.lru_cache(maxsize=64)
def _weights(n: int, device: torch.device) -> torch.Tensor:
    """Position weights ``1/n, 2/n, ..., 1`` (made once per size and device: the fingerprint runs every step)."""
    return torch.arange(1, n + 1, dtype=torch.float64, device=device) / n


def same(a: Value, b: Value) -> bool:
    """Whether two fingerprint values (:meth:`Fingerprint.value`) describe the same batch."""
    (sums_a, structure_a), (sums_b, structure_b) = a, b
    return structure_a == structure_b and len(sums_a) == len(sums_b) and all(
        x == y or abs(x - y) <= tol * max(mx, my) for (x, mx, tol), (y, my, _) in zip(sums_a, sums_b))


def check_together(mine: Fingerprint, group: Any, last: int, hook: str, step: int, global_ranks: List[int]) -> None:
    """Compare every rank's fingerprint with the last stage's in one collective over the pipeline's ``group``; raise
    :class:`BatchMismatchError` on every rank if any differs.

    :func:`check` after each step raises on the ranks that differ only; the last stage, which went on, would meet
    them next in a collective they never reach. A batch sharded or drawn by process differs from the first batch
    on, so PipeStrategy compares the first batch of each step hook here, before its step (``last``: the last stage's
    rank in ``group``; ``global_ranks``: each group rank's global rank, for the message).
    """
    values: List[Optional[Value]] = [None] * len(global_ranks)
    dist.all_gather_object(values, mine.value(), group=group)
    reference = values[last]
    differ = [global_ranks[r] for r, value in enumerate(values)
              if value is not None and reference is not None and not same(value, reference)]
    if differ:
        raise BatchMismatchError(
            f"{hook} at step {step}: the batches the processes of global ranks {differ} loaded differ from the one the "
            f"last stage's process (global rank {global_ranks[last]}) loaded. {_FIX}")


def check(mine: Fingerprint, last: Optional[Value], hook: str, step: int, rank: int, last_rank: int) -> None:
    """Raise :class:`BatchMismatchError` if this rank's batch is not the last stage's (``last``; None: not taken).

    A fingerprint left without a value (:attr:`Fingerprint.written`) is not compared."""
    value = mine.value()
    if last is None or value is None or same(value, last):
        return
    raise BatchMismatchError(
        f"{hook} at step {step}: the batch this process (global rank {rank}) loaded differs from the one the last "
        f"stage's process (global rank {last_rank}) loaded. {_FIX}")


_FIX = ("Every process of a pipeline must load the same batch: the last stage would pair the body's outputs for one "
        "batch with another's labels. Shard data by replica, not by process: Lightning's sampler does "
        "(`trainer.strategy.distributed_sampler_kwargs`); an IterableDataset or a sampler of your own should use "
        "`trainer.strategy.dp_rank` and `trainer.strategy.dp_size` where it uses the global rank and world size "
        "(`split_dataset_by_node` included), and a random transform must not be seeded by process")
