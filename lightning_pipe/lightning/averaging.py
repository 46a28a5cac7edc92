"""Lightning's weight averaging callbacks (``EMAWeightAveraging``, any ``WeightAveraging``) on a split module.

The callback keeps an ``AveragedModel``: a deep copy of the whole LightningModule, made before the
strategy splits it, whose tensors it zips with ``pl_module.parameters()`` and ``buffers()`` to
average, swap in for validation and copy back when training ends. Each stage holds only its own
layers (the others are meta tensors), so here the callback's copy is replaced, once the split is
installed, by one of the *split* module (:class:`StageAverage`): real where this rank holds the
tensor, meta where it does not. The callback's own code then runs unchanged on every rank, each
averaging its own tensors; the whole averaged model is what the owners of each tensor hold, and is
put together as the model itself is: at the end of ``fit`` (the callback copies the average into
the module first) and in checkpoints (:func:`averaged_state`).

Lightning offers no public way to give the callback another model, so this sets its private
``_average_model`` (and reads ``_device``, ``_use_buffers``, ``_kwargs``; calls ``_swap_models``),
as checked on Lightning 2.6.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel


try:
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover - Lightning before 2.6
    WeightAveraging = ()  # type: ignore[assignment,misc]


class StageAverage(nn.Module):
    """A copy of ``module``'s parameters and buffers, in the order ``parameters()`` and ``buffers()`` give them.

    Released (meta) tensors stay meta: nothing is allocated for them.

    Example:
        >>> module = nn.Linear(2, 2)
        >>> copy = StageAverage(module, torch.device("cpu"))
        >>> [tuple(p.shape) for p in copy.parameters()], copy.weight_0 is module.weight
        ([(2, 2), (2,)], False)
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        super().__init__()
        for i, p in enumerate(module.parameters()):
            self.register_parameter(f"weight_{i}", nn.Parameter(_copy(p, device), requires_grad=p.requires_grad))
        for i, b in enumerate(module.buffers()):
            self.register_buffer(f"buffer_{i}", _copy(b, device))

    def _pairs(self, module: nn.Module) -> Iterator[Tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, copy, tensor)``: each copy with ``module``'s tensor it was made from."""
        mine = itertools.chain(self._parameters.items(), self._buffers.items())
        for (name, copy), tensor in zip(mine, itertools.chain(module.parameters(), module.buffers())):
            yield name, copy, tensor

    def follow_releases(self, module: nn.Module) -> None:
        """Make meta the copies of the tensors ``module`` released since (after the first training step)."""
        for name, copy, tensor in list(self._pairs(module)):  # listed first: the loop replaces entries
            if tensor.is_meta and not copy.is_meta:
                meta = torch.empty_like(copy, device="meta")
                if name in self._parameters:
                    self._parameters[name] = nn.Parameter(meta, requires_grad=copy.requires_grad)
                else:
                    self._buffers[name] = meta

    def copy_from(self, module: nn.Module) -> None:
        """Set every copy this rank holds to ``module``'s value."""
        with torch.no_grad():
            for _, copy, tensor in self._pairs(module):
                if not copy.is_meta:
                    copy.copy_(tensor)


def _copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(tensor, device="meta") if tensor.is_meta else tensor.detach().to(device, copy=True)


def averaging_callbacks(callbacks: List[Any]) -> List[Any]:
    return [c for c in callbacks if isinstance(c, WeightAveraging)]


