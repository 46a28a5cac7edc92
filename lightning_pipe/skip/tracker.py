"""Where stashed tensors wait for their pop.

Outside a pipeline a thread-local default tracker holds them (stash in one layer, pop in a later
layer of the same forward). Inside a pipeline each stage binds a tracker per microbatch, which the
executor fills with skip tensors received from earlier stages and empties of those sent to later
stages.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Dict, Iterator, Optional, Tuple

import torch

Key = Tuple[Optional[int], str]  # (namespace id, name)

_local = threading.local()


class SkipTracker:
    """Stashed tensors by (namespace id, name)."""

    def __init__(self, tensors: Optional[Dict[Key, torch.Tensor]] = None) -> None:
        self.tensors: Dict[Key, torch.Tensor] = dict(tensors or {})

    def save(self, key: Key, tensor: torch.Tensor) -> None:
        self.tensors[key] = tensor

    def load(self, key: Key) -> torch.Tensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"pop of skip {key[1]!r} (namespace {key[0]}) found nothing stashed") from None


def current_tracker() -> SkipTracker:
    tracker = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.default = getattr(_local, "default", None) or SkipTracker()
    return tracker


@contextmanager
def use_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield tracker
    finally:
        _local.tracker = previous
