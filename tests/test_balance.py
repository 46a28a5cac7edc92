"""Balance by measured time, memory and counted FLOPs, against the parameter balance."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.errors import PartitionError
from lightning_pipe.partition import (
    balance_by_cost,
    balance_by_flops,
    balance_by_memory,
    balance_by_parameters,
    balance_by_time,
    layer_flops,
    layer_times,
    stage_costs,
)
from lightning_pipe.schedule import lower, one_f_one_b, simulate


class TokenMix(nn.Module):
    """Attention-like mixing of a sequence with itself: heavy compute, one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.1))

    def forward(self, x):
        scores = torch.softmax(torch.bmm(x, x.transpose(1, 2)) * self.scale, dim=-1)
        return torch.bmm(scores, x)


# width d, sequence n, batch b. A Linear costs 6·b·n·d² FLOPs forward + backward, a TokenMix
# 12·b·n²·d: 2n/d = 64 times more. Stage costs for the splits (L a Linear, T a TokenMix):
#   [3, 7]: max(3L, 3L + 4T) = 259 L;  [7, 3]: max(6L + T, 3T) = 192 L;
#   [8, 2]: max(6L + 2T, 2T) = 134 L;  [9, 1]: 6L + 3T = 198 L.
# [8, 2] wins whenever T > 6L, for FLOPs, which count every TokenMix the same. Measured times of identical
# TokenMix blocks differ by up to 2x here, and [7, 3] beats [8, 2] when T₃ + T₄ < 6L + T₁, so measured
# time is tested on 6 Linear + 2 TokenMix: [7, 1] = max(6L + T₁, T₂) beats [6, 2] = T₁ + T₂ exactly when
# T₂ > 6L, which no difference between the two TokenMix blocks can flip.
D, N, B = 32, 1024, 2


def unbalanced_body(device=None, mixes: int = 4) -> nn.Sequential:
    with torch.device(device or "cpu"):
        return nn.Sequential(*[nn.Linear(D, D) for _ in range(6)], *[TokenMix() for _ in range(mixes)])


def _makespan(per_stage: list, num_microbatches: int = 8) -> float:
    """1F1B's simulated makespan where stage s's forward + backward costs ``per_stage[s]``
    (a third forward, two thirds backward).

    ``simulate`` takes one cost per kind of action for every stage, so each compute action of the
    lowered table is repeated once per unit of its stage's cost, in units of 1/600 of the largest.
    """
    unit = max(per_stage) / 600
    tables = lower(one_f_one_b(len(per_stage), num_microbatches))
    repeats = {(kind, s): round(c * share / unit) for s, c in enumerate(per_stage) for kind, share in (("F", 1 / 3), ("B", 2 / 3))}
    expanded = tuple(
        tuple(x for a in row for x in ([a] * repeats[(a.kind, a.stage_index)] if a.is_compute else [a]))
        for row in tables
    )
    return simulate(expanded, 1.0, 1.0).makespan * unit


def test_the_parameter_balance_of_the_unbalanced_body_is_3_7():
    assert balance_by_parameters(unbalanced_body(), 2) == [3, 7]


