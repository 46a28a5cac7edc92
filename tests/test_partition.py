"""Splitting a sequential model into stages: names, balance, interleaving, multi-value layers."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict

import pytest
import torch
from torch import nn

from lightning_pipe import PartitionError, SequentialModel, balance_by_layers, balance_by_parameters, partition
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.partition import check_balance, split_points


def _named_model() -> nn.Sequential:
    return nn.Sequential(OrderedDict([
        ("embed", nn.Linear(4, 8)),
        ("act", nn.ReLU()),
        ("hidden", nn.Linear(8, 8)),
        ("norm", nn.LayerNorm(8)),
        ("head", nn.Linear(8, 2)),
    ]))


def _model_of_weights(weights) -> nn.Sequential:
    """One layer per weight: a bias-free Linear with that many parameters, or a ReLU for 0."""
    return nn.Sequential(*[nn.Linear(w, 1, bias=False) if w else nn.ReLU() for w in weights])


def _loads(weights, balance):
    return [sum(weights[start:stop]) for start, stop in split_points(balance)]


# -- partition ------------------------------------------------------------------------------------
def test_partition_keeps_original_names_and_state_dict_keys():
    model = _named_model()
    stages = [partition(model, r, 3, balance=[2, 2, 1]) for r in range(3)]
    assert [list(s._modules) for s in stages] == [["embed", "act"], ["hidden", "norm"], ["head"]]
    keys = [k for s in stages for k in s.state_dict()]
    assert keys == list(model.state_dict())
    for stage in stages:
        assert type(stage) is nn.Sequential
        for name, module in stage.named_children():
            assert module is getattr(model, name)  # layers are shared, not copied


def test_partition_with_digit_names_loads_plain_checkpoint():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    stage = partition(model, 1, 2, balance=[2, 1])
    assert list(stage.state_dict()) == ["2.weight", "2.bias"]
    reference = {k: torch.full_like(v, 3.0) for k, v in model.state_dict().items()}
    stage.load_state_dict({k: reference[k] for k in stage.state_dict()})
    torch.testing.assert_close(model[2].weight, torch.full((2, 2), 3.0))


def test_partition_of_stages_computes_the_whole_model():
    torch.manual_seed(0)
    model = _named_model()
    x = torch.randn(5, 4)
    y = x
    for r in range(3):
        y = partition(model, r, 3, balance=[1, 3, 1])(y)
    torch.testing.assert_close(y, model(x))


def test_partition_default_balance_is_by_parameters():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1))
    assert balance_by_parameters(model, 2) == [1, 3]
    assert list(partition(model, 0, 2)._modules) == ["0"]
    assert list(partition(model, 1, 2)._modules) == ["1", "2", "3"]


def test_partition_interleaved_chunks():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])
    parts = [partition(model, r, 2, balance=[1, 2, 3, 2], num_model_chunks=2) for r in range(2)]
    assert [[list(p._modules) for p in rank] for rank in parts] == [
        [["0"], ["3", "4", "5"]],
        [["1", "2"], ["6", "7"]],
    ]
    by_parameters = partition(model, 1, 2, num_model_chunks=2)
    assert [list(p._modules) for p in by_parameters] == [["2", "3"], ["6", "7"]]
    # One chunk asked for explicitly still returns a list; None returns the module itself.
    single = partition(model, 0, 2, balance=[4, 4], num_model_chunks=1)
    assert isinstance(single, list) and [list(p._modules) for p in single] == [["0", "1", "2", "3"]]
    assert isinstance(partition(model, 0, 2, balance=[4, 4]), nn.Sequential)


def test_partition_interleaved_balance_counts_every_part():
    model = nn.Sequential(*[nn.ReLU() for _ in range(8)])
    with pytest.raises(PartitionError, match=r"balance \[4, 4\] has 2 entries but there are 4 stages; give one layer count per stage"):
        partition(model, 0, 2, balance=[4, 4], num_model_chunks=2)


def test_partition_keeps_sequential_model_class():
    model = SequentialModel(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert type(partition(model, 0, 2, balance=[1, 2])) is SequentialModel


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=2, nranks=2), r"rank 2 is outside \[0, 2\)"),
        (dict(rank=-1, nranks=2), r"rank -1 is outside \[0, 2\)"),
        (dict(rank=0, nranks=2, num_model_chunks=0), r"num_model_chunks must be at least 1, got 0"),
        (dict(rank=0, nranks=6), r"cannot split 5 layers into 6 stages: every stage needs at least one layer; "
                                 r"use at most 5 stages or a model with more layers"),
        (dict(rank=0, nranks=3, num_model_chunks=2), r"cannot split 5 layers into 6 stages"),
        (dict(rank=0, nranks=2, balance=[2, 2]), r"the model and sum of balance have different lengths "
                                                 r"\(model: 5 layers, sum of balance \[2, 2\]: 4\)"),
        (dict(rank=0, nranks=2, balance=[3, 3]), r"\(model: 5 layers, sum of balance \[3, 3\]: 6\)"),
        (dict(rank=0, nranks=2, balance=[5]), r"balance \[5\] has 1 entries but there are 2 stages; give one layer count per stage"),
        (dict(rank=0, nranks=2, balance=[1, 1, 3]), r"balance \[1, 1, 3\] has 3 entries but there are 2 stages"),
        (dict(rank=0, nranks=2, balance=[5, 0]), r"balance \[5, 0\] must hold positive integers: every stage needs at least one layer"),
        (dict(rank=0, nranks=2, balance=[6, -1]), r"balance \[6, -1\] must hold positive integers"),
        (dict(rank=0, nranks=2, balance=[2.5, 2.5]), r"balance \[2\.5, 2\.5\] must hold positive integers"),
    ],
)
def test_partition_errors_name_the_values_and_the_fix(kwargs, match):
    with pytest.raises(PartitionError, match=match):
        partition(_named_model(), **kwargs)


def test_partition_rejects_a_non_sequential_module():
    with pytest.raises(PartitionError, match="partition\\(\\) splits an nn.Sequential, got Linear"):
        partition(nn.Linear(2, 2), 0, 1)


def test_partition_error_is_a_configuration_and_value_error():
    with pytest.raises(ConfigurationError):
        check_balance([1], 2, 2)
    with pytest.raises(ValueError):
        check_balance([1], 2, 2)


def test_check_balance_returns_a_list():
    assert check_balance((2, 3), 5, 2) == [2, 3]


# -- balance_by_layers ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_layers, num_stages, expected",
    [(10, 4, [3, 3, 2, 2]), (3, 3, [1, 1, 1]), (7, 1, [7]), (8, 2, [4, 4]), (5, 3, [2, 2, 1])],
)
def test_balance_by_layers(num_layers, num_stages, expected):
    assert balance_by_layers(num_layers, num_stages) == expected


def test_balance_by_layers_errors():
    with pytest.raises(PartitionError, match="cannot split 2 layers into 3 stages: every stage needs at least one layer"):
        balance_by_layers(2, 3)
    with pytest.raises(PartitionError, match="the number of stages must be at least 1, got 0"):
        balance_by_layers(3, 0)


# -- balance_by_parameters ------------------------------------------------------------------------
def test_balance_by_parameters_never_leaves_a_stage_without_parameters():
    # Linear, ReLU, ReLU, ReLU, Linear: one Linear per stage, and the counts as even as possible.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.Linear(4, 4))
    balance = balance_by_parameters(model, 2)
    assert balance in ([2, 3], [3, 2])
    assert [sum(p.numel() for p in partition(model, r, 2, balance=balance).parameters()) for r in range(2)] == [20, 20]
    # Here the even split of layer counts, [3, 3], would leave stage 1 with ReLUs only.
    skewed = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.ReLU(), nn.ReLU())
    assert balance_by_parameters(skewed, 2) == [2, 4]
    front = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(), nn.ReLU(), nn.ReLU(), nn.ReLU())
    assert balance_by_parameters(front, 2) == [1, 5]
    # Three stages and three Linears spread out: each stage gets exactly one.
    spread = _model_of_weights([5, 0, 0, 0, 0, 0, 5, 0, 5])
    balance = balance_by_parameters(spread, 3)
    assert [load > 0 for load in _loads([5, 0, 0, 0, 0, 0, 5, 0, 5], balance)] == [True] * 3


def test_balance_by_parameters_without_enough_parameterised_layers_still_splits():
    assert sum(balance_by_parameters(nn.Sequential(*[nn.ReLU() for _ in range(5)]), 2)) == 5
    assert balance_by_parameters(nn.Sequential(nn.ReLU(), nn.ReLU(), nn.Linear(4, 4)), 3) == [1, 1, 1]


def test_balance_by_parameters_errors():
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4 stages"):
        balance_by_parameters(nn.Sequential(nn.ReLU(), nn.ReLU(), nn.ReLU()), 4)
    with pytest.raises(PartitionError, match="the number of stages must be at least 1, got 0"):
        balance_by_parameters(nn.Sequential(nn.ReLU()), 0)


def _compositions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [b - a for a, b in zip((0,) + cuts, cuts + (n,))]


def test_balance_by_parameters_minimises_the_largest_stage_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        weights = [rng.choice([0, 0, 1, 2, 3, 5, 8]) for _ in range(n)]
        balance = balance_by_parameters(_model_of_weights(weights), k)
        assert len(balance) == k and sum(balance) == n and min(balance) >= 1, (weights, k, balance)
        required = sum(1 for w in weights if w) >= k
        feasible = [b for b in _compositions(n, k) if not required or min(_loads(weights, b)) > 0]
        best = min(max(_loads(weights, b)) for b in feasible)
        loads = _loads(weights, balance)
        assert max(loads) == best, (weights, k, balance)
        if required:
            assert min(loads) > 0, (weights, k, balance)


def test_balance_by_parameters_ties_go_to_the_most_even_split():
    # Both [3, 1, 2, 2] and [2, 2, 2, 2] have a largest stage of 5 parameters.
    weights = [0, 1, 2, 3, 1, 3, 2, 3]
    assert max(_loads(weights, [2, 2, 2, 2])) == 5
    assert balance_by_parameters(_model_of_weights(weights), 4) == [2, 2, 2, 2]


# -- SequentialModel ------------------------------------------------------------------------------
class _AddIndex(nn.Module):
    def forward(self, x, index):
        return x + index.to(x.dtype).unsqueeze(1), index


class _Concat(nn.Module):
    def forward(self, x, index):
        return torch.cat([x, index.to(x.dtype).unsqueeze(1)], dim=1)


class _Fork(nn.Module):
    def forward(self, x):
        return x, x.sum(1).long()


def test_sequential_model_passes_several_values():
    model = SequentialModel(_AddIndex(), _AddIndex())
    x, index = model(torch.zeros(2, 3), torch.tensor([1, 2]))
    torch.testing.assert_close(x, torch.tensor([[2.0, 2.0, 2.0], [4.0, 4.0, 4.0]]))
    assert index.tolist() == [1, 2]


def test_sequential_model_single_output_is_one_argument_and_is_returned_bare():
    model = SequentialModel(_Fork(), _Concat(), nn.Linear(4, 1, bias=False))
    nn.init.ones_(model[2].weight)
    out = model(torch.ones(2, 3))
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, torch.full((2, 1), 6.0))


def test_sequential_model_list_output_is_a_single_value():
    class MakeList(nn.Module):
        def forward(self, x):
            return [x, x]

    class Count(nn.Module):
        def forward(self, values):
            return torch.tensor(len(values))

    assert SequentialModel(MakeList(), Count())(torch.zeros(1)).item() == 2


def test_sequential_model_stages_chain_like_the_whole_model():
    model = SequentialModel(_Fork(), _AddIndex(), _AddIndex(), _Concat())
    x = torch.arange(6.0).view(2, 3)
    values = (x,)
    for r in range(2):
        out = partition(model, r, 2, balance=[2, 2])(*values)
        values = out if isinstance(out, tuple) else (out,)
    torch.testing.assert_close(values[0], model(x))
