"""Failing together: an error on one rank stops every rank of the pipeline, quickly and legibly.

Every case runs on a fresh process group, because a failed step leaves messages in flight on the
group it used; one launch per world size then runs all cases, the healthy step last.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe import (
    ConfigurationError,
    GPipe,
    Interleaved1F1B,
    PipeDream,
    PipelineAbortedError,
    PipelineStepError,
    ZeroBubbleV,
    partition,
)
from tests import distributed

PIPELINES = {"gpipe": GPipe, "1f1b": PipeDream}
FAILING_STEP = 2
HANG_BOUND_S = 60.0


class FailAtStep(nn.Module):
    """Identity that raises ``ValueError("boom at step 2")`` on the forward of one microbatch of step 2."""

    def __init__(self, num_microbatches: int, microbatch_index: int) -> None:
        super().__init__()
        self.fail_on_call = FAILING_STEP * num_microbatches + microbatch_index
        self.calls = 0

    def forward(self, x):
        call, self.calls = self.calls, self.calls + 1
        if call == self.fail_on_call:
            raise ValueError(f"boom at step {FAILING_STEP}")
        return x


class TwoOutputs(nn.Module):
    def forward(self, x):
        return x, x * 2


def _model(world: int, num_microbatches: int, microbatch_index: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for s in range(world):
        layers.append(nn.Linear(4, 4))
        if s == 1:
            layers.append(FailAtStep(num_microbatches, microbatch_index))
    return nn.Sequential(*layers)


def _balance(world: int) -> list:
    return [2 if s == 1 else 1 for s in range(world)]


def _outcome(fn):
    """``(exception type name, message, seconds)`` of ``fn()``; type ``"ok"`` if it returned."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # the test asserts on the type in the parent process
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _step(pipe, x, y, steps):
    for _ in range(steps):
        pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))


def _layer_fails(rank, world, schedule, num_microbatches, microbatch_index):
    group = dist.new_group(list(range(world)))
    stage = partition(_model(world, num_microbatches, microbatch_index), rank, world, balance=_balance(world))
    pipe = PIPELINES[schedule](stage, chunks=num_microbatches, process_group=group, timeout=timedelta(seconds=HANG_BOUND_S))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    return _outcome(lambda: _step(pipe, x, y, FAILING_STEP + 1))


def _zero_chunks(rank, world, schedule):
    return _outcome(lambda: PIPELINES[schedule](nn.Sequential(nn.Linear(4, 4)), chunks=0))


def _arity_mismatch(rank, world, schedule):
    """Stage 0 returns two tensors into stage 1, a plain nn.Sequential that takes one."""
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = nn.Sequential(*([nn.Linear(4, 4), TwoOutputs()] + [nn.Linear(4, 4) for _ in range(world - 1)]))
    stage = partition(model, rank, world, balance=[2] + [1] * (world - 1))
    pipe = PIPELINES[schedule](stage, chunks=2, process_group=group, timeout=timedelta(seconds=HANG_BOUND_S))
    return _outcome(lambda: _step(pipe, torch.randn(4, 4), torch.randn(4, 4), 1))


