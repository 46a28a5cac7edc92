"""Balancing the body by measurement: one sample batch, the body's input, per-layer costs.

``PipeStrategy(balance="time" | "memory" | "flops")`` takes one batch from the training data at
setup (with every random generator restored afterwards, so training sees the same data and
draws), runs the user's ``training_step`` up to the body call to learn the body's input (its logs
are dropped), and costs each layer with :func:`~lightning_pipe.partition.layer_times`,
:func:`~lightning_pipe.partition.layer_memory` or :func:`~lightning_pipe.partition.layer_flops`.
Global rank 0 measures; every rank then receives the same balance (times differ between ranks).
A layer list's blocks are costed with their extra arguments bound.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.lightning.body import set_submodule
from lightning_pipe.lightning.layer_list import _hidden_of
from lightning_pipe.lightning.logs import LogRecorder, load_metric_states, metric_states
from lightning_pipe.partition import layer_flops, layer_memory, layer_times, meta_like

MEASURES: Dict[str, Callable[[nn.Sequential, Any], List[float]]] = {
    "time": layer_times, "memory": layer_memory, "flops": layer_flops,
}
BALANCES = ("parameters",) + tuple(MEASURES)
UNITS = {"time": ("ms", 1e3), "memory": ("MiB", 1 / 2**20), "flops": ("GFLOP", 1e-9)}


class _Reached(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("the body was reached")
        self.args_, self.kwargs = args, kwargs


class _Capture(nn.Module):
    """Stands in for the body once: the first call (of the body, or of a block of the list) stops the step."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Reached(args, kwargs)

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return iter([self] * self.length)

    def __getitem__(self, index: Any) -> Any:
        return [self] * len(range(self.length)[index]) if isinstance(index, slice) else self


class _Bound(nn.Module):
    """A block of a layer list with its extra arguments bound: ``hidden -> hidden``."""

    def __init__(self, block: nn.Module, index: int, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.block, self.index = block, index
        self.__dict__["bound"] = (args, kwargs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.bound
        return _hidden_of(self.block(hidden, *args, **kwargs), self.index)


def body_input(module: nn.Module, path: str, body: nn.Module, batch: Any) -> Tuple[tuple, dict]:
    """The arguments the user's training step passes to the body (or to its first block) on ``batch``.

    The buffers and torchmetrics states the code before the body changes (a BatchNorm's running statistics, a
    metric updated there) are put back afterwards: this run only measures, on one process, and training must not
    see it. Other state it changes (a counter kept on ``self``) is not followed.
    """
    recorder = LogRecorder(module, path)
    set_submodule(module, path, _Capture(len(body)))
    buffers = [(b, b.clone()) for b in module.buffers()]  # the body's are out of the module now
    metrics = metric_states(module, path)
    try:
        with torch.no_grad(), recorder.recording():
            module.training_step(batch, 0)
    except _Reached as reached:
        return reached.args_, reached.kwargs
    finally:
        set_submodule(module, path, body)
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        load_metric_states(module, metrics)  # on their own devices, as they were
    raise ConfigurationError("training_step returned without calling the body, so balance by measurement cannot "
                             "learn its input; give balance=[...] layer counts instead")


def as_sequential(body: nn.Module, args: tuple, kwargs: dict) -> Tuple[nn.Sequential, Any]:
    """The body as a Sequential of one-input layers, and the sample input of its first layer."""
    if isinstance(body, nn.ModuleList):
        return nn.Sequential(*[_Bound(b, i, args[1:], kwargs) for i, b in enumerate(body)]), args[0]
    return body, args if len(args) > 1 else args[0]


def layer_costs(kind: str, module: nn.Module, path: str, body: nn.Module, batch: Any) -> List[float]:
    """Each layer's cost (seconds, bytes or FLOPs) on the sample ``batch``, all generators restored."""
    states = random.getstate(), _numpy_state()
    with torch.random.fork_rng(devices=[]):
        try:
            args, kwargs = body_input(module, path, body, batch)
            if kind == "flops":  # counted on meta: the blocks' bound extra arguments (a mask, rotary tables) too
                args, kwargs = tree_map(meta_like, (args, kwargs))
            layers, sample = as_sequential(body, args, kwargs)
            return [float(c) for c in MEASURES[kind](layers, sample)]
        finally:
            random.setstate(states[0])
            _set_numpy_state(states[1])


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover
        return None
    return numpy.random.get_state()


def _set_numpy_state(state: Any) -> None:
    if state is not None:
        import numpy

        numpy.random.set_state(state)


def sample_batch(trainer: Any) -> Any:
    """One batch of the training data, drawn without disturbing the training's own iteration."""
    states = random.getstate(), _numpy_state()
    with torch.random.fork_rng(devices=[]):
        try:
            loader = trainer.fit_loop._data_source.dataloader()  # Lightning's own source of train_dataloader()
            return next(iter(loader))
        finally:
            random.setstate(states[0])
            _set_numpy_state(states[1])


def describe(kind: str, costs: List[float], ranges: List[Tuple[int, int]]) -> List[str]:
    unit, scale = UNITS[kind]
    return [f"{kind} {sum(costs[a:b]) * scale:.3g} {unit}" for a, b in ranges]
