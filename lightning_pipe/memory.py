"""Exact accounting of activation memory, from the tensors autograd saves for backward.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor saved during a forward. Counting
their storages (each once, parameters excluded) gives the bytes a microbatch keeps alive until its
backward: exact and deterministic, unlike allocator statistics, and available on the CPU.

Counting is a diagnostic, off in a pipeline unless asked for (``Pipeline(count_activations=True)``):
its hook runs Python for every tensor a forward saves, and unpacks each in the backward, which
cost 1.5 % of a step on ``benchmarks/pipeline_efficiency.py``'s model and a quarter of a step of
tiny layers. Off, a stage counts with :class:`MeterOff`, which hooks nothing.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Dict, Hashable, Iterable, Optional

import torch
from torch import nn

from lightning_pipe.errors import ConfigurationError


class _Counter:
    """Bytes of distinct tensors, each counted once by the bytes it spans (parameters excluded)."""

    __slots__ = ("exclude", "spans", "total", "_of_storage")

    def __init__(self, exclude: set) -> None:
        self.exclude = exclude
        self.spans: Dict[tuple, int] = {}  # (storage, first byte, end byte) -> bytes; disjoint per storage
        self.total = 0
        self._of_storage: Dict[int, list] = {}  # storage -> its spans' keys

    def count(self, tensor) -> None:
        # Count the bytes a tensor spans, not its whole storage: microbatches are views of one batch. Views of the
        # same bytes (a transpose, a reshape) count once, an expanded tensor (stride 0) by the bytes it reads, and
        # views that overlap (`h[:, 1:]` and `h[:, :-1]`) by their union.
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tensor.numel() == 0:
            return
        ptr = tensor.untyped_storage().data_ptr()
        if ptr == 0 or ptr in self.exclude:
            return
        size = tensor.element_size()
        start = tensor.storage_offset() * size
        end = start + size * (1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride())))
        if (ptr, start, end) in self.spans:
            return
        keys = self._of_storage.setdefault(ptr, [])
        for key in [k for k in keys if k[1] < end and start < k[2]]:  # overlapping: merged into one span
            start, end = min(start, key[1]), max(end, key[2])
            self.total -= self.spans.pop(key)
            keys.remove(key)
        keys.append((ptr, start, end))
        self.spans[(ptr, start, end)] = end - start
        self.total += end - start

    def pack(self, tensor):
        self.count(tensor)
        # Saved as a detached alias (same storage, so the same bytes and lifetime): a node that saves
        # its own output would otherwise hold that output, whose grad_fn is the node, through the
        # hook's packed object, a reference cycle autograd only breaks when a backward frees the
        # graph. A split backward keeps the graph for W (retain_graph), so each step leaked the
        # activations of every microbatch (about 8 MiB a step on benchmarks/pipeline_efficiency.py's
        # stages under ZB-H1), and steps slowed down as memory grew. The version is kept because
        # autograd skips its in-place check for tensors saved through hooks (see _unpack).
        return tensor.detach(), tensor._version


class ActivationMeter:
    """Counts the activation bytes each pending microbatch holds on one stage.

    Args:
        parameters: tensors whose storage is never counted (the stage's parameters).
        parent: a meter that also counts these bytes (a rank's meter summing its stages'); it
            counts bytes that two stages hold (a same-rank hand-off) once.

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
        self._spans: Dict[Hashable, Dict[tuple, int]] = {}  # microbatch -> the spans it holds
        self._holders: Dict[tuple, int] = {}  # span -> how many children's microbatches hold it
        self.parent = parent
        self.held_bytes = 0
        self.peak_bytes = 0

    def record(self, key: Hashable, inputs: Iterable) -> "_Recording":
        """Context manager counting what the forward of microbatch ``key`` saves.

        ``inputs`` are the stage inputs the stage itself keeps alive (they count too, once).
        """
        counter = _Counter(self._parameter_storages)
        for tensor in inputs:
            counter.count(tensor)
        return _Recording(self, key, counter)

    def add(self, key: Hashable, tensors: Iterable) -> None:
        """Microbatch ``key`` also holds ``tensors`` (e.g. activations recomputed for its backward)."""
        counter = _Counter(self._parameter_storages)
        for tensor in tensors:
            counter.count(tensor)
        self._hold(key, counter.spans)

    def release(self, key: Hashable) -> None:
        """The backward of microbatch ``key`` ran: its activations are freed."""
        spans = self._spans.pop(key, {})
        self._change(-sum(spans.values()))
        if self.parent is not None:
            self.parent._drop(spans)

    def _hold(self, key: Hashable, spans: Dict[tuple, int]) -> None:
        held = self._spans.get(key)
        if held is None:
            held = self._spans[key] = new = spans
        else:
            new = {span: nbytes for span, nbytes in spans.items() if span not in held}
            held.update(new)
        self._change(sum(new.values()))
        if self.parent is not None:
            self.parent._take(new)

    def _take(self, spans: Dict[tuple, int]) -> None:
        """A child holds ``spans``: count those no other child holds."""
        added = 0
        for span, nbytes in spans.items():
            count = self._holders.get(span, 0)
            self._holders[span] = count + 1
            if count == 0:
                added += nbytes
        self._change(added)

    def _drop(self, spans: Dict[tuple, int]) -> None:
        removed = 0
        for span, nbytes in spans.items():
            count = self._holders.pop(span) - 1
            if count:
                self._holders[span] = count
            else:
                removed += nbytes
        self._change(-removed)

    def _change(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        if self.held_bytes > self.peak_bytes:
            self.peak_bytes = self.held_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes


class MeterOff:
    """A stage's meter when counting is off: nothing hooked, nothing counted; reading a count raises.

    Example:
        >>> meter = MeterOff()
        >>> with meter.record(0, inputs=()):
        ...     pass
        >>> meter.peak_bytes
        Traceback (most recent call last):
        ...
        lightning_pipe.errors.ConfigurationError: activation bytes are counted only when asked for: build the pipeline with count_activations=True
    """

    def record(self, key: Hashable, inputs: Iterable) -> nullcontext:
        return nullcontext()

    def add(self, key: Hashable, tensors: Iterable) -> None:
        pass

    def release(self, key: Hashable) -> None:
        pass

    def reset_peak(self) -> None:
        self._refuse()

    @property
    def held_bytes(self) -> int:
        self._refuse()

    @property
    def peak_bytes(self) -> int:
        self._refuse()

    @staticmethod
    def _refuse() -> None:
        raise ConfigurationError(
            "activation bytes are counted only when asked for: build the pipeline with count_activations=True"
        )


def _unpack(packed):
    """The saved tensor, after autograd's own check that nothing changed it in place since it was saved."""
    tensor, version = packed
    if tensor._version != version:  # the alias shares the original's version counter
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{type(tensor).__name__} of shape {list(tensor.shape)} was saved at version {version} and is now at "
            f"version {tensor._version}; use an out-of-place operation instead (autograd raises the same error "
            "without a pipeline)"
        )
    return tensor


class _Recording(torch.autograd.graph.saved_tensors_hooks):
    """The hooks of one :meth:`ActivationMeter.record`: count while the forward saves tensors."""

    def __init__(self, meter: ActivationMeter, key: Hashable, counter: _Counter) -> None:
        super().__init__(counter.pack, _unpack)
        self.meter, self.key, self.counter = meter, key, counter

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.meter._hold(self.key, self.counter.spans)
