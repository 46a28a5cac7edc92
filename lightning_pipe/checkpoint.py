"""Activation checkpoint policies: which microbatches recompute their forward during backward.

``"always"`` checkpoints every microbatch, ``"except_last"`` all but the last one (its backward
runs first under GPipe, so storing it costs nothing extra), ``"never"`` none. Built on
``torch.utils.checkpoint`` in its non-reentrant form, which supports inputs without gradients,
keyword-free tuples and nested autograd. :func:`is_checkpointing` and :func:`is_recomputing` let a
module tell the first forward from its recomputation (e.g. to skip side effects twice).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Union

import torch.utils.checkpoint

from lightning_pipe.errors import ConfigurationError

CHECKPOINT_MODES = ("always", "except_last", "never")

_state = threading.local()


def check_checkpoint(checkpoint: Union[str, bool]) -> str:
    """Normalise a checkpoint argument: ``True`` means ``"always"``, ``False`` means ``"never"``."""
    if checkpoint is True:
        return "always"
    if checkpoint is False:
        return "never"
    if checkpoint not in CHECKPOINT_MODES:
        raise ConfigurationError(f"checkpoint must be one of {CHECKPOINT_MODES} (or a bool), got {checkpoint!r}")
    return checkpoint


def should_checkpoint(mode: str, microbatch_index: int, num_microbatches: int) -> bool:
    """Whether ``mode`` checkpoints this microbatch.

    Example:
        >>> [should_checkpoint("except_last", i, 3) for i in range(3)]
        [True, True, False]
    """
    if mode == "always":
        return True
    if mode == "except_last":
        return microbatch_index < num_microbatches - 1
    return False


def is_checkpointing() -> bool:
    """True inside the first (checkpointed) forward of a microbatch."""
    return getattr(_state, "phase", None) == "checkpointing"


def is_recomputing() -> bool:
    """True inside the recomputation of a checkpointed forward during backward."""
    return getattr(_state, "phase", None) == "recomputing"


@contextmanager
def _phase(name: str) -> Iterator[None]:
    previous = getattr(_state, "phase", None)
    _state.phase = name
    try:
        yield
    finally:
        _state.phase = previous


def checkpointed(function: Callable, *inputs):
    """Run ``function(*inputs)`` under non-reentrant activation checkpointing."""
    calls = []

    def run(*args):
        with _phase("recomputing" if calls else "checkpointing"):
            calls.append(None)
            return function(*args)

    return torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=False)
