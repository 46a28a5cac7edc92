"""Tied parameters: one parameter registered in several places, kept equal on every stage.

A parameter registered under several names (an embedding shared with the output head) is found
by identity on the whole model before it is split (Lightning's ``find_shared_parameters``). Once
split, the stages that hold one of its names each hold a copy and compute a part of its gradient;
:class:`TiedGradients` sums those parts over the pipeline, so every copy takes the same step and
the copies never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.parameter_tying import find_shared_parameters
from torch import nn

from lightning_pipe.gradients import add_grads, take_grads


@dataclass(frozen=True)
class Tie:
    """One parameter known under several names of the unpartitioned model.

    Attributes:
        names: every name, the first being the one ``named_parameters()`` reports (canonical).
        stages: the stages that hold a copy, in increasing order.
        shape: the parameter's shape (stages without a copy add zeros of it).
        dtype: its dtype.
    """

    names: Tuple[str, ...]
    stages: Tuple[int, ...]
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def owner(self) -> int:
        """The stage whose copy counts once in norms and checkpoints."""
        return self.stages[0]


def find_ties(module: nn.Module, stages_of: Callable[[str], Iterable[int]]) -> List[Tie]:
    """The parameters of ``module`` registered under several names, with the stages holding each.

    Args:
        module: the whole, unpartitioned model.
        stages_of: the stages that hold the parameter name given (a name's module's stages).

    Example:
        >>> model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
        >>> model[1].weight = model[0].weight
        >>> find_ties(model, lambda name: [int(name[0])])
        [Tie(names=('0.weight', '1.weight'), stages=(0, 1), shape=(5, 3), dtype=torch.float32)]
    """
    ties = []
    for names in find_shared_parameters(module):
        parameter = module.get_parameter(names[0])
        stages = sorted({s for name in names for s in stages_of(name)})
        ties.append(Tie(tuple(names), tuple(stages), tuple(parameter.shape), parameter.dtype))
    return ties


def aliases(ties: Sequence[Tie]) -> Dict[str, str]:
    """``{other name: canonical name}`` for every tie."""
    return {name: tie.names[0] for tie in ties for name in tie.names[1:]}


class TiedGradients:
    """Sums the gradients of tied parameters over the stages of a pipeline.

    Args:
        ties: the model's ties (only those held by several stages need work).
        module: this stage's module, holding its copies under the model's names.
        stage_index: this stage.
        group: the pipeline's process group.
        device: where stages without a copy build their zeros.
    """

    def __init__(self, ties: Sequence[Tie], module: nn.Module, stage_index: int, group: Optional[dist.ProcessGroup],
                 device: torch.device) -> None:
        self.ties = [tie for tie in ties if len(tie.stages) > 1]
        self.group = group
        self.device = device
        self.local: List[Optional[nn.Parameter]] = [
            _local_parameter(module, tie) if stage_index in tie.stages else None for tie in self.ties
        ]

    def __bool__(self) -> bool:
        return bool(self.ties)

    def parameters(self) -> List[nn.Parameter]:
        return [p for p in self.local if p is not None]

    def sum_(self, grads: Optional[Dict[nn.Parameter, Optional[torch.Tensor]]] = None) -> None:
        """Replace each local copy's gradient by the sum over the stages (a collective per tie).

        With ``grads`` (gradients set aside, by parameter) the sums are taken over those instead.
        """
        for tie, p in zip(self.ties, self.local):
            grad = None if p is None else (grads.get(p) if grads is not None else p.grad)
            if grad is None:
                device = p.device if p is not None else self.device
                grad = torch.zeros(tie.shape, dtype=tie.dtype, device=device)
            dist.all_reduce(grad, group=self.group)
            if p is None:
                continue
            if grads is not None:
                grads[p] = grad
            else:
                p.grad = grad


def _local_parameter(module: nn.Module, tie: Tie) -> nn.Parameter:
    for name in tie.names:
        try:
            return module.get_parameter(name)
        except AttributeError:
            continue
    raise AssertionError(f"no name of the tie {tie.names} is in this stage's module")  # internal invariant


def sum_step_gradients(ties: TiedGradients, step: Callable[[], object]) -> object:
    """Run ``step`` and sum the tied gradients it produced (gradients from before are left alone)."""
    before = take_grads(ties.parameters())
    result = step()
    ties.sum_()
    add_grads(before)
    return result
