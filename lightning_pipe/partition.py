"""Splitting a sequential model into stages.

The local stage keeps the original child names (``nn.Sequential(OrderedDict(...))``), so its
``state_dict()`` keys are exactly the unpartitioned model's keys for those layers and checkpoints
move between pipelined and plain runs without renaming.

Balances come from a cost per layer: its parameter count, or, measured on a sample input, its
forward and backward time (as torchgpipe's ``balance_by_time``), its memory, or its FLOPs counted
on the meta device (for models that fit on no single device). Each picks the contiguous split
whose most expensive stage is cheapest.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_pipe.errors import ConfigurationError, PartitionError
from lightning_pipe.memory import ActivationMeter
from lightning_pipe.schedule.placement import placement as placement_of
from lightning_pipe.ties import find_ties

TIES_ATTRIBUTE = "_lightning_pipe_ties"  # the tied parameters of the model a stage was cut from
# which part of the model a stage is: (part index, number of parts, balance, placement); the pipeline checks that the
# ranks' parts make up one model, each part at its own stage
PART_ATTRIBUTE = "_lightning_pipe_part"


class SequentialModel(nn.Sequential):
    """Like :class:`torch.nn.Sequential`, but layers take and return several positional values.

    A layer's tuple output is unpacked into the next layer's arguments; any other output is passed
    as the single argument.

    Example:
        >>> class AddOne(nn.Module):
        ...     def forward(self, x, index):
        ...         return x + 1, index
        >>> model = SequentialModel(AddOne(), AddOne())
        >>> x, index = model(torch.zeros(2), torch.tensor([3, 4]))
        >>> x.tolist(), index.tolist()
        ([2.0, 2.0], [3, 4])
    """

    def forward(self, *inputs):
        values = inputs
        for layer in self:
            out = layer(*values)
            values = out if isinstance(out, tuple) else (out,)
        return values[0] if len(values) == 1 else values


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balance_by_layers(num_layers: int, num_stages: int) -> List[int]:
    """As even a split of layer counts as possible: ``balance_by_layers(10, 4) == [3, 3, 2, 2]``."""
    _check_sizes(num_layers, num_stages)
    return [num_layers // num_stages + (1 if s < num_layers % num_stages else 0) for s in range(num_stages)]


def balance_by_parameters(module: nn.Sequential, num_stages: int) -> List[int]:
    """Contiguous layer counts that minimise the largest stage's parameter count.

    No stage is left without parameters unless the model has fewer layers with parameters than
    stages. Ties go to the most even split of layer counts.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
        >>> balance_by_parameters(model, 2)
        [2, 2]
    """
    weights = [_parameter_count(layer) for layer in module]
    _check_sizes(len(weights), num_stages)
    require_params = sum(1 for w in weights if w > 0) >= num_stages
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def allowed(j: int, i: int) -> bool:
        return not require_params or prefix[i] > prefix[j]

    # first the smallest achievable largest stage, then the most even layer counts within it
    largest, _ = _min_max_split(len(weights), num_stages, lambda j, i: prefix[i] - prefix[j], allowed)
    even = len(weights) / num_stages
    _, balance = _min_max_split(
        len(weights), num_stages, lambda j, i: abs((i - j) - even),
        lambda j, i: allowed(j, i) and prefix[i] - prefix[j] <= largest,
    )
    return balance


def balance_by_cost(costs: Sequence[float], num_stages: int) -> List[int]:
    """Contiguous layer counts that minimise the most expensive stage, given each layer's cost.

    Ties go to the most even split of layer counts.

    Example:
        >>> balance_by_cost([1, 1, 1, 1, 6, 2], 2)
        [4, 2]
    """
    _check_sizes(len(costs), num_stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    largest, _ = _min_max_split(len(costs), num_stages, lambda j, i: prefix[i] - prefix[j], lambda j, i: True)
    even = len(costs) / num_stages
    _, balance = _min_max_split(
        len(costs), num_stages, lambda j, i: abs((i - j) - even), lambda j, i: prefix[i] - prefix[j] <= largest
    )
    return balance


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> List[float]:
    """The cost of each stage of ``balance``: ``stage_costs([1, 2, 3], [2, 1]) == [3, 3]``."""
    return [sum(costs[start:stop]) for start, stop in split_points(balance)]


def balance_by_time(module: nn.Sequential, sample_input: Any, num_stages: int, repeat: int = 5) -> List[int]:
    """Balance by each layer's measured forward + backward time on ``sample_input`` (a microbatch).

    See :func:`layer_times`; noisy machines call for a larger ``repeat``.
    """
    return balance_by_cost(layer_times(module, sample_input, repeat), num_stages)


def balance_by_memory(module: nn.Sequential, sample_input: Any, num_stages: int, param_scale: float = 2.0) -> List[int]:
    """Balance by each layer's activation bytes plus ``param_scale`` times its parameter bytes.

    See :func:`layer_memory`.
    """
    return balance_by_cost(layer_memory(module, sample_input, param_scale), num_stages)


def balance_by_flops(module: nn.Sequential, sample_input: Any, num_stages: int) -> List[int]:
    """Balance by each layer's forward + backward FLOPs, counted on the meta device.

    Nothing is materialized (see :func:`layer_flops`): the model may live on the meta device.

    Example:
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> balance_by_flops(model, torch.empty(4, 8, device="meta"), 2), model[0].weight.device
        ([2, 2], device(type='meta'))
    """
    return balance_by_cost(layer_flops(module, sample_input), num_stages)


def _values(sample_input: Any) -> tuple:
    return sample_input if isinstance(sample_input, tuple) else (sample_input,)


def _leaf(value: Any) -> Any:
    """A detached copy of a tensor that requires grad if it can, as a stage's received input does."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    return value.requires_grad_(True) if value.is_floating_point() or value.is_complex() else value