def _uneven(rank, world, case):
    """Review RR: ranks given arguments or parts that do not make one pipeline. Each case gets a fresh group."""
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4 * world)])
    timeout = timedelta(seconds=HANG_BOUND_S)

    def build():
        if case == "balance":  # rank 0 cuts [4, 4, ...], the others [3, 4, ..., 5]: layers run twice or not at all
            balance = [4] * world if rank == 0 else [3] + [4] * (world - 2) + [5]
            return PipeDream(partition(model, rank, world, balance=balance), chunks=2, process_group=group)
        if case == "nranks":  # partition(model, rank, world + 1): the last part is never run
            return PipeDream(partition(model, rank, world + 1), chunks=2, process_group=group)
        if case == "same_part":  # every rank given part 0
            return PipeDream(partition(model, 0, world), chunks=2, process_group=group)
        if case == "placement":  # ZB-V given the loop placement's parts
            return ZeroBubbleV(partition(model, rank, world, num_model_chunks=2), chunks=2 * world,
                               process_group=group, timeout=timeout)
        if case == "chunks":  # the step's header would not pair (a gloo rank aborted)
            return PipeDream(partition(model, rank, world), chunks=2 + rank, process_group=group)
        if case == "virtual":  # a hang: the ranks built other stage tables
            v = 2 if rank == 0 else 4
            return Interleaved1F1B(partition(model, rank, world, num_model_chunks=v), chunks=2 * world,
                                   process_group=group)
        if case == "bad_arg_one_rank":
            return PipeDream(partition(model, rank, world), chunks=0 if rank == world - 1 else 2, process_group=group)
        pipe = PipeDream(partition(model, rank, world), chunks=2, process_group=group, timeout=timeout)
        pipe.forward_backward(torch.randn(8, 4), criterion=nn.functional.mse_loss, labels=(torch.randn(6, 4),))

    return _outcome(build)


UNEVEN = {  # case -> what every rank is told (the rank given a bad argument: its own error)
    "balance": "were given parts of different splits of the model",
    "nranks": "pipeline rank 0 was given part 0 of a model cut into",  # world + 1 parts
    "same_part": "pipeline rank 1 was given part 0 of a model cut into",
    "placement": "placement='loop')) as its stage",
    "chunks": "were given different chunks: [2, 3",
    "virtual": "were given different virtual_stages: [2, 4",
    "bad_arg_one_rank": "refused its arguments: chunks (the number of microbatches) must be a positive integer, got 0",
}


def _healthy(rank, world):
    """After all the failures, a fresh pipeline in the same processes still trains."""
    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(world)])
    reference = nn.Sequential(*[nn.Linear(4, 4) for _ in range(world)])
    reference.load_state_dict(model.state_dict())
    stage = partition(model, rank, world, balance=[1] * world)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    loss, _ = GPipe(stage, chunks=3, process_group=group).forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
    expected = nn.functional.mse_loss(reference(x), y)
    if rank == world - 1:
        torch.testing.assert_close(loss, expected.detach())
    expected.backward()
    torch.testing.assert_close(stage[0].weight.grad, reference[rank].weight.grad)
    return "ok"


def _all_cases(rank, world, failure_cases):
    results = {}
    for case in failure_cases:
        results[("layer",) + case] = _layer_fails(rank, world, *case)
    for schedule in PIPELINES:
        results[("zero_chunks", schedule)] = _zero_chunks(rank, world, schedule)
        results[("arity", schedule)] = _arity_mismatch(rank, world, schedule)
    for case in [*UNEVEN, "labels"]:
        results[("uneven", case)] = _uneven(rank, world, case)
    results[("healthy",)] = _healthy(rank, world)
    return results


FAILURE_CASES = [
    # (schedule, num_microbatches, microbatch_index that fails at step 2)
    ("gpipe", 1, 0),  # the 3rd forward call of the layer
    ("1f1b", 1, 0),
    ("gpipe", 4, 1),  # mid-step, other microbatches in flight
    ("1f1b", 4, 1),
    ("1f1b", 4, 3),
]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"p{p}")
def outcomes(request):
    world = request.param
    start = time.monotonic()
    results = distributed.run(_all_cases, world, FAILURE_CASES, timeout=HANG_BOUND_S + 30)
    elapsed = time.monotonic() - start
    return world, results, elapsed


def test_launch_finishes_within_the_hang_bound(outcomes):
    world, _, elapsed = outcomes
    assert elapsed < HANG_BOUND_S, f"{world} ranks took {elapsed:.1f} s for every failure case"


