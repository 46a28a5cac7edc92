"""Exact accounting of activation memory, from the tensors autograd saves for backward.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor saved during a forward. Counting
their storages (each once, parameters excluded) gives the bytes a microbatch keeps alive until its
backward: exact and deterministic, unlike allocator statistics, and available on the CPU.
"""

from __future__ import annotations

from typing import Dict, Hashable, Iterable, Optional

import torch
from torch import nn


class _Counter:
    """Bytes of distinct tensors, each counted once by the bytes it spans (parameters excluded)."""

    __slots__ = ("exclude", "seen", "total")

    def __init__(self, exclude: set) -> None:
        self.exclude = exclude
        self.seen: set = set()
        self.total = 0

    def count(self, tensor) -> None:
        # Count the bytes a tensor spans, not its whole storage: microbatches are views of one
        # batch. Views of the same bytes (a transpose, a reshape) are counted once.
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        ptr = tensor.untyped_storage().data_ptr()
        if ptr == 0 or ptr in self.exclude:
            return
        key = (ptr, tensor.storage_offset(), tensor.numel())
        if key in self.seen:
            return
        self.seen.add(key)
        self.total += tensor.numel() * tensor.element_size()

    def pack(self, tensor):
        self.count(tensor)
        return tensor


class ActivationMeter:
    """Counts the activation bytes each pending microbatch holds on one stage.

    Args:
        parameters: tensors whose storage is never counted (the stage's parameters).
        parent: a meter that also counts these bytes (a rank's meter summing its stages').

    Example:
        >>> layer = nn.Linear(4, 4)
        >>> meter = ActivationMeter(layer.parameters())
        >>> with meter.record(0, inputs=()):
        ...     y = layer(torch.ones(2, 4)).relu()
        >>> meter.held_bytes, meter.peak_bytes
        (64, 64)
        >>> meter.release(0); meter.held_bytes
        0
    """

    def __init__(self, parameters: Iterable[nn.Parameter] = (), parent: Optional["ActivationMeter"] = None) -> None:
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._bytes: Dict[Hashable, int] = {}
        self.parent = parent
        self.held_bytes = 0
        self.peak_bytes = 0

    def record(self, key: Hashable, inputs: Iterable):
        """Context manager counting what the forward of microbatch ``key`` saves.

        ``inputs`` are the stage inputs the stage itself keeps alive (they count too, once).
        """
        counter = _Counter(self._parameter_storages)
        for tensor in inputs:
            counter.count(tensor)
        meter = self

        class _Recorder(torch.autograd.graph.saved_tensors_hooks):
            def __exit__(self, *exc):
                super().__exit__(*exc)
                meter.add(key, counter.total)

        return _Recorder(counter.pack, lambda tensor: tensor)

    def add(self, key: Hashable, nbytes: int) -> None:
        """Microbatch ``key`` holds ``nbytes`` more (e.g. activations recomputed for its backward)."""
        self._bytes[key] = self._bytes.get(key, 0) + nbytes
        self._change(nbytes)

    def count(self, tensors: Iterable) -> int:
        """The bytes ``tensors`` span, each counted once, parameters excluded (nothing is added)."""
        counter = _Counter(self._parameter_storages)
        for tensor in tensors:
            counter.count(tensor)
        return counter.total

    def release(self, key: Hashable) -> None:
        """The backward of microbatch ``key`` ran: its activations are freed."""
        self._change(-self._bytes.pop(key, 0))

    def _change(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        if self.held_bytes > self.peak_bytes:
            self.peak_bytes = self.held_bytes
        if self.parent is not None:
            self.parent._change(nbytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes
