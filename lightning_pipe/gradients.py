"""Gradient bookkeeping around the pipeline: set aside, scale, average replicas, norms over stages.

Written by hand because Lightning's hooks assume one process holds the whole model: its
precision plugin clips by the local norm, and DDP would all-reduce over the world. Here a total
norm is reduced over the pipeline's stages (tied parameters, summed in :mod:`lightning_pipe.ties`,
count once) in the order one process takes it, and each stage's gradients are averaged over its
replicas only.
"""

from __future__ import annotations

import functools
from typing import Dict, Iterable, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

_flatten = torch._utils._flatten_dense_tensors  # torch's own bucketing helpers (as DDP uses)
_unflatten = torch._utils._unflatten_dense_tensors


def take_grads(parameters: Iterable[nn.Parameter]) -> Dict[nn.Parameter, Optional[torch.Tensor]]:
    """Detach every ``.grad`` from its parameter and return them."""
    grads = {}
    for p in parameters:
        grads[p] = p.grad
        p.grad = None
    return grads


def add_grads(grads: Mapping[nn.Parameter, Optional[torch.Tensor]]) -> None:
    """Accumulate ``grads`` into the parameters' ``.grad``, as a backward would."""
    for p, g in grads.items():
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


def scale_grads(grads: Mapping[nn.Parameter, Optional[torch.Tensor]], factor: float) -> None:
    """Multiply gradients set aside by :func:`take_grads` by ``factor``, in place."""
    for g in grads.values():
        if g is not None:
            g.mul_(factor)


def average(parameters: Iterable[nn.Parameter], group, size: int) -> None:
    """Average the gradients over a data-parallel group, in one bucket.

    Every replica passes the same parameters in the same order; those that take gradients (not
    frozen, not released to the meta device) are averaged, with the same layout on every replica
    whatever each one's step used. A parameter without a gradient on some replicas counts as zeros
    there (as under DDP); one without a gradient on every replica keeps none, as on one process over
    the whole batch (the optimizer skips it). A flag per parameter, in the same all-reduce, tells
    the two apart.
    """
    params = [p for p in parameters if p.requires_grad and not p.is_meta]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    present = [p.grad is not None for p in params]
    flags = torch.tensor(present, dtype=grads[0].dtype, device=grads[0].device)
    flat = _flatten(grads + [flags])
    dist.all_reduce(flat, group=group)
    flat /= size
    # the flags are read (on a GPU, a wait for it) only where this replica lacked a gradient: one it has is used
    used = flat[-len(params):].tolist() if not all(present) else present
    for p, synced, anywhere in zip(params, _unflatten(flat[:-len(params)], grads), used):
        if not anywhere:
            continue  # no replica's step used it
        if p.grad is None:
            p.grad = synced.to(p.dtype, copy=True)  # the flat buffer has the widest dtype of them all
        else:
            p.grad.copy_(synced)


def broadcast_module(module: nn.Module, device: torch.device, bucket_bytes: int = 16 << 20) -> None:
    """Rank 0's parameters and buffers to every rank, staged through ``device``.

    The module may still be on the CPU, which NCCL cannot broadcast, so tensors are flattened
    per dtype on ``device`` into buckets of about ``bucket_bytes`` (one broadcast each, and never
    a second copy of the whole model) and copied back.
    """
    buckets: Dict[torch.dtype, List[List[torch.Tensor]]] = {}
    filled: Dict[torch.dtype, int] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.is_meta:  # meta tensors get their values from a seed every rank shares
            continue
        dtype_buckets = buckets.setdefault(tensor.dtype, [[]])
        if filled.get(tensor.dtype, 0) >= bucket_bytes:
            dtype_buckets.append([])
            filled[tensor.dtype] = 0
        dtype_buckets[-1].append(tensor)
        filled[tensor.dtype] = filled.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
    with torch.no_grad():
        for tensors in (bucket for dtype_buckets in buckets.values() for bucket in dtype_buckets):
            flat = _flatten([t.detach().to(device) for t in tensors])
            dist.broadcast(flat, src=0)
            for t, synced in zip(tensors, _unflatten(flat, tensors)):
                t.copy_(synced)


_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def stage_norms(tensors: Mapping[int, torch.Tensor], norm_type: float, foreach: Optional[bool] = None) -> Dict[int, torch.Tensor]:
    """Each tensor's ``norm_type``-norm, as ``torch.nn.utils.get_total_norm`` computes it (``_foreach_norm``
    per device and dtype where it can), keyed like ``tensors``."""
    from torch.utils._foreach_utils import _has_foreach_support

    groups: Dict[tuple, List[int]] = {}
    for key, t in tensors.items():
        groups.setdefault((t.device, t.dtype), []).append(key)
    norms: Dict[int, torch.Tensor] = {}
    for (device, _), keys in groups.items():
        group = [tensors[k] for k in keys]
        if foreach is not False and _has_foreach_support(group, device):
            values = torch._foreach_norm(group, norm_type)
        else:
            values = [torch.linalg.vector_norm(t, norm_type) for t in group]
        norms.update(zip(keys, values))
    return norms


def total_norm_over_stages(norms: Mapping[int, torch.Tensor], size: int, norm_type: float, group,
                           device: torch.device) -> Optional[torch.Tensor]:
    """``get_total_norm`` of tensors spread over the pipeline's stages, as one process computes it.

    ``norms``: position (in the whole model's parameter order, ``0 <= position < size``) -> this rank's norm
    of the tensor there, given by the one rank that counts it (a tied parameter once). One all-reduce
    over ``group`` gathers every stage's norms; they are stacked in position order and reduced in the
    dtype torch would use, so the result equals the norm of the unsplit model's tensors taken in
    parameter order. Returns None when no stage gave a norm (torch returns ``tensor(0.0)`` then).
    """
    buffer = torch.zeros(2 * size + len(_NORM_DTYPES), dtype=torch.float64, device=device)
    for position, norm in norms.items():
        buffer[position] = norm.detach().to(device, torch.float64)
        buffer[size + position] = 1.0
        dtype = norm.dtype if norm.dtype in _NORM_DTYPES else torch.float32
        buffer[2 * size + _NORM_DTYPES.index(dtype)] = 1.0
    dist.all_reduce(buffer, group=group)
    present = buffer[size:2 * size] > 0
    if not bool(present.any()):
        return None
    flags = buffer[2 * size:].tolist()
    dtype = functools.reduce(torch.promote_types, [d for d, f in zip(_NORM_DTYPES, flags) if f > 0])
    return torch.linalg.vector_norm(buffer[:size][present].to(dtype), norm_type)