@pytest.mark.parametrize("case", FAILURE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_layer_error_stops_every_rank(outcomes, case):
    world, results, _ = outcomes
    _, num_microbatches, microbatch_index = case
    for rank in range(world):
        kind, message, seconds = results[rank][("layer",) + case]
        assert seconds < HANG_BOUND_S / 2, (rank, seconds)
        if rank == 1:
            assert kind == "PipelineStepError", (rank, kind, message)
            assert message.startswith(f"[pp_rank 1 | step 2 | 1F{microbatch_index}] ValueError: boom at step 2"), message
        else:
            assert kind == "PipelineAbortedError", (rank, kind, message)
            assert "because another rank failed: [pp_rank 1 | step 2 |" in message, message
            assert "boom" in message and "pp_rank 1" in message, message


@pytest.mark.parametrize("schedule", sorted(PIPELINES))
def test_zero_chunks_fails_on_every_rank_before_communication(outcomes, schedule):
    world, results, _ = outcomes
    for rank in range(world):
        kind, message, seconds = results[rank][("zero_chunks", schedule)]
        assert kind == "ConfigurationError", (rank, kind, message)
        assert seconds < 1.0, (rank, seconds)  # raised in the constructor, nothing awaited
        assert message == "chunks (the number of microbatches) must be a positive integer, got 0"


@pytest.mark.parametrize("schedule", sorted(PIPELINES))
def test_stage_arity_mismatch_fails_on_every_rank(outcomes, schedule):
    world, results, _ = outcomes
    expected = ("stage 1 is an nn.Sequential, which takes one input, but it got 2 values; "
                "use lightning_pipe.SequentialModel for layers that pass several values")
    for rank in range(world):
        kind, message, seconds = results[rank][("arity", schedule)]
        assert seconds < HANG_BOUND_S / 2, (rank, seconds)
        if rank == 1:
            assert kind == "PipelineStepError", (rank, kind, message)
            assert message == f"[pp_rank 1 | step 0 | 1F0] PipelineStepError: {expected}"
        else:
            assert kind == "PipelineAbortedError", (rank, kind, message)
            assert expected in message and "pp_rank 1" in message, message


@pytest.mark.parametrize("case", sorted(UNEVEN))
def test_ranks_given_arguments_or_parts_that_make_no_one_pipeline_fail_together_at_construction(outcomes, case):
    """Regression (review RR): these trained a model with layers missing or twice without a word (balance, nranks,
    same_part, placement), aborted a gloo rank (chunks), hung (virtual), or named the bad argument on its rank only
    while the others got gloo's "Connection reset by peer" (bad_arg_one_rank)."""
    world, results, _ = outcomes
    for rank in range(world):
        kind, message, seconds = results[rank][("uneven", case)]
        assert seconds < HANG_BOUND_S / 2, (rank, seconds)
        assert kind in ("ConfigurationError", "PartitionError"), (rank, kind, message)
        if case == "nranks":
            assert f"cut into {world + 1} (partition(..., placement='loop')) as its stage 0 of {world}" in message
        if case == "bad_arg_one_rank" and rank == world - 1:
            assert message == "chunks (the number of microbatches) must be a positive integer, got 0"
        else:
            assert UNEVEN[case] in message, (rank, message)


def test_labels_of_another_batch_size_stop_every_rank_quickly(outcomes):
    """Regression (review RR): the last stage refused them before its first action, and rank 0 waited out the
    whole timeout for its messages."""
    world, results, _ = outcomes
    for rank in range(world):
        kind, message, seconds = results[rank][("uneven", "labels")]
        assert seconds < 10, (rank, seconds)
        assert "labels split into microbatches of sizes [3, 3] but the inputs into [4, 4]" in message, (rank, message)
        assert kind == ("ConfigurationError" if rank == world - 1 else "PipelineAbortedError"), (rank, kind)


def test_processes_still_train_after_the_failures(outcomes):
    world, results, _ = outcomes
    assert [r[("healthy",)] for r in results] == ["ok"] * world


def test_error_classes_derive_from_the_builtins():
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(PipelineStepError, RuntimeError)
    assert issubclass(PipelineAbortedError, RuntimeError)