@pytest.fixture
def one_thread():
    """One intra-op thread: steadier times on a small shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_time_balance_picks_7_1_and_beats_the_parameter_balance_in_simulated_makespan(one_thread):
    # regression: on 6 Linear + 4 TokenMix, a full-suite run measured [7, 3] (with repeat=1, 5 and 9): the
    # split turned on the differences between identical TokenMix blocks (see the note above unbalanced_body)
    body, sample = unbalanced_body(mixes=2), torch.randn(B, N, D)
    assert balance_by_parameters(body, 2) == [3, 5]
    times = layer_times(body, sample)
    assert balance_by_cost(times, 2) == balance_by_time(body, sample, 2) == [7, 1], times
    by_time = _makespan(stage_costs(times, [7, 1]))
    by_parameters = _makespan(stage_costs(times, [3, 5]))
    assert by_time < 0.8 * by_parameters, (by_time, by_parameters)


def test_flops_balance_picks_8_2_on_the_meta_device_and_materializes_nothing():
    body = unbalanced_body("meta")
    flops = layer_flops(body, torch.empty(B, N, D, device="meta"))
    linear, mix = 6 * B * N * D * D, 12 * B * N * N * D
    assert flops == [linear] * 6 + [mix] * 4
    assert balance_by_flops(body, torch.empty(B, N, D, device="meta"), 2) == [8, 2]
    assert all(t.is_meta and t.grad is None for t in list(body.parameters()) + list(body.buffers()))
    assert _makespan(stage_costs(flops, [8, 2])) < 0.7 * _makespan(stage_costs(flops, [3, 7]))


def test_flops_of_a_real_model_leave_it_untouched():
    body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    before = {k: v.clone() for k, v in body.state_dict().items()}
    assert balance_by_flops(body, torch.randn(3, 4), 2) == [1, 1]  # a real sample goes to meta too
    assert all(torch.equal(v, before[k]) for k, v in body.state_dict().items())
    assert all(p.grad is None for p in body.parameters())


def test_memory_balance_counts_activations_and_parameters():
    # activations: TokenMix saves its (n, n) attention twice; Linear only its input
    assert balance_by_memory(unbalanced_body(), torch.randn(B, N, D), 2) == [8, 2]
    # parameters: one wide layer outweighs three narrow ones
    body = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 200))
    assert balance_by_memory(body, torch.randn(1, 2), 2) == [3, 1]


def test_measuring_restores_buffers_rng_and_grads():
    body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    state = {k: v.clone() for k, v in body.state_dict().items()}
    sample = torch.randn(8, 4)
    rng = torch.get_rng_state()
    balance_by_time(body, sample, 2, repeat=2)
    balance_by_memory(body, sample, 2)
    assert all(torch.equal(v, state[k]) for k, v in body.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in body.parameters())


def test_balance_by_cost_minimises_the_largest_stage_then_evens_layer_counts():
    assert balance_by_cost([1, 1, 1, 1, 6, 2], 2) == [4, 2]
    assert balance_by_cost([0, 0, 0, 0], 2) == [2, 2]
    assert balance_by_cost([5, 0, 0, 0, 5], 2) in ([2, 3], [3, 2])
    assert stage_costs([1, 2, 3, 4], [1, 3]) == [1, 9]
    with pytest.raises(PartitionError, match="cannot split 2 layers into 3 stages"):
        balance_by_cost([1, 1], 3)
    with pytest.raises(PartitionError, match="repeat must be a positive integer"):
        layer_times(nn.Sequential(nn.ReLU()), torch.ones(1), repeat=0)


def test_measuring_the_bodys_input_leaves_the_state_of_the_code_before_it_as_it_was():
    """Regression (review T): balance="time"/"memory"/"flops" ran the training step up to the body once on global
    rank 0 in train mode, which moved a BatchNorm's running statistics before the body (running_mean 0.015 and
    num_batches_tracked 1 from the balance=[2, 2] run's after 6 steps) and updated metrics there."""
    from torchmetrics.aggregation import CatMetric, SumMetric

    from lightning_pipe.lightning.profile import layer_costs

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(4, momentum=None)
            self.seen, self.values = SumMetric(), CatMetric()  # CatMetric's state is a list, grown in place
            self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

        def training_step(self, batch, batch_idx):
            h = self.norm(batch)
            self.seen.update(h.abs().sum())
            self.values.update(h[:, 0])
            return self.body(h).sum()

    model = Model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    costs = layer_costs("flops", model, "body", model.body, torch.randn(8, 4) * 3 + 1)
    assert len(costs) == 3 and isinstance(model.body, nn.Sequential)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], msg=key)
    assert model.seen._update_count == 0 and float(model.seen.sum_value) == 0.0
    assert model.values.value == []  # review U: the list was put back as the same, grown list
