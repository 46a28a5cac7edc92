"""Splitting a sequential model into stages.

The local stage keeps the original child names (``nn.Sequential(OrderedDict(...))``), so its
``state_dict()`` keys are exactly the unpartitioned model's keys for those layers and checkpoints
move between pipelined and plain runs without renaming.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple, Union

import torch  # noqa: F401  (the doctests use it)
from torch import nn

from lightning_pipe.errors import PartitionError
from lightning_pipe.ties import find_ties

TIES_ATTRIBUTE = "_lightning_pipe_ties"  # the tied parameters of the model a stage was cut from


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
) -> Union[nn.Sequential, List[nn.Sequential]]:
    """Keep the layers of ``module`` that belong to ``rank``.

    Args:
        module: an ``nn.Sequential`` (or :class:`SequentialModel`) whose children are the layers.
        rank: this process's stage rank in ``[0, nranks)``.
        nranks: the number of pipeline ranks.
        balance: layer counts per part; by default balanced by parameter count.
        num_model_chunks: with ``v`` chunks the model is cut into ``nranks * v`` parts and rank ``r``
            keeps parts ``r, r + nranks, ...`` (interleaved placement); a list is returned.

    Returns:
        The local stage, of the same class as ``module`` and with the original child names.
        Parameters registered in layers of several stages (tied weights) are remembered, and
        :class:`lightning_pipe.Pipeline` sums their gradients over those stages in every step.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> list(partition(model, 1, 2, balance=[2, 1]).state_dict())
        ['2.weight', '2.bias']
    """
    if not isinstance(module, nn.Sequential):
        raise PartitionError(f"partition() splits an nn.Sequential, got {type(module).__name__}")
    if not 0 <= rank < nranks:
        raise PartitionError(f"rank {rank} is outside [0, {nranks})")
    chunks = 1 if num_model_chunks is None else num_model_chunks
    if chunks < 1:
        raise PartitionError(f"num_model_chunks must be at least 1, got {num_model_chunks}")
    num_parts = nranks * chunks
    names = list(module._modules)
    if balance is None:
        balance = balance_by_parameters(module, num_parts)
    balance = check_balance(balance, len(names), num_parts)
    ranges = split_points(balance)
    rank_of = {name: k % nranks for k, (start, stop) in enumerate(ranges) for name in names[start:stop]}
    ties = find_ties(module, lambda name: [rank_of[name.split(".", 1)[0]]])
    parts = []
    for start, stop in ranges[rank::nranks]:
        part = type(module)(OrderedDict((name, module._modules[name]) for name in names[start:stop]))
        part.__dict__[TIES_ATTRIBUTE] = ties  # read by the pipeline, which sums their gradients over stages
        parts.append(part)
    return parts if num_model_chunks is not None else parts[0]
