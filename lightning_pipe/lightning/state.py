"""Whole-model checkpoints from a partitioned model, and back.

A checkpoint written under PipeStrategy is an ordinary Lightning checkpoint: the unpartitioned
model's ``state_dict`` keys, and each optimizer's state in the layout the unpartitioned model's
optimizer would have (parameters numbered in ``named_parameters()`` order within each param group).
The layout is computed from parameter *names*, so a checkpoint moves between plain training and
any number of stages.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

import torch
from torch import nn
from torch.optim import Optimizer


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    return value


def parameter_names(module: nn.Module) -> Dict[int, str]:
    """``id(parameter) -> name`` (the first name of a parameter that is registered twice)."""
    names: Dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def group_names(optimizer: Optimizer, names: Mapping[int, str]) -> List[List[str]]:
    """The parameter names of each param group, in the optimizer's order."""
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def full_layout(per_stage: Sequence[List[List[str]]], order: Sequence[str]) -> List[List[str]]:
    """Each param group's names across all stages, in the unpartitioned model's parameter order."""
    rank_of = {name: i for i, name in enumerate(order)}
    layout = []
    for g in range(len(per_stage[0])):
        members = {name for stage in per_stage for name in stage[g]}
        layout.append(sorted(members, key=lambda n: rank_of.get(n, len(rank_of))))
    return layout


def optimizer_contribution(optimizer: Optimizer, names: Mapping[int, str], owned: set) -> Dict[str, Any]:
    """This rank's part of an optimizer's state, keyed by parameter name."""
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_name = {}
    for index, p in enumerate(params):
        name = names[id(p)]
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
            full_index = index_of[names[id(p)]]
            if full_index in full["state"]:
                state[local_index] = full["state"][full_index]
            saved["params"].append(local_index)
            local_index += 1
        param_groups.append(saved)
    return {"state": state, "param_groups": param_groups}


def module_contribution(module: nn.Module, owned: set) -> Dict[str, torch.Tensor]:
    """The entries of this rank's ``state_dict`` that it owns, on the CPU."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items() if k in owned}


def owner_of_key(key: str, parameter_owner: Mapping[str, int], default: int = 0) -> int:
    """The stage that holds the authoritative value of a non-body state_dict entry."""
    if key in parameter_owner:
        return parameter_owner[key]
    module_path = key.rpartition(".")[0]
    owners = [stage for name, stage in parameter_owner.items() if name.rpartition(".")[0] == module_path]
    return min(owners) if owners else default
