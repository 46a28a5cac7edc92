"""Exact accounting of activation memory, from the tensors autograd saves for backward.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor saved during a forward. Counting
their storages (each once, parameters excluded) gives the bytes a microbatch keeps alive until its
backward: exact and deterministic, unlike allocator statistics, and available on the CPU.
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch
from torch import nn


class ActivationMeter:
    """Counts the activation bytes each pending microbatch holds on one stage.

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

    def __init__(self, parameters: Iterable[nn.Parameter]) -> None:
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._bytes: Dict[int, int] = {}
        self.held_bytes = 0
        self.peak_bytes = 0

    def record(self, microbatch_index: int, inputs: Iterable):
        """Context manager counting what the forward of ``microbatch_index`` saves.

        ``inputs`` are the stage inputs the stage itself keeps alive (they count too, once).
        """
        seen = set()
        total = [0]

        def count(tensor) -> None:
            # Count the bytes a tensor spans, not its whole storage: microbatches are views of one
            # batch. Views of the same bytes (a transpose, a reshape) are counted once.
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                return
            ptr = tensor.untyped_storage().data_ptr()
            if ptr == 0 or ptr in self._parameter_storages:
                return
            key = (ptr, tensor.storage_offset(), tensor.numel())
            if key in seen:
                return
            seen.add(key)
            total[0] += tensor.numel() * tensor.element_size()

        for tensor in inputs:
            count(tensor)

        def pack(tensor):
            count(tensor)
            return tensor

        meter = self

        class _Recorder(torch.autograd.graph.saved_tensors_hooks):
            def __exit__(self, *exc):
                super().__exit__(*exc)
                meter._bytes[microbatch_index] = total[0]
                meter.held_bytes += total[0]
                meter.peak_bytes = max(meter.peak_bytes, meter.held_bytes)

        return _Recorder(pack, lambda tensor: tensor)

    def release(self, microbatch_index: int) -> None:
        """The backward of ``microbatch_index`` ran: its activations are freed."""
        self.held_bytes -= self._bytes.pop(microbatch_index, 0)

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes
