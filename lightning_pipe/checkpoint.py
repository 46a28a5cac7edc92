"""Activation checkpoint policies: which microbatches recompute their forward during backward.

``"always"`` checkpoints every microbatch, ``"except_last"`` all but the last one (its backward
runs first under GPipe, so storing it costs nothing extra), ``"never"`` none. Built on
``torch.utils.checkpoint`` in its non-reentrant form, which supports inputs without gradients,
keyword-free tuples and nested autograd. :func:`is_checkpointing` and :func:`is_recomputing` let a
module tell the first forward from its recomputation (e.g. to skip side effects twice).

A backward split in two (input gradients ``I`` now, weight gradients ``W`` later) runs two
autograd passes over one graph. torch's checkpoint recomputes once per pass (its recomputed
tensors are kept per graph task), so :class:`Recomputation` does it differently: the saved
tensors of one checkpointed forward are recomputed once, at the first unpack, and kept until the
stage releases them after ``W``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Union

import torch
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


class Recomputation:
    """One checkpointed forward whose saved tensors are recomputed once and kept until released.

    Args:
        function: the forward to run (``function(*inputs)``).
        restore_rng: puts the random generators in the state the forward started from (the
            stage's per-microbatch seed); it runs inside ``torch.random.fork_rng``.
        on_recompute: called with the recomputed tensors (the stage counts their bytes).

    Example:
        >>> layer = torch.nn.Linear(3, 3)
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> recomputation = Recomputation(lambda t: layer(t).tanh(), lambda: None)
        >>> y = recomputation.run(x)
        >>> (gx,) = torch.autograd.grad(y.sum(), x, retain_graph=True)  # recomputes
        >>> gw = torch.autograd.grad(y.sum(), layer.weight)  # reuses what it recomputed
        >>> recomputation.recomputed, recomputation.release()
        (1, None)
    """

    def __init__(self, function: Callable, restore_rng: Callable[[], None],
                 on_recompute: Optional[Callable[[List[torch.Tensor]], None]] = None) -> None:
        self.function = function
        self.restore_rng = restore_rng
        self.on_recompute = on_recompute
        self.recomputed = 0  # how many times the forward was recomputed (at most once)
        self._inputs: tuple = ()
        self._count = 0  # tensors saved by the first forward
        self._tensors: Optional[List[torch.Tensor]] = None
        self._autocast: tuple = ()

    def run(self, *inputs):
        """Run the forward, keeping only ``inputs`` (and handles) for the backward."""
        self._inputs = inputs
        self._autocast = autocast_state()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), _phase("checkpointing"):
            return self.function(*inputs)

    def _pack(self, tensor: torch.Tensor) -> int:
        self._count += 1
        return self._count - 1

    def _unpack(self, index: int) -> torch.Tensor:
        if self._tensors is None:
            self._recompute()
        return self._tensors[index]

    def _recompute(self) -> None:
        saved: List[torch.Tensor] = []

        def keep(tensor: torch.Tensor) -> int:
            saved.append(tensor.detach())  # detached: holding outputs must not keep their graph alive
            return 0

        inputs = tuple(x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                       for x in self._inputs)
        with torch.random.fork_rng(devices=_cuda_devices()), torch.enable_grad(), _autocast(self._autocast):
            self.restore_rng()
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda _: None), _phase("recomputing"):
                self.function(*inputs)
        if len(saved) != self._count:
            raise RuntimeError(
                f"the recomputed forward saved {len(saved)} tensors for backward, the first forward "
                f"{self._count}: a checkpointed forward must do the same work when it runs again "
                "(use lightning_pipe.is_recomputing() to tell the passes apart)"
            )
        self._tensors = saved
        self.recomputed += 1
        if self.on_recompute is not None:
            self.on_recompute(saved)

    def release(self) -> None:
        """Drop what was kept (after the weight gradients)."""
        self._tensors = None
        self._inputs = ()


def _cuda_devices() -> list:
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def autocast_state() -> tuple:
    """The autocast on now: ``(device type, dtype)`` for each device type (cpu, cuda) where it is enabled."""
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


def saved_tensors_pack() -> Optional[Callable]:
    """The pack function of the innermost ``torch.autograd.graph.saved_tensors_hooks`` on now, or None.

    Private API: torch has no public way to read the hooks on now, and the body-call check (see
    :meth:`~lightning_pipe.lightning.steps.StepRunner.run`) needs to see hooks a step put around the body.
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top[0] if top else None


@contextmanager
def _autocast(states: tuple) -> Iterator[None]:
    if not states:
        yield
        return
    from contextlib import ExitStack

    with ExitStack() as stack:
        for device, dtype in states:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield
