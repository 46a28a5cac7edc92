"""A LightningModule with its body split: what each stage holds, what is tied, whose copy counts.

Built once per fit, on every rank, from the same configuration, before any collective: the body is
found, cut by ``balance`` and replaced in the module by the local stage's stand-in; parameters
registered under several names are found by identity (:mod:`lightning_pipe.ties`). Names are
*canonical* when they are the ones the unsplit module's ``named_parameters()`` reports; a tied
copy known here under another name maps back to it.

Modules outside the body live on every rank; the code before the body call runs on the first and
the last stage, the code after it on the last. A rank may hold several stages (interleaved 1F1B:
rank ``r`` holds stages ``r, r + p, ...``; ZB-V: ``r`` and ``2p - 1 - r``, so rank 0 holds the first
and the last stage): then ``stage_ranks`` maps each stage to its rank, and
what is *held*, *owned* or *tied* is counted per rank, since one rank holds one copy of each
tensor for all its stages. Which stage's copy of a parameter outside the body
is the trained one (its *owner*) is learned from the first step's gradients
(:meth:`SplitModel.learn_usage`): the stage that computed a gradient for it. One used on several
stages (a module before the body whose output also feeds the loss) gets its gradients summed.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Set

import torch
from torch import nn

from lightning_pipe.errors import PartitionError
from lightning_pipe.lightning import release
from lightning_pipe.lightning.body import PipelinedSequential, StandIn, set_submodule
from lightning_pipe.lightning.layer_list import CallChannel, PipelinedLayerList
from lightning_pipe.partition import SequentialModel, balance_by_parameters, check_balance, split_points
from lightning_pipe.ties import Tie, aliases, find_ties


def balance_of(body: nn.Module, balance: Optional[Sequence[int]], num_ranks: int, path: str,
               virtual_stages: int = 1) -> List[int]:
    """Layers per stage (``num_ranks * virtual_stages`` stages): ``balance`` checked, or by default even parameter counts."""
    num_layers = len(body._modules)
    num_stages = num_ranks * virtual_stages
    if num_stages > num_layers:
        asked = f"PipeStrategy(pipe_size={num_ranks})" if virtual_stages == 1 else \
            f"PipeStrategy(pipe_size={num_ranks}) with {virtual_stages} stages per process cuts the body into {num_stages} " \
            "stages and"
        fix = f"pipe_size <= {num_layers}" if virtual_stages == 1 else \
            f"pipe_size * {virtual_stages} <= {num_layers} (or fewer stages per process)"
        raise PartitionError(
            f"{asked} needs at least {num_stages} layers, but the body `{path}` has {num_layers}; "
            f"use {fix} or split the body into more layers"
        )
    if balance is not None and virtual_stages > 1 and len(balance) != num_stages:
        raise PartitionError(
            f"PipeStrategy(balance={list(balance)}) has {len(balance)} entries, but pipe_size={num_ranks} with "
            f"{virtual_stages} stages per process makes {num_stages} stages; give one layer count per stage, in stage "
            f"order (process r holds the stages placed on it, e.g. r and r + {num_ranks} under interleaved 1F1B)"
        )
    return check_balance(balance, num_layers, num_stages) if balance is not None else balance_by_parameters(body, num_stages)


class SplitModel:
    """The split of one LightningModule for one stage (see the module docstring).

    Args:
        module: the LightningModule; its body is replaced by the stand-in.
        path: the body's attribute path.
        body: the body (``nn.Sequential`` or ``nn.ModuleList``).
        balance: layers per stage (see :func:`balance_of`).
        pp_rank: this rank in the pipeline.
        stage_ranks: the rank of each stage (``(0, 1, ..., p - 1)`` for one stage per rank).
        channel: the call channel of layer-list bodies.
    """

    def __init__(self, module: nn.Module, path: str, body: nn.Module, balance: Sequence[int],
                 pp_rank: int, stage_ranks: Sequence[int], channel: CallChannel) -> None:
        names = list(body._modules)
        self.stage_ranks = tuple(stage_ranks)
        self.num_stages = len(self.stage_ranks)
        self.balance = check_balance(balance, len(names), self.num_stages)
        self.path, self.body, self.names = path, body, names
        self.pp_rank, self.pp_size = pp_rank, max(self.stage_ranks) + 1
        self.local_stages = tuple(s for s, r in enumerate(self.stage_ranks) if r == pp_rank)
        self.first_rank, self.last_rank = self.stage_ranks[0], self.stage_ranks[-1]
        self.ranges = split_points(self.balance)
        self.stage_of_layer = {n: s for s, (a, b) in enumerate(self.ranges) for n in names[a:b]}
        self.rank_of_layer = {n: self.stage_ranks[s] for n, s in self.stage_of_layer.items()}
        self.parameter_order = [n for n, _ in module.named_parameters()]
        self.key_order = list(module.state_dict())
        self.key_aliases = _key_aliases(module)
        self.ties: List[Tie] = find_ties(module, self.ranks_of)
        self.aliases = aliases(self.ties)
        self.owner: Dict[str, int] = {}
        self.module = module
        self.stand_in = self._stand_in(channel)
        self.install(whole=False)
        self.released_bytes = self._release_at_setup()

    @property
    def runs_outside(self) -> bool:
        """Whether this rank runs the user's step (it holds the first or the last stage)."""
        return self.pp_rank in (self.first_rank, self.last_rank)

    def _release_at_setup(self) -> int:
        """Other ranks' layers, and on ranks with neither the first nor the last stage everything outside the body
        (see :mod:`.release`)."""
        if self.pp_size == 1:
            return 0
        local = release.tensor_ids([self.stand_in])
        outside = release.outside_body(self.module, self.path)
        middle = not self.runs_outside
        keep = local if middle else local | release.tensor_ids(outside)
        others = [m for n in self.names if self.rank_of_layer[n] != self.pp_rank for m in self.body._modules[n].modules()]
        return release.release(others + (outside if middle else []), keep)

    def release_unused(self, called: Set[int], optimizers: Sequence[torch.optim.Optimizer]) -> int:
        """After the first step: the modules outside the body this rank neither called nor trained."""
        if self.pp_size == 1:
            return 0
        outside = release.outside_body(self.module, self.path)
        used = [m for m in outside if id(m) in called or m is self.module
                or any(p.grad is not None for p in m._parameters.values() if p is not None)]
        keep = release.tensor_ids([self.stand_in]) | {id(t) for m in used for t in
                                                      list(m._parameters.values()) + list(m._buffers.values())}
        return release.release([m for m in outside if m not in used], keep, optimizers)

    def install(self, whole: bool) -> None:
        """Put the whole body (``whole``) or this stage's stand-in into the module."""
        set_submodule(self.module, self.path, self.body if whole else self.stand_in)

    @property
    def installed(self) -> bool:
        return self.module.get_submodule(self.path) is self.stand_in

    def describe(self, dp_size: int) -> List[str]:
        """One line per stage: its layers, parameters and ranks."""
        rows = []
        for s, (start, stop) in enumerate(self.ranges):
            layers = self.names[start:stop]
            params = sum(p.numel() for n in layers for p in self.body._modules[n].parameters())
            r = self.stage_ranks[s]
            rows.append(f"  stage {s}: layers {layers[0]}..{layers[-1]} ({stop - start}), {params:,} parameters, "
                        f"ranks {list(range(r * dp_size, (r + 1) * dp_size))}")
        return rows

    def _stand_in(self, channel: CallChannel) -> StandIn:
        ranges = [self.ranges[s] for s in self.local_stages]
        if isinstance(self.body, nn.ModuleList):
            return PipelinedLayerList(list(self.body), ranges, self.local_stages, self.num_stages, channel)
        layers = [OrderedDict((n, self.body._modules[n]) for n in self.names[a:b]) for a, b in ranges]
        return PipelinedSequential(layers, isinstance(self.body, SequentialModel), self.local_stages, self.num_stages)

    def layer_of(self, name: str) -> Optional[str]:
        """The body layer a parameter or state-dict entry belongs to, or None outside the body."""
        prefix = self.path + "."
        return name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else None

    def ranks_of(self, name: str) -> List[int]:
        """The pipeline ranks holding a copy of a parameter (by any of its names) that they may train."""
        layer = self.layer_of(name)
        if layer is not None:
            return [self.rank_of_layer[layer]]
        return sorted({self.first_rank, self.last_rank})

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    # -- ownership -------------------------------------------------------------------------------
    def learn_usage(self, used_per_stage: Sequence[Sequence[str]]) -> List[Tie]:
        """Owners of the parameters outside the body, from the ranks that computed their gradients.

        Args:
            used_per_stage: per pipeline rank, the canonical names of the parameters outside the body that
                got a gradient in the first step.

        Returns:
            The parameters that several stages computed gradients for and that are not tied by
            identity (whose sums :class:`~lightning_pipe.ties.TiedGradients` already takes).
        """
        stages: Dict[str, List[int]] = {}
        for s, names in enumerate(used_per_stage):
            for name in names:
                stages.setdefault(name, []).append(s)
        self.owner = {n: min(s) for n, s in stages.items()}
        tied = {name for tie in self.ties for name in tie.names}
        return [Tie((name,), tuple(where)) for name, where in sorted(stages.items()) if len(where) > 1 and name not in tied]

    def owner_of(self, name: str) -> int:
        """The pipeline rank whose copy of a parameter or state-dict entry is authoritative."""
        name = self.canonical(self.key_aliases.get(name, name))
        layer = self.layer_of(name)
        if layer is not None:
            for tie in self.ties:
                if name in tie.names:
                    return tie.owner
            return self.rank_of_layer[layer]
        if name in self.owner:
            return self.owner[name]
        module_path = name.rpartition(".")[0]  # buffers follow the parameters of their module
        owners = [s for n, s in self.owner.items() if n.rpartition(".")[0] == module_path]
        return min(owners) if owners else 0

    def owned_keys(self, keys: Sequence[str]) -> Set[str]:
        """The state-dict keys among ``keys`` that this rank saves: its layers', and those it owns outside."""
        owned = set()
        for key in keys:
            layer = self.layer_of(key)
            if layer is not None and self.rank_of_layer[layer] == self.pp_rank or \
                    layer is None and self.owner_of(key) == self.pp_rank:
                owned.add(key)
        return owned

    def counts_in_norm(self, name: str) -> bool:
        """Whether this rank counts a local parameter's gradient in the global norm (once per tie)."""
        return self.owner_of(name) == self.pp_rank


def _key_aliases(module: nn.Module) -> Dict[str, str]:
    """State-dict keys of a tensor registered twice -> the first key (a checkpoint stores it once)."""
    first: Dict[int, str] = {}
    out = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            original = first.setdefault(id(tensor), key)
            if original != key:
                out[key] = original
    return out


PLACEHOLDER = "_pipe_placeholder"


@contextmanager
def trainable_placeholder(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Give a stage without trainable parameters one empty parameter while its optimizer is built.

    A stage may hold only parameter-free layers (pooling, parameter-free mixing) or frozen ones
    (fine-tuning); the user's ``configure_optimizers`` then hands torch an empty list, which it
    refuses on that rank only. The placeholder has no element, is never saved, and gets no gradient.
    """
    needed = not any(p.requires_grad for p in module.parameters())
    if needed:
        module.register_parameter(PLACEHOLDER, nn.Parameter(torch.zeros(0, device=device)))
    try:
        yield
    finally:
        if needed:
            delattr(module, PLACEHOLDER)
