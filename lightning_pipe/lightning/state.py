"""Whole-model checkpoints from a partitioned model, and back.

A checkpoint written under PipeStrategy is an ordinary Lightning checkpoint: the unpartitioned
model's ``state_dict`` keys, and each optimizer's state in the layout the unpartitioned model's
optimizer would have (parameters numbered in each param group's own order, which every stage
reports for the parameters it can name: see :func:`full_layout`). The layout is computed from
parameter *names*, so a checkpoint moves between plain training and any number of stages.
"""

from __future__ import annotations

import heapq
import os
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.sharded import load_sharded, save_sharded

_LOADED_IN_PLACE = "_lightning_pipe_loaded"  # marks a checkpoint dict whose tensors are in the module already


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    return value


class HookState(OrderedDict):
    """The model's state dict as the checkpoint hooks get it (see :meth:`Checkpoints.for_hooks`).

    A process holds part of it only (all of it on global rank 0 for a whole checkpoint, its part for a
    sharded one), where every DDP process holds every key: deleting a key of the model that this process
    does not hold (``del checkpoint["state_dict"][name]`` over ``self.named_parameters()``, the "keep the
    trainable weights" hook) is noted in :attr:`deleted` instead of raising ``KeyError``. Any other key
    deleted raises as in a dict.

    Example:
        >>> state = HookState({"head.weight": 1}, model_keys=["body.0.weight", "body.0.bias", "head.weight"])
        >>> del state["body.0.weight"]
        >>> state.pop("body.0.bias"), dict(state), sorted(state.deleted)
        (None, {'head.weight': 1}, ['body.0.bias', 'body.0.weight'])
    """

    def __init__(self, items: Mapping[str, Any], model_keys: Sequence[str]) -> None:
        super().__init__(items)
        self.model_keys = frozenset(model_keys)
        self.deleted: Set[str] = set()

    def _held_elsewhere(self, key: str) -> bool:
        return key not in self and key in self.model_keys

    def __delitem__(self, key: str) -> None:
        if self._held_elsewhere(key):
            self.deleted.add(key)
        else:
            super().__delitem__(key)

    def pop(self, key: str, *default: Any) -> Any:
        """As a dict's; a key of the model this process does not hold is noted and gives ``default`` (else None:
        the value lives on another process)."""
        if not self._held_elsewhere(key):
            return super().pop(key, *default)
        self.deleted.add(key)
        return default[0] if default else None

    def __reduce__(self) -> Any:
        # pickled and copied as a plain OrderedDict: a callback may move it elsewhere in the checkpoint (a weight
        # averaging one's `current_model_state`), and the file must load without lightning_pipe
        return OrderedDict, (list(self.items()),)


def parameter_names(module: nn.Module, canonical: Callable[[str], str] = lambda name: name) -> Dict[int, str]:
    """``id(parameter) -> canonical name`` (the first name of a parameter that is registered twice)."""
    names: Dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), canonical(name))
    return names


def group_names(optimizer: Optimizer, names: Mapping[int, str]) -> List[List[str]]:
    """The parameter names of each param group, in the optimizer's order (placeholders left out)."""
    return [[names[id(p)] for p in group["params"] if id(p) in names] for group in optimizer.param_groups]


def full_layout(per_stage: Sequence[List[List[str]]], order: Sequence[str],
                whole: Optional[Sequence[List[str]]] = None) -> List[List[str]]:
    """Each param group's names across all stages, in the unpartitioned model's group order.

    ``whole``: each group's names as ``configure_optimizers`` listed them over the whole model
    (see :meth:`Checkpoints.note_whole_orders`), taken where the stages' names are that group's, each
    stage's in its order. Otherwise (groups added since, or no such list) the stages' lists are merged:
    every stage lists a group's names in the group's own order (the user's, as in
    ``[*head.parameters(), *backbone.parameters()]``), each stage those it can name; the merge keeps
    every stage's order, and puts names no stage orders against each other in ``order`` (the
    model's ``named_parameters()`` order), which is a guess where the user's order differs.
    """
    layout = []
    for g in range(len(per_stage[0])):
        lists = [stage[g] for stage in per_stage]
        if whole is not None and g < len(whole) and _lists_follow(lists, whole[g]):
            layout.append(list(whole[g]))
        else:
            layout.append(merge_orders(lists, order))
    return layout