def _call(module: nn.Sequential, layer: nn.Module, values: tuple, call: Callable = None) -> tuple:
    """Run one layer as ``module`` would (SequentialModel unpacks tuples) and return the next values."""
    args = values if isinstance(module, SequentialModel) else (values[0] if len(values) == 1 else values,)
    out = call(layer, args) if call is not None else layer(*args)
    return out if isinstance(out, tuple) and isinstance(module, SequentialModel) else (out,)


def _backward_roots(outputs: tuple) -> Tuple[list, list]:
    roots = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    return roots, [torch.ones_like(t) for t in roots]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_times(module: nn.Sequential, sample_input: Any, repeat: int = 5) -> List[float]:
    """Each layer's forward + backward seconds on ``sample_input``, the median of ``repeat`` runs.

    Layers run one by one on the sample's device, after one warm-up run. Gradients go to
    ``torch.autograd.grad`` (no ``.grad`` is touched); buffers (BatchNorm statistics) and the RNG
    state are restored afterwards.
    """
    if not isinstance(repeat, int) or repeat < 1:
        raise PartitionError(f"repeat must be a positive integer, got {repeat!r}")
    samples: List[List[float]] = [[] for _ in module]
    buffers = [b.detach().clone() for b in module.buffers()]
    devices = [t.device for t in tree_flatten(sample_input)[0] if isinstance(t, torch.Tensor)]
    device = devices[0] if devices else torch.device("cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for run in range(repeat + 1):
            values = _values(sample_input)
            for k, layer in enumerate(module):
                inputs = tuple(tree_map(_leaf, v) for v in values)
                _synchronize(device)
                begin = time.perf_counter()
                values = _call(module, layer, inputs)
                roots, grads = _backward_roots(values)
                wrt = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                wrt += [p for p in layer.parameters() if p.requires_grad]
                if roots and wrt:
                    torch.autograd.grad(roots, wrt, grads, allow_unused=True)
                _synchronize(device)
                if run > 0:
                    samples[k].append(time.perf_counter() - begin)
    with torch.no_grad():
        for buffer, saved in zip(module.buffers(), buffers):
            buffer.copy_(saved)
    return [statistics.median(s) for s in samples]


def layer_memory(module: nn.Sequential, sample_input: Any, param_scale: float = 2.0) -> List[float]:
    """Each layer's bytes: activations it saves for backward on ``sample_input`` (counted exactly
    with ``saved_tensors_hooks``) plus ``param_scale`` times its parameter bytes.

    ``param_scale`` counts the copies of parameters training holds: 2 for SGD (weights,
    gradients), 3 with momentum, 4 for Adam. Buffers are restored afterwards.

    Example:
        >>> layer_memory(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.ones(2, 4))
        [192.0, 32.0]
    """
    buffers = [b.detach().clone() for b in module.buffers()]
    values, costs = _values(sample_input), []
    with torch.random.fork_rng(devices=[]):
        for layer in module:
            inputs = tuple(tree_map(_leaf, v) for v in values)
            meter = ActivationMeter(layer.parameters())
            with meter.record(0, inputs=()):
                values = _call(module, layer, inputs)
            params = sum(p.numel() * p.element_size() for p in layer.parameters())
            costs.append(float(meter.held_bytes + param_scale * params))
    with torch.no_grad():
        for buffer, saved in zip(module.buffers(), buffers):
            buffer.copy_(saved)
    return costs


def meta_like(value: Any) -> Any:
    """A tensor's stand-in on the meta device (same shape, dtype and requires_grad); other values as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_like(value, device="meta").requires_grad_(value.requires_grad)


def layer_flops(module: nn.Sequential, sample_input: Any) -> List[int]:
    """Each layer's forward + backward FLOPs on ``sample_input``, counted on the meta device.

    The layers run through ``torch.func.functional_call`` with meta stand-ins for their
    parameters and buffers, so nothing is allocated or materialized and the module is untouched,
    whether its parameters are real or meta. ``torch.utils.flop_counter`` counts matrix products
    and convolutions (attention included); elementwise work counts as free.
    """
    from torch.utils.flop_counter import FlopCounterMode

    values, costs = tree_map(meta_like, _values(sample_input)), []
    for layer in module:
        inputs = tuple(tree_map(_leaf, v) for v in values)
        state = {n: meta_like(t) for n, t in list(layer.named_parameters()) + list(layer.named_buffers())}
        with FlopCounterMode(display=False) as counter:
            values = _call(module, layer, inputs, lambda lay, args: torch.func.functional_call(lay, state, args))
            roots, grads = _backward_roots(values)
            if roots:
                torch.autograd.backward(roots, grads)  # autograd.grad clashes with the counter's hooks
        costs.append(counter.get_total_flops())
    return costs


def _min_max_split(n: int, num_stages: int, cost, allowed) -> Tuple[float, List[int]]:
    """Split ``n`` layers into contiguous stages minimising the largest ``cost(start, stop)``."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf or not allowed(j, i):
                    continue
                value = max(best[k - 1][j], cost(j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    balance, i = [], n
    for k in range(num_stages, 0, -1):
        balance.append(i - cut[k][i])
        i = cut[k][i]
    return best[num_stages][n], balance[::-1]


def _check_sizes(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise PartitionError(f"the number of stages must be at least 1, got {num_stages}")
    if num_layers < num_stages:
        raise PartitionError(
            f"cannot split {num_layers} layers into {num_stages} stages: every stage needs at least one layer; "
            f"use at most {num_layers} stages or a model with more layers"
        )


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> List[int]:
    """Validate a user's balance and return it as a list.

    Raises:
        PartitionError: naming the values and the fix.
    """
    balance = list(balance)
    if len(balance) != num_stages:
        raise PartitionError(
            f"balance {balance} has {len(balance)} entries but there are {num_stages} stages; "
            "give one layer count per stage"
        )
    if any(not isinstance(b, int) or b < 1 for b in balance):
        raise PartitionError(f"balance {balance} must hold positive integers: every stage needs at least one layer")
    if sum(balance) != num_layers:
        raise PartitionError(
            f"the model and sum of balance have different lengths (model: {num_layers} layers, "
            f"sum of balance {balance}: {sum(balance)})"
        )
    return balance


def split_points(balance: Sequence[int]) -> List[Tuple[int, int]]:
    """``[(start, stop), ...]`` layer ranges of each stage: ``split_points([2, 1]) == [(0, 2), (2, 3)]``."""
    out, start = [], 0
    for count in balance:
        out.append((start, start + count))
        start += count
    return out


def partition(
    module: nn.Sequential,
    rank: int,
    nranks: int,
    balance: Optional[Sequence[int]] = None,
    num_model_chunks: Optional[int] = None,
    placement: str = "loop",
) -> Union[nn.Sequential, List[nn.Sequential]]:
    """Keep the layers of ``module`` that belong to ``rank``.

    Args:
        module: an ``nn.Sequential`` (or :class:`SequentialModel`) whose children are the layers.
        rank: this process's stage rank in ``[0, nranks)``.
        nranks: the number of pipeline ranks.
        balance: layer counts per part; by default balanced by parameter count.
        num_model_chunks: with ``v`` chunks the model is cut into ``nranks * v`` parts (stages) and a
            list of this rank's parts is returned, in stage order.
        placement: which parts a rank keeps (see :mod:`lightning_pipe.schedule.placement`):
            ``"loop"``: parts ``r, r + nranks, ...`` (interleaved 1F1B); ``"v"``: parts ``r`` and
            ``2 * nranks - 1 - r`` (ZB-V; needs ``num_model_chunks=2``).

    Returns:
        The local stage, of the same class as ``module`` and with the original child names (a
        list of them with ``num_model_chunks``). Parameters registered in layers of several ranks
        (tied weights) are remembered, and :class:`lightning_pipe.Pipeline` sums their gradients
        over those ranks in every step.

    Raises:
        PartitionError: the model has fewer layers than parts, a bad balance, or a placement that
            does not fit ``num_model_chunks``.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> list(partition(model, 1, 2, balance=[2, 1]).state_dict())
        ['2.weight', '2.bias']
        >>> model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
        >>> [list(part._modules) for part in partition(model, 0, 2, num_model_chunks=2, placement="v")]
        [['0'], ['3']]
    """
    if not isinstance(module, nn.Sequential):
        raise PartitionError(f"partition() splits an nn.Sequential, got {type(module).__name__}")
    if not 0 <= rank < nranks:
        raise PartitionError(f"rank {rank} is outside [0, {nranks})")
    chunks = 1 if num_model_chunks is None else num_model_chunks
    if not isinstance(chunks, int) or chunks < 1:
        raise PartitionError(f"num_model_chunks must be at least 1, got {num_model_chunks!r}")
    num_parts = nranks * chunks
    try:
        part_ranks = placement_of(placement, nranks, num_parts)
    except ConfigurationError as error:
        raise PartitionError(f"{error} (num_model_chunks={chunks}, placement={placement!r})") from None
    names = list(module._modules)
    if balance is None:
        balance = balance_by_parameters(module, num_parts)
    balance = check_balance(balance, len(names), num_parts)
    ranges = split_points(balance)
    rank_of = {name: part_ranks[k] for k, (start, stop) in enumerate(ranges) for name in names[start:stop]}
    ties = find_ties(module, lambda name: [rank_of[name.split(".", 1)[0]]])
    parts = []
    for k, (start, stop) in enumerate(ranges):
        if part_ranks[k] != rank:
            continue
        part = type(module)(OrderedDict((name, module._modules[name]) for name in names[start:stop]))
        part.__dict__[TIES_ATTRIBUTE] = ties  # read by the pipeline, which sums their gradients over ranks
        part.__dict__[PART_ATTRIBUTE] = (k, num_parts, tuple(balance), placement)
        parts.append(part)
    return parts if num_model_chunks is not None else parts[0]
