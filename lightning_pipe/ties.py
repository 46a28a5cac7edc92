"""Tied parameters: one parameter registered in several places, kept equal on every stage.

A parameter registered under several names (an embedding shared with the output head) is found
by identity on the whole model before it is split (Lightning's ``find_shared_parameters``). Once
split, the stages that hold one of its names each hold a copy and compute a part of its gradient;
:class:`TiedGradients` sums those parts over the pipeline, so every copy takes the same step and
the copies never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

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
        stages: the pipeline ranks that hold a copy, in increasing order (a rank holding several
            stages that use the parameter holds one copy, shared by those stages).
    """

    names: Tuple[str, ...]
    stages: Tuple[int, ...]

    @property
    def owner(self) -> int:
        """The stage whose copy counts once in norms and checkpoints."""
        return self.stages[0]


def find_ties(module: nn.Module, stages_of: Callable[[str], Iterable[int]], aliases_of: Sequence[str] = ()) -> List[Tie]:
    """The parameters of ``module`` registered under several names, with the stages holding each.

    Args:
        module: the whole, unpartitioned model.
        stages_of: the stages that hold the parameter name given (a name's module's stages).
        aliases_of: paths of modules registered a second time under another name
            (``self.backbone = self.body``): names under them are that same layer, not a tie.

    Example:
        >>> model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
        >>> model[1].weight = model[0].weight
        >>> find_ties(model, lambda name: [int(name[0])])
        [Tie(names=('0.weight', '1.weight'), stages=(0, 1))]
    """
    skipped = tuple(path + "." for path in aliases_of)
    found = [[name for name in names if not name.startswith(skipped)] for names in find_shared_parameters(module)]
    return [Tie(tuple(names), tuple(sorted({s for name in names for s in stages_of(name)})))
            for names in found if len(names) > 1]


def aliases(ties: Sequence[Tie]) -> Dict[str, str]:
    """``{other name: canonical name}`` for every tie."""
    return {name: tie.names[0] for tie in ties for name in tie.names[1:]}


class TiedGradients:
    """Sums the gradients of tied parameters over the stages that hold them.

    Only the holders of a tie take part in its sum: over the pipeline's group when every stage
    holds it, else over a group of the holders (created here, by the holders only, in the order
    of ``ties``, which every rank computes alike).

    Args:
        ties: the model's ties (only those held by several ranks need work).
        module: this rank's stage module, or its stage modules, holding the copies under the
            model's names.
        stage_index: this rank in the pipeline (its first stage's index under the placements
            used here).
        group: the pipeline's process group (None: the world).
    """

    def __init__(self, ties: Sequence[Tie], module: Union[nn.Module, Sequence[nn.Module]], stage_index: int,
                 group: Optional[dist.ProcessGroup]) -> None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        groups: Dict[Tuple[int, ...], Optional[dist.ProcessGroup]] = {}
        self.ties = [tie for tie in ties if len(tie.stages) > 1]
        self.local: List[Tuple[nn.Parameter, Optional[dist.ProcessGroup]]] = []
        for tie in self.ties:
            if stage_index not in tie.stages:
                continue
            if tie.stages not in groups:
                groups[tie.stages] = group if len(tie.stages) == len(ranks) else dist.new_group(
                    [ranks[s] for s in tie.stages], use_local_synchronization=True)
            self.local.append((_local_parameter(module, tie), groups[tie.stages]))

    def __bool__(self) -> bool:
        return bool(self.ties)

    def parameters(self) -> List[nn.Parameter]:
        return [p for p, _ in self.local]

    def sum_(self, grads: Optional[Dict[nn.Parameter, Optional[torch.Tensor]]] = None) -> None:
        """Replace each local copy's gradient by the sum over its holders (a collective per tie).

        With ``grads`` (gradients set aside, by parameter) the sums are taken over those instead.
        """
        for p, group in self.local:
            grad = grads.get(p) if grads is not None else p.grad
            if grad is None:
                grad = torch.zeros_like(p)
            dist.all_reduce(grad, group=group)
            if grads is not None:
                grads[p] = grad
            else:
                p.grad = grad


def _local_parameter(module: Union[nn.Module, Sequence[nn.Module]], tie: Tie) -> nn.Parameter:
    modules = [module] if isinstance(module, nn.Module) else list(module)
    for part in modules:
        for name in tie.names:
            try:
                return part.get_parameter(name)
            except AttributeError:
                continue
    raise AssertionError(f"no name of the tie {tie.names} is in this rank's modules")  # internal invariant


def sum_step_gradients(ties: TiedGradients, step: Callable[[], object]) -> object:
    """Run ``step`` and sum the tied gradients it produced (gradients from before are left alone)."""
    before = take_grads(ties.parameters())
    result = step()
    ties.sum_()
    add_grads(before)
    return result