def _lists_follow(lists: Sequence[Sequence[str]], full: Sequence[str]) -> bool:
    """Whether ``lists`` together hold the names of ``full``, each list in ``full``'s order. A name on several lists
    (a parameter tied across stages, which each stage lists where its own copy sits) is left out of the order.

    Example:
        >>> _lists_follow([["b.1", "a"], ["b.0"]], ["b.1", "b.0", "a"]), _lists_follow([["a", "b.1"]], ["b.1", "a"])
        (True, False)
        >>> _lists_follow([["t", "b.1"], ["b.0", "t"]], ["b.1", "b.0", "t"])
        True
    """
    position = {name: i for i, name in enumerate(full)}
    if len(position) != len(full) or {n for names in lists for n in names} != set(full):
        return False
    counts: Dict[str, int] = {}
    for names in lists:
        for name in set(names):
            counts[name] = counts.get(name, 0) + 1
    for names in lists:
        placed = [position[n] for n in names if counts[n] == 1]
        if placed != sorted(placed):
            return False
    return True


def merge_orders(lists: Sequence[Sequence[str]], order: Sequence[str]) -> List[str]:
    """The names of ``lists`` in one order that keeps each list's (ties, and disagreements, by ``order``).

    Example:
        >>> merge_orders([["head.w", "body.0.w"], ["head.w", "body.2.w"]], ["body.0.w", "body.2.w", "head.w"])
        ['head.w', 'body.0.w', 'body.2.w']
    """
    rank_of = {name: i for i, name in enumerate(order)}
    key = lambda name: (rank_of.get(name, len(rank_of)), name)  # noqa: E731
    after: Dict[str, set] = {}
    before_count: Dict[str, int] = {}
    for names in lists:
        for name in names:
            after.setdefault(name, set())
            before_count.setdefault(name, 0)
        for a, b in zip(names, names[1:]):
            if b not in after[a]:
                after[a].add(b)
                before_count[b] += 1
    # Kahn's algorithm with a heap: a group may hold thousands of parameters, and this runs at every checkpoint
    ready = [(key(n), n) for n, count in before_count.items() if count == 0]
    heapq.heapify(ready)
    merged: List[str] = []
    done: Set[str] = set()
    while len(merged) < len(after):
        if ready:
            _, name = heapq.heappop(ready)
        else:  # the stages disagree (a cycle): the earliest name left in `order`
            name = min((n for n in after if n not in done), key=key)
        if name in done:
            continue
        merged.append(name)
        done.add(name)
        for b in after[name]:
            before_count[b] -= 1
            if before_count[b] == 0 and b not in done:
                heapq.heappush(ready, (key(b), b))
    return merged


def _named_once(params: Sequence[torch.Tensor], paths: Mapping[int, str], canonical: Callable[[str], str]) -> List[str]:
    """The canonical names of ``params``, each once. A parameter tied across stages is one object in one process,
    which ``self.parameters()`` yields at its canonical (first) place; the whole model shown here holds a copy per
    stage, so the copy at that place stands for it and the others are left out."""
    named = [(canonical(paths[id(p)]), paths[id(p)]) for p in params if id(p) in paths]
    at_home = {name for name, path in named if name == path}
    kept: List[str] = []
    seen: Set[str] = set()
    for name, path in named:
        if name not in seen and (name == path or name not in at_home):
            kept.append(name)
            seen.add(name)
    return kept


def optimizer_contribution(optimizer: Optimizer, names: Mapping[int, str], owned: set) -> Dict[str, Any]:
    """This rank's part of an optimizer's state, keyed by parameter name."""
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_name = {}
    for index, p in enumerate(params):
        name = names.get(id(p))
        if name in owned and index in state["state"]:
            by_name[name] = _cpu(state["state"][index])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    return {"state": by_name, "groups": groups}