def adopt(callbacks: List[Any], module: nn.Module, device: torch.device,
          whole: Callable[[Any], Dict[str, Any]]) -> None:
    """Give each weight averaging callback an averaged copy of the split ``module`` (after setup, when fitting).

    Its ``on_load_checkpoint`` loads names the per-stage copy does not have: :func:`restore` does its work instead,
    when the strategy loads the module's state (just before the callbacks' hooks run). Its ``on_save_checkpoint``
    writes the per-stage copy's state into the checkpoint (``weight_0``, ...): ``whole(callback)`` (the strategy's,
    a collective) replaces it right after with the whole averaged model's, keyed as the model is, before the
    LightningModule's own hook sees it (a hook that keeps only the trainable weights filters it, as under DDP).
    """
    for callback in averaging_callbacks(callbacks):
        if callback._average_model is None:
            continue
        callback._average_model = AveragedModel(StageAverage(module, callback._device or device),
                                                use_buffers=callback._use_buffers, **callback._kwargs)
        callback.on_load_checkpoint = _restored_by_the_strategy
        callback.on_save_checkpoint = _saving_whole(callback, whole)


def _saving_whole(callback: Any, whole: Callable[[Any], Dict[str, Any]]) -> Callable[..., None]:
    def on_save_checkpoint(trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        type(callback).on_save_checkpoint(callback, trainer, pl_module, checkpoint)
        if "current_model_state" in checkpoint:  # it saved its average (while fitting)
            checkpoint["state_dict"] = whole(callback)
    return on_save_checkpoint


def _restored_by_the_strategy(trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
    """A weight averaging callback's ``on_load_checkpoint`` under PipeStrategy: :func:`restore` did it."""


def _adopted(callbacks: List[Any]) -> List[Any]:
    return [c for c in averaging_callbacks(callbacks)
            if c._average_model is not None and isinstance(c._average_model.module, StageAverage)]


def restore(callbacks: List[Any], module: nn.Module, checkpoint: Dict[str, Any],
            load: Callable[[Dict[str, Any]], None]) -> bool:
    """Load a checkpoint's weights and averages (what ``WeightAveraging.on_load_checkpoint`` does on one process).

    Args:
        load: loads a whole-model state dict into this rank's part of ``module``.

    Returns:
        False when no callback's average is this module's (the caller loads the checkpoint itself).
    """
    adopted = _adopted(callbacks)
    if not adopted:
        return False
    load(checkpoint["state_dict"])  # the averaged weights if saved with averaging; else the average starts from them
    for callback in adopted:
        callback._average_model.module.copy_from(module)
    if "current_model_state" in checkpoint and "averaging_state" in checkpoint:
        for callback in adopted:
            for name, value in checkpoint["averaging_state"].items():
                getattr(callback._average_model, name).copy_(value)
        load(checkpoint["current_model_state"])
    return True


def follow_releases(callbacks: List[Any], module: nn.Module) -> None:
    """After the first step released what this rank does not use: drop the averages of those tensors too."""
    for callback in _adopted(callbacks):  # with one stage the callback keeps its own copy: nothing is released
        callback._average_model.module.follow_releases(module)


def drop(callbacks: List[Any]) -> None:
    """After training: the callbacks copied their averages into the module, which is put together whole next; their
    per-stage copies would not match it (as under DDP, validation after ``fit`` then sees the averaged weights)."""
    for callback in _adopted(callbacks):
        callback._average_model = None
        callback.__dict__.pop("on_load_checkpoint", None)
        callback.__dict__.pop("on_save_checkpoint", None)


def averaged_state(callback: Any, module: Any, state: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """The module's state with ``callback``'s averaged weights swapped in (``state``: how the strategy reads it, a
    collective)."""
    callback._swap_models(module)
    try:
        return _detached(state(), module)
    finally:
        callback._swap_models(module)


def _detached(state: Dict[str, Any], module: nn.Module) -> Dict[str, Any]:
    """``state`` with copies of the tensors that are ``module``'s own (a sharded save's are, on the CPU): swapping
    the models back copies the current weights into them in place, before the save writes them."""
    own = {t.untyped_storage().data_ptr() for t in itertools.chain(module.parameters(), module.buffers()) if not t.is_meta}
    return {k: v.clone() if isinstance(v, torch.Tensor) and not v.is_meta and v.untyped_storage().data_ptr() in own
            else v for k, v in state.items()}
