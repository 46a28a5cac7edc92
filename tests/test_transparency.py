"""The pipelined model against the same model in one process: loss, every gradient, weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipe import GPipe, PipeDream, partition
from tests import distributed
from tests.models import mlp, multi_io

SCHEDULES = {"gpipe": GPipe, "1f1b": PipeDream}


def _compare(rank, world, build, schedule, chunks, batch, steps, checkpoint, balance):
    full = build()
    reference = copy.deepcopy(full)
    stage = partition(full, rank, world, balance=balance)
    pipe = SCHEDULES[schedule](stage, chunks=chunks, checkpoint=checkpoint)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    criterion = nn.functional.mse_loss
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(batch, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(batch, 6 if isinstance(full[-1], nn.Module) and not hasattr(full[-1], "out") else 3,
                        generator=gen, dtype=torch.float64)
        ref_out = reference(x)
        y = y[:, : ref_out.shape[1]]
        ref_loss = criterion(ref_out, y)
        ref_opt.zero_grad()
        ref_loss.backward()
        opt.zero_grad()
        loss, outputs = pipe.forward_backward(x, criterion=criterion, labels=(y,), return_outputs=True)
        if rank == world - 1:
            torch.testing.assert_close(loss, ref_loss.detach())
            torch.testing.assert_close(outputs, ref_out.detach())
        else:
            assert loss is None and outputs is None
        ref_params = dict(reference.named_parameters())
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"grad of {name} at step {step}: {m}")
        opt.step()
        ref_opt.step()
    ref_state = reference.state_dict()
    for name, value in stage.state_dict().items():
        torch.testing.assert_close(value, ref_state[name])
    return sorted(stage.state_dict())


def _grid(rank, world, cases):
    for case in cases:
        _compare(rank, world, *case)
    return len(cases)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_mlp_matches_single_process(num_stages):
    cases = []
    for schedule in SCHEDULES:
        for chunks in (1, 2, 3, 8):
            cases.append((mlp, schedule, chunks, 8, 3, "never", None))
        cases.append((mlp, schedule, 4, 10, 2, "never", None))  # uneven: 3, 3, 2, 2
        cases.append((mlp, schedule, 8, 3, 2, "never", None))  # batch < chunks: one sample each
    distributed.run(_grid, num_stages, cases, timeout=240)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_multi_input_output_stages_with_int_tensor(num_stages):
    balance = {2: [2, 3], 3: [2, 2, 1]}[num_stages]
    cases = [(multi_io, s, c, 7, 2, "never", balance) for s in SCHEDULES for c in (1, 3)]
    distributed.run(_grid, num_stages, cases, timeout=120)


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6).double()

    def forward(self, mask, x):
        return self.linear(x) * mask.sum()


def _no_chunk_first(rank, world):
    from lightning_pipe import NoChunk, SequentialModel

    torch.manual_seed(0)
    full = SequentialModel(_Masked(), nn.Linear(6, 6).double())
    reference = copy.deepcopy(full)
    pipe = GPipe(partition(full, rank, world), chunks=2)
    x, y, mask = (torch.randn(6, 6, dtype=torch.float64) for _ in range(3))
    mask = mask[0, :5]  # 5 values, not the batch size: the microbatch sizes must come from x
    loss, _ = pipe.forward_backward(NoChunk(mask), x, criterion=nn.functional.mse_loss, labels=(y,))
    ref_loss = nn.functional.mse_loss(reference(mask, x), y)
    ref_loss.backward()
    if rank == world - 1:
        torch.testing.assert_close(loss, ref_loss.detach())
    ref_params = dict(reference.named_parameters())
    for name, p in full.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref_params[name].grad)
    return True


def test_a_leading_no_chunk_tensor_does_not_set_the_microbatch_sizes():
    """Regression: the sizes sent in the step header were read from the first tensor of each
    microbatch, which is a NoChunk tensor here (5 values), so the labels check failed."""
    distributed.run(_no_chunk_first, 2, timeout=120)


class _HalvesItsInput(nn.Module):
    """Writes into its input, as preprocessing written in place does (``x.sub_(mean).div_(std)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6).double()

    def forward(self, x):
        return self.linear(x.mul_(0.5))


