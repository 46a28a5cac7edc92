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
is the trained one (its *owner*) is learned from the first step (:meth:`SplitModel.learn_usage`):
the stage that computed a gradient for it. One used on several stages (a module before the body
whose output also feeds the loss) gets its gradients summed. One that no stage computed a gradient
for (frozen at first, e.g. a head unfrozen later) belongs to the stage that called its module: the
first stage for a module it called (before the body; the last stage's rerun of that code is
discarded), else the last stage (after the body), which also keeps the modules no stage called.
Only the owner trains such a parameter: if a later step computes a gradient for it on any other
stage, :class:`~lightning_pipe.errors.ConfigurationError` is raised (its gradients would not be summed).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Set

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.errors import ConfigurationError, PartitionError
from lightning_pipe.lightning import release
from lightning_pipe.lightning.body import (
    PipelinedSequential, StandIn, body_paths, is_plain_state, set_submodule, share_forward_hooks)
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
        self.paths = body_paths(module, body)  # the body's aliases too: each gets the stand-in, so every name calls it
        self.pp_rank, self.pp_size = pp_rank, max(self.stage_ranks) + 1
        self.local_stages = tuple(s for s, r in enumerate(self.stage_ranks) if r == pp_rank)
        self.first_rank, self.last_rank = self.stage_ranks[0], self.stage_ranks[-1]
        self.ranges = split_points(self.balance)
        self.stage_of_layer = {n: s for s, (a, b) in enumerate(self.ranges) for n in names[a:b]}
        self.rank_of_layer = {n: self.stage_ranks[s] for n, s in self.stage_of_layer.items()}
        self.parameter_order = [n for n, _ in module.named_parameters()]
        self.key_order = list(module.state_dict())
        self.key_aliases = _key_aliases(module)
        self.ties: List[Tie] = find_ties(module, self.ranks_of, aliases_of=self.paths[1:])
        self.aliases = aliases(self.ties)
        self.owner: Dict[str, int] = {}
        self.users: Dict[str, Set[int]] = {}  # outside the body: the ranks that train each parameter (learned)
        self.module_owner: Dict[str, int] = {}  # outside the body: the rank owning each module's buffers (learned)
        self.hooks: List[object] = []  # handles of the hooks set after the first step (see release_unused)
        self.pending_own: List[tuple] = []  # the LightningModule's own parameters watched once unfrozen (name, p)
        self.trained_elsewhere: Set[int] = set()  # ids of parameters kept here that only other ranks train
        self.module = module
        self.stand_in = self._stand_in(channel)
        share_forward_hooks(body, self.stand_in)
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
        """After the first step (after :meth:`learn_usage`): the modules outside the body this rank neither called,
        trained nor owns. Those released refuse to run later (:func:`.release.refuse_calls`); the parameters kept
        here that another stage was learned to train refuse gradients here (:meth:`_watch_gradients`)."""
        if self.pp_size == 1:
            return 0
        self.drop_hooks()
        outside = release.named_outside_body(self.module, self.path)
        used = [m for path, m in outside if id(m) in called or m is self.module or self._owns_module(path, m)
                or any(p.grad is not None for p in m._parameters.values() if p is not None)]
        keep = release.tensor_ids([self.stand_in]) | {id(t) for m in used for t in
                                                      list(m._parameters.values()) + list(m._buffers.values())}
        unused = [(path, m) for path, m in outside if not any(m is u for u in used)]
        released = release.release([m for _, m in unused], keep, optimizers)
        for path, m in unused:
            if release.is_released(m):
                self.hooks.append(release.refuse_calls(m, path, self._where()))  # the message says why
        self._watch_gradients(outside)
        return released

    def drop_hooks(self) -> None:
        """Remove the hooks :meth:`release_unused` set (once the whole model is back in the module)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks, self.pending_own = [], []

    def _where(self) -> str:
        stages = self.local_stages
        held = f"stage {stages[0]}" if len(stages) == 1 else f"stages {list(stages)}"
        return f"pipeline rank {self.pp_rank} ({held} of {self.num_stages})"

    def _owns_module(self, path: str, module: nn.Module) -> bool:
        """Whether this rank owns a parameter or buffer owned directly by ``module`` (it must keep it for checkpoints)."""
        names = [f"{path}.{n}" if path else n for n, t in list(module._parameters.items()) + list(module._buffers.items())
                 if t is not None]
        return any(self.owner_of(n) == self.pp_rank for n in names)

    def _watch_gradients(self, outside: Sequence) -> None:
        """Refuse, from the second step on, a gradient on this rank for a parameter outside the body that the first
        step learned as trained by other ranks only (its gradients would be neither summed nor saved).

        A parameter that requires grad gets a tensor hook now; a frozen one gets it when its module is called after
        being unfrozen (a forward pre-hook, removed once all of the module's watched parameters are hooked).
        """
        tied = {name for tie in self.ties for name in tie.names}
        self.trained_elsewhere = set()
        for path, m in outside:
            watched = []
            for n, p in m._parameters.items():
                name = self.canonical(f"{path}.{n}" if path else n)
                if p is None or p.is_meta or name in tied or self.layer_of(name) is not None or name not in self.users:
                    continue
                if self.pp_rank not in self.users[name]:
                    watched.append((name, p))
            if not watched:
                continue
            self.trained_elsewhere.update(id(p) for _, p in watched)
            pending = [(name, p) for name, p in watched if not self._hook_gradient(name, p)]
            if pending:
                self._hook_when_trainable(m, pending)

    def _hook_when_trainable(self, module: nn.Module, pending: List) -> None:
        """Hook the gradients of ``pending`` (frozen now) at the first call of ``module`` after they are unfrozen;
        the LightningModule's own, which no step calls, at the first training step after (:meth:`hook_unfrozen`)."""
        if module is self.module:
            self.pending_own = pending
            return

        def hook(m: nn.Module, args: tuple) -> None:
            self._hook_trainable(pending)
            if not pending:
                handle.remove()

        handle = module.register_forward_pre_hook(hook)
        self.hooks.append(handle)

    def hook_unfrozen(self) -> None:
        """Before a training step: hook the gradients of the LightningModule's own parameters that
        :meth:`_watch_gradients` watches and that were unfrozen since."""
        self._hook_trainable(self.pending_own)

    def _hook_trainable(self, pending: List[tuple]) -> None:
        """Hook those of ``pending`` (``(name, parameter)``) that require grad now; leave the others in it."""
        pending[:] = [(name, p) for name, p in pending if not self._hook_gradient(name, p)]

    def _hook_gradient(self, name: str, p: torch.Tensor) -> bool:
        """Hook ``p``'s gradient to refuse it here (False: it does not require grad yet)."""
        if not p.requires_grad:
            return False
        users = sorted(self.users[name])
        learned = f"pipeline rank(s) {users}" if users else "no rank"
        where = self._where()

        def refuse(grad: torch.Tensor) -> None:
            raise ConfigurationError(
                f"parameter `{name}` (outside the body `{self.path}`) got a gradient on {where}, but PipeStrategy "
                f"learned from the first training step that only {learned} train it (at that step it got a gradient "
                "there, or, frozen, its module was called there); its gradients would not be summed over the stages "
                "that use it, nor counted in the gradient norm or saved from here. A module outside the body used "
                "by several stages (e.g. before the body and in the loss) must get gradients from the first step "
                "on: leave it trainable (requires_grad=True) from the start and keep it out of the optimizer, or "
                "use it on one stage only"
            )

        self.hooks.append(p.register_hook(refuse))
        return True

    def install(self, whole: bool) -> None:
        """Put the whole body (``whole``) or this stage's stand-in into the module."""
        for path in self.paths:
            set_submodule(self.module, path, self.body if whole else self.stand_in)

    def show_whole(self, group: Optional[object] = None) -> None:
        """Install the whole body for the checkpoint hooks, as one process would show it (a collective over
        ``group``, the pipeline's): ``on_save_checkpoint`` then lists every stage's parameters, those of other
        stages on the meta device, each marked trainable as its holder's copy is (``requires_grad``, which
        "save the trainable weights only" hooks read). :meth:`install` puts the stand-in back."""
        self.install(whole=True)
        flags: Dict[str, bool] = {}
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            real = {n: p.requires_grad for n, p in self.module.named_parameters() if not p.is_meta}
            per_rank: List[Optional[Dict[str, bool]]] = [None] * dist.get_world_size(group)
            dist.all_gather_object(per_rank, real, group=group)
            for part in per_rank:
                for name, trainable in part.items():
                    flags[name] = flags.get(name, False) or trainable
        for name, p in self.module.named_parameters():
            if p.is_meta and name in flags:
                p.requires_grad_(flags[name])

    def take_layer_state_from_owners(self) -> None:
        """After the whole body is back (:meth:`install` ``whole=True``), give the other stages' layers the plain
        attributes and ``requires_grad`` flags their owners' copies have (a collective over every rank).

        During fit a hook reaches this process's layers only (``self.modules()`` lists them), so what it set
        there, PEFT's ``set_adapter`` (the active adapter, its parameters trainable) or a callback's ``eval()``,
        is on the owners' copies alone; the weights come back through the state dict, this through here (what
        counts as plain: :func:`.body.is_plain_state`).
        """
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        mine: Dict[str, tuple] = {}
        for s in self.local_stages:
            start, stop = self.ranges[s]
            for layer in self.names[start:stop]:
                for path, sub in self.body._modules[layer].named_modules(prefix=layer):
                    values = {k: v for k, v in sub.__dict__.items() if is_plain_state(k, v)}
                    flags = {n: p.requires_grad for n, p in sub.named_parameters(recurse=False)}
                    mine[path] = (values, flags)
        parts: List[Optional[Dict[str, tuple]]] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        for part in parts:
            for path, (values, flags) in part.items():
                if path in mine:  # this process's own
                    continue
                sub = self.body.get_submodule(path)
                sub.__dict__.update(values)
                for name, trainable in flags.items():
                    sub._parameters[name].requires_grad_(trainable)

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
    def modules_used(self, trained: Sequence[str], called: Sequence[str]) -> Set[int]:
        """The ids of the modules outside the body named in ``called`` (:meth:`called_names`) or holding a parameter
        named in ``trained`` (canonical names): what ranks other than this one used, in :meth:`release_unused`."""
        trained, called = set(trained), set(called)
        return {id(m) for path, m in release.named_outside_body(self.module, self.path)
                if path in called or any(self.canonical(f"{path}.{n}" if path else n) in trained for n in m._parameters)}

    def called_names(self, called: Set[int]) -> List[str]:
        """The paths of the modules outside the body whose forward ran (ids in ``called``; for :meth:`learn_usage`)."""
        return [path for path, m in release.named_outside_body(self.module, self.path) if id(m) in called]

    def own_read(self, called: Set[int]) -> List[str]:
        """The names of the LightningModule's own parameters read in the first step (ids in ``called``, as
        :func:`.release.uses_recorded` notes them)."""
        return [n for n, p in self.module._parameters.items() if p is not None and id(p) in called]

    def learn_usage(self, used_per_stage: Sequence[Sequence[str]],
                    called_per_stage: Optional[Sequence[Sequence[str]]] = None,
                    own_read_per_stage: Optional[Sequence[Sequence[str]]] = None) -> List[Tie]:
        """Owners of the parameters outside the body: the ranks that computed their gradients, or else the rank that
        called their module (see the module docstring).

        Args:
            used_per_stage: per pipeline rank, the canonical names of the parameters outside the body that
                got a gradient in the first step.
            called_per_stage: per pipeline rank, the paths of the modules outside the body whose forward ran in
                the first step (:meth:`called_names`). Without it, a parameter no rank computed a gradient for
                belongs to the last stage.
            own_read_per_stage: per pipeline rank, the LightningModule's own parameters read in the first step
                (:meth:`own_read`): one no rank computed a gradient for belongs to the first stage if it read that
                parameter itself (a frozen ``temperature`` used after the body stays the last stage's, though the
                first stage read a ``pos_embed`` beside it).

        Returns:
            The parameters that several stages computed gradients for and that are not tied by
            identity (whose sums :class:`~lightning_pipe.ties.TiedGradients` already takes).
        """
        stages: Dict[str, List[int]] = {}
        for s, names in enumerate(used_per_stage):
            for name in names:
                stages.setdefault(name, []).append(s)
        self.owner = {n: min(s) for n, s in stages.items()}
        called = [set(c) for c in called_per_stage] if called_per_stage is not None else None
        self.module_owner = {}
        own = [set(r) for r in own_read_per_stage] if own_read_per_stage is not None else None
        for path, m in release.named_outside_body(self.module, self.path):
            self.module_owner[path] = self._caller(path, called)
            for n in m._parameters:
                name = self.canonical(f"{path}.{n}" if path else n)
                if self.layer_of(name) is None and name not in self.owner:
                    self.owner[name] = self.module_owner[path] if path or own is None else \
                        self.first_rank if n in own[self.first_rank] else self.last_rank
        self.users = {n: set(stages.get(n, [self.owner[n]])) for n in self.owner}
        tied = {name for tie in self.ties for name in tie.names}
        return [Tie((name,), tuple(where)) for name, where in sorted(stages.items()) if len(where) > 1 and name not in tied]

    def _outside_parameters(self) -> Iterator[tuple]:
        """``(module path, name under the LightningModule, canonical name)`` of each parameter outside the body."""
        for path, m in release.named_outside_body(self.module, self.path):
            for n, p in m._parameters.items():
                if p is not None:
                    name = f"{path}.{n}" if path else n
                    yield path, name, self.canonical(name)

    def trained_on_last(self, tied: Set[str]) -> Set[str]:
        """The parameters outside the body (by name under the LightningModule) whose copies on the last stage stay
        equal to the trained ones (after :meth:`learn_usage`): trained there, or tied (``tied``: canonical names
        whose gradients are summed over the stages using them). The last stage must never overwrite those with
        the first stage's copies, even where another parameter of the same module is refreshed from there."""
        return {name for _, name, canonical in self._outside_parameters()
                if canonical in tied or self.last_rank in self.users.get(canonical, ())}

    def behind_on_first(self, tied: Set[str], called: Sequence[str], own: Optional[Sequence[str]] = None) -> List[str]:
        """The parameters outside the body (by name under the LightningModule) that only the last stage trains and
        that the first stage's run of the code before the body reads (after :meth:`learn_usage`): its copies of
        those fall behind the trained ones (``h = self.embed(x) * self.temperature.detach()``).

        Args:
            tied: canonical names whose gradients are summed over the stages using them (kept equal already).
            called: the paths of the modules the first stage called or read (:meth:`called_names`).
            own: the LightningModule's own parameters the first stage read (:meth:`own_read`); None: all of them
                (an evaluation step, whose reads nothing records).
        """
        return [name for path, name, canonical in self._outside_parameters()
                if canonical not in tied and self.users.get(canonical) == {self.last_rank}
                and ((path in called) if path else (own is None or name in own))]

    def _caller(self, path: str, called: Optional[List[Set[str]]]) -> int:
        """The rank that uses a module outside the body that got no gradient: the first stage's if it called it
        (code before the body; the last stage runs it again only to discard it), else the last stage's."""
        if called is not None and path in called[self.first_rank]:
            return self.first_rank
        return self.last_rank

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
        return min(owners) if owners else self.module_owner.get(module_path, 0)

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