def assemble_optimizer(contributions: Sequence[Dict[str, Any]], layout: List[List[str]]) -> Dict[str, Any]:
    """The unpartitioned model's ``optimizer.state_dict()`` from every stage's contribution."""
    merged: Dict[str, Any] = {}
    for contribution in contributions:
        merged.update(contribution["state"])
    state, param_groups, index = {}, [], 0
    for g, names in enumerate(layout):
        group = dict(contributions[0]["groups"][g])
        group["params"] = list(range(index, index + len(names)))
        for name in names:
            if name in merged:
                state[index] = merged[name]
            index += 1
        param_groups.append(group)
    return {"state": state, "param_groups": param_groups}


def localize_optimizer(
    full: Mapping[str, Any], layout: List[List[str]], optimizer: Optimizer, names: Mapping[int, str]
) -> Dict[str, Any]:
    """The local optimizer's ``state_dict`` taken from an unpartitioned one."""
    index_of: Dict[str, int] = {}
    for group, group_layout in zip(full["param_groups"], layout):
        if len(group["params"]) != len(group_layout):
            raise ValueError(
                f"the checkpoint's param group has {len(group['params'])} parameters but this model's has "
                f"{len(group_layout)}; was it saved from a different model or optimizer configuration?"
            )
        index_of.update(zip(group_layout, group["params"]))
    state, param_groups, local_index = {}, [], 0
    for g, group in enumerate(optimizer.param_groups):
        saved = dict(full["param_groups"][g])
        saved["params"] = []
        for p in group["params"]:
            full_index = index_of.get(names.get(id(p)))
            if full_index in full["state"] and not p.is_meta:  # released here: another stage trains it
                state[local_index] = full["state"][full_index]
            saved["params"].append(local_index)
            local_index += 1
        param_groups.append(saved)
    return {"state": state, "param_groups": param_groups}