def _doubled_target_loss(output, target):
    return nn.functional.mse_loss(output, target.mul_(2))  # writes into its labels


def _writes_into_inputs(rank, world, schedule):
    torch.manual_seed(0)
    full = nn.Sequential(_HalvesItsInput(), nn.Tanh(), nn.Linear(6, 6).double())
    reference = copy.deepcopy(full)
    pipe = SCHEDULES[schedule](partition(full, rank, world), chunks=4)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    ref_x, ref_y = x.clone(), y.clone()  # the reference writes into its own batch, once
    ref_loss = _doubled_target_loss(reference(ref_x), ref_y)
    ref_loss.backward()
    loss, _ = pipe.forward_backward(x, criterion=_doubled_target_loss, labels=(y,))
    if rank == world - 1:
        torch.testing.assert_close(loss, ref_loss.detach())
        torch.testing.assert_close(y, ref_y)  # each sample's label written once, as in one step
    else:
        torch.testing.assert_close(x, ref_x)
    ref_params = dict(reference.named_parameters())
    for name, p in full.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref_params[name].grad)
    return True


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_stages_that_write_into_their_microbatch_train_as_one_process(schedule):
    """Regression: the microbatches were views of the batch sharing its version counter, so the
    second microbatch's write into its own samples looked to autograd like a write into what the
    first had saved for its backward ("modified by an inplace operation"); one process writes once."""
    distributed.run(_writes_into_inputs, 2, schedule, timeout=120)


def _one_rank_writes_into_inputs_that_are_its_labels(rank, world):
    torch.manual_seed(0)
    full = nn.Sequential(_HalvesItsInput(), nn.Tanh(), nn.Linear(6, 6).double())
    reference = copy.deepcopy(full)
    x = torch.randn(8, 6, dtype=torch.float64)
    ref_x = x.clone()
    ref_loss = nn.functional.mse_loss(reference(ref_x), ref_x)  # the labels are the inputs, written into once
    ref_loss.backward()
    loss, _ = GPipe(full, chunks=4).forward_backward(x, criterion=nn.functional.mse_loss, labels=(x,))
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(x, ref_x)
    ref_params = dict(reference.named_parameters())
    for name, p in full.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad)
    return True


def test_one_rank_given_its_inputs_as_labels_splits_them_once_and_trains_as_one_process():
    """Regression: a rank holding the first and the last stage (one stage; ZB-V's rank 0) is given the batch as
    inputs and as labels (PipeStrategy always does so), split apart into views sharing the batch's counter, so
    a write into the microbatches stopped GPipe's step again. The tensor is now split once for both."""
    distributed.run(_one_rank_writes_into_inputs_that_are_its_labels, 1, timeout=60)


def _writes_into_labels_that_are_the_inputs(rank, world):
    torch.manual_seed(0)
    pipe = GPipe(nn.Sequential(nn.Linear(6, 6).double()), chunks=2)
    x = torch.randn(4, 6, dtype=torch.float64)
    pipe.forward_backward(x, criterion=_doubled_target_loss, labels=(x,))  # the Linear saved x for its backward


def test_labels_that_share_the_inputs_memory_on_one_rank_see_its_writes_as_one_process_does():
    """Inputs and labels are split apart; one process holding both ends, given the same tensor as both, splits
    it into views that see each other's writes: a write into the labels after the first layer saved the inputs
    stops the step as it stops one process, instead of computing a gradient from the written inputs."""
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _doubled_target_loss(nn.Linear(6, 6).double()(x), x).backward()  # one process
    (outcome,) = distributed.run(_writes_into_labels_that_are_the_inputs, 1, timeout=60, expect_errors=True)
    assert outcome[0] == "error" and "modified by an inplace operation" in outcome[1][1], outcome