def module_contribution(module: nn.Module, owned: set) -> Dict[str, torch.Tensor]:
    """The entries of this rank's ``state_dict`` that it owns, on the CPU."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items() if k in owned}


class Checkpoints:
    """Whole-model checkpoints of a split model: gathered into global rank 0, loaded by each stage.

    Every method is called on every rank (the gathers are collectives over the world and the
    pipeline); only global rank 0 gets the whole state. Replica 0 of each stage contributes.

    Args:
        split: the split model (names, owners, aliases).
        module: the LightningModule.
        pp_group: the pipeline's process group.
        num_stages: its size.
        dp_rank: this rank's replica.
    """

    def __init__(self, split: Any, module: nn.Module, pp_group: Any, num_stages: int, dp_rank: int) -> None:
        self.split = split
        self.module = module
        self.pp_group = pp_group
        self.num_stages = num_stages
        self.dp_rank = dp_rank
        self.given: Optional[HookState] = None  # the state dict the checkpoint hooks were given (for_hooks)
        self.before_hooks: Dict[str, Any] = {}  # its entries then
        self.layouts: List[List[List[str]]] = []
        self.whole_orders: Optional[List[List[List[str]]]] = None  # see note_whole_orders

    def _names(self) -> Dict[int, str]:
        """``id -> canonical name`` of the parameters this rank's optimizers can hold: its module's, and the
        released (meta) copies of other stages' layers, which the stand-in presents (``self.body[-1]``)."""
        names = parameter_names(self.module, self.split.canonical)
        split = self.split
        for name, p in split.body.named_parameters(prefix=split.path, remove_duplicate=False):
            names.setdefault(id(p), split.canonical(name))
        return names

    def note_whole_orders(self, build: Callable[[], Sequence[Optimizer]]) -> Optional[str]:
        """Learn each optimizer's param groups, by name, as ``build`` (``configure_optimizers``) lists them over the
        whole model, with the whole body installed (other stages' layers on the meta device).

        Each stage's optimizers hold its own parameters only, so the order of a group's parameters on different
        stages is the user's code's alone (``Adam(reversed(list(self.parameters())))``): the checkpoint's layout
        (:func:`full_layout`) takes it from here, where every stage learned the same orders (its code may differ per
        rank). The optimizers built are dropped. A collective over the pipeline (see :meth:`SplitModel.show_whole`).

        Returns:
            Why the orders could not be learned here (``build`` raised: an optimizer that refuses meta tensors, say),
            or None.
        """
        orders, failed = None, None
        self.split.show_whole(self.pp_group)
        try:
            paths = parameter_names(self.module)  # where each parameter object sits in the whole model
            orders = [[_named_once(group["params"], paths, self.split.canonical)
                       for group in getattr(o, "_optimizer", o).param_groups] for o in build()]
        except Exception as error:  # noqa: BLE001 - the real build that follows raises what concerns the user
            failed = f"{type(error).__name__}: {error}"
        finally:
            self.split.install(whole=False)
        per_stage: List[Any] = [None] * self.num_stages
        dist.all_gather_object(per_stage, orders, group=self.pp_group)
        self.whole_orders = per_stage[0] if all(o == per_stage[0] for o in per_stage) else None
        return failed

    def record_layouts(self, optimizers: Sequence[Optimizer]) -> None:
        """Each optimizer's param groups over all stages, by canonical name (a collective)."""
        names = self._names()
        self.layouts = []
        for index, optimizer in enumerate(optimizers):
            whole = self.whole_orders[index] if self.whole_orders is not None and index < len(self.whole_orders) \
                else None
            per_stage: List[Any] = [None] * self.num_stages
            dist.all_gather_object(per_stage, group_names(optimizer, names), group=self.pp_group)
            self.layouts.append(full_layout(per_stage, self.split.parameter_order, whole))

    def _gather_to_zero(self, contribution: Any) -> Optional[list]:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(contribution if self.dp_rank == 0 else None, gathered, dst=0)
        return [c for c in gathered if c is not None] if gathered is not None else None

    def module_state(self, gather: bool = True) -> Dict[str, torch.Tensor]:
        """The unsplit module's ``state_dict`` on global rank 0 (empty elsewhere), or this rank's part."""
        state = self.module.state_dict()
        mine = module_contribution(self.module, self.split.owned_keys(list(state)))
        if not gather:
            return mine
        parts = self._gather_to_zero(mine)
        if parts is None:
            return {}
        merged: Dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        for alias, key in self.split.key_aliases.items():  # one tensor under both names: saved once
            if key in merged:
                merged[alias] = merged[key]
        return OrderedDict((k, merged[k]) for k in self.split.key_order if k in merged)

    def optimizer_state(self, optimizer: Optimizer, index: int, gather: bool = True) -> Dict[str, Any]:
        """The unsplit model's ``optimizer.state_dict()`` on global rank 0 (empty elsewhere), or this rank's part."""
        names = self._names()
        owned = {names[id(p)] for group in optimizer.param_groups for p in group["params"]
                 if id(p) in names and self.split.counts_in_norm(names[id(p)])}
        mine = optimizer_contribution(optimizer, names, owned)
        if not gather:
            return mine
        parts = self._gather_to_zero(mine)
        return assemble_optimizer(parts, self.layouts[index]) if parts is not None else {}

    def save_sharded(self, checkpoint: Dict[str, Any], path: str, global_zero: bool) -> None:
        """Write ``checkpoint`` (this rank's parts) as a sharded directory; every rank calls it."""
        layouts = self.layouts if "optimizer_states" in checkpoint else []  # none in a weights-only checkpoint
        state, optimizers = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
        current = checkpoint.pop("current_model_state", None)  # a weight averaging callback's: this rank's part too
        before, kept = self.before_hooks, self._kept_by_hooks(state)
        aliases = {alias: key for alias, key in self.split.key_aliases.items() if alias in kept}  # deleted: not implied
        for alias, key in aliases.items():  # a hook deleted the first key of a tied tensor, not this one: keep it
            if alias not in state and key not in state and key in before:
                state[alias] = before[key]
        save_sharded(path, state, optimizers, layouts, checkpoint if global_zero else None,
                     aliases=aliases, expected_keys=kept, current_state=current, group=None)

    def for_hooks(self, state: Mapping[str, Any]) -> HookState:
        """``state`` (:meth:`module_state`'s), as the checkpoint hooks get it (:class:`HookState`)."""
        self.given = HookState(state, self.split.key_order)
        self.before_hooks = dict(self.given)  # the tensors themselves, no copies
        return self.given

    def _kept_by_hooks(self, state: Mapping[str, Any]) -> List[str]:
        """The model's keys less those an ``on_save_checkpoint`` hook deleted on some rank (a collective): a "save
        the trainable weights only" hook leaves the file without them, as one process's file is.

        A key of a tensor registered twice (a tied weight) stays unless it was deleted itself, as in one
        process's state dict, which holds both keys: deleting one of them (``lm_head.weight``) keeps the
        other. Where the hooks were given no part (a save after ``fit`` put the whole model back in every
        process), each process's state holds every key the hooks kept.
        """
        if self.given is not None:
            removed = sorted(set(self.before_hooks) - set(state) | self.given.deleted)
        else:
            removed = [key for key in self.split.key_order if key not in state]
        self.given, self.before_hooks = None, {}
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, removed)
        gone = {key for part in everyone for key in part}
        return [k for k in self.split.key_order if k not in gone]

    def load(self, path: str, optimizers: Sequence[Optimizer], strict: bool, weights_only: Optional[bool]) -> Dict[str, Any]:
        """A checkpoint for this rank: a sharded directory read in part, or a file mapped, not read, whole."""
        if not os.path.isdir(path):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=bool(weights_only))
        templates = {k: v for k, v in self.module.state_dict().items() if not v.is_meta}
        names = parameter_names(self.module, self.split.canonical)  # not the other stages' layers: not read here
        wanted = [[n for group in group_names(o, names) for n in group] for o in optimizers] if optimizers else None
        checkpoint = load_sharded(path, templates, wanted, layouts=self.layouts if optimizers else None,
                                  expected_keys=self.split.key_order, strict=strict, weights_only=weights_only)
        checkpoint[_LOADED_IN_PLACE] = True  # its state dicts hold this rank's keys: see weights_loader
        return checkpoint

    def weights_loader(self, checkpoint: Dict[str, Any], strict: bool) -> Callable[[Dict[str, Any]], None]:
        """What loads a state dict of ``checkpoint`` into this rank's part: its ``state_dict``, or the current weights
        a weight averaging callback saved beside the averaged ones (``current_model_state``).

        A sharded checkpoint's hold this rank's keys only, checked when they were read (:meth:`load`); a whole
        one's are checked against the whole model's keys first.

        Raises:
            ConfigurationError: with ``strict``, a whole checkpoint's keys are not the model's (on every rank,
                before anything is loaded).
        """
        if checkpoint.pop(_LOADED_IN_PLACE, False):
            return self._load_local
        return lambda state_dict: self._load_whole(state_dict, strict)

    def _load_whole(self, state_dict: Mapping[str, Any], strict: bool) -> None:
        expected = set(self.split.key_order)
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise ConfigurationError(
                f"the checkpoint does not hold this model: missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; was it saved from another model?"
            )
        self._load_local(state_dict)

    def _load_local(self, state_dict: Mapping[str, Any]) -> None:
        """This rank's materialized entries of ``state_dict`` (those that are not its own tensors already)."""
        own = {k: v for k, v in self.module.state_dict().items() if not v.is_meta}
        self.module.load_state_dict({k: v for k, v in state_dict.items() if k in own and v is not own[k]}, strict=False)

    def load_optimizer_states(self, optimizers: Sequence[Optimizer], saved: Sequence[Mapping[str, Any]]) -> None:
        names = self._names()
        for optimizer, layout, state in zip(optimizers, self.layouts, saved):
            optimizer.load_state_dict(localize_optimizer(state, layout, optimizer, names))
