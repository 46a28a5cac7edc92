"""The plain API with tied weights, random draws and summed losses, against one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipe import GPipe, PipeDream, partition, rng
from lightning_pipe.partition import split_points
from tests import distributed

SCHEDULES = {"gpipe": GPipe, "1f1b": PipeDream}


def tied_lm(vocab: int = 7, width: int = 6, depth: int = 4) -> nn.Sequential:
    """Sequential(embedding, blocks..., head) with head.weight = embedding.weight: the tie spans the pipeline."""
    torch.manual_seed(0)
    head = nn.Linear(width, vocab, bias=False)
    layers = [nn.Embedding(vocab, width)] + [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
    model = nn.Sequential(*layers, head).double()
    model[-1].weight = model[0].weight
    return model


def _tied(rank, world, schedule):
    full = tied_lm()
    reference = copy.deepcopy(full)
    stage = partition(full, rank, world)
    pipe = SCHEDULES[schedule](stage, chunks=3)
    opt = torch.optim.SGD(stage.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)

    def criterion(logits, targets):
        return nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))

    for step in range(3):
        tokens = torch.randint(0, 7, (6, 5), generator=gen)
        targets = torch.randint(0, 7, (6, 5), generator=gen)
        ref_loss = criterion(reference(tokens), targets)
        ref_opt.zero_grad()
        ref_loss.backward()
        opt.zero_grad()
        loss, _ = pipe.forward_backward(tokens, criterion=criterion, labels=(targets,))
        if rank == world - 1:
            torch.testing.assert_close(loss, ref_loss.detach())
        ref_params = dict(reference.named_parameters(remove_duplicate=False))
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"grad of {name}, step {step}: {m}")
        opt.step()
        ref_opt.step()
    ref_state = reference.state_dict()
    for name, value in stage.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], msg=lambda m: f"{name}: {m}")
    return [n for n, _ in stage.named_parameters()]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_weight_tied_across_the_first_and_last_stage_trains_as_one_process(schedule):
    """Regression: each stage stepped its own copy with its own part of the gradient; they drifted apart."""
    names = distributed.run(_tied, 3, schedule, timeout=120)
    assert "0.weight" in names[0] and "5.weight" in names[2]


class NoisyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x):
        return self.dropout(torch.tanh(self.linear(x)))


def noisy_mlp(depth: int = 4, width: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[NoisyBlock(width) for _ in range(depth)]).double()


def _emulate_step(model, balance, step_seed, x, y, chunks):
    """The documented draws, in one process: stage s's forward of microbatch i starts at derive(seed, i, s)."""
    loss = 0.0
    for i, (xi, yi) in enumerate(zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks))):
        h = xi
        for s, (start, stop) in enumerate(split_points(balance)):
            rng.seed_torch(rng.derive(step_seed, i, s), torch.device("cpu"))
            for layer in model[start:stop]:
                h = layer(h)
        loss = loss + nn.functional.mse_loss(h, yi) * (xi.shape[0] / x.shape[0])
    return loss


def _dropout(rank, world, schedule, checkpoint):
    full = noisy_mlp()
    reference = copy.deepcopy(full)
    stage = partition(full, rank, world, balance=[4 // world + (s < 4 % world) for s in range(world)])
    balance = [4 // world + (s < 4 % world) for s in range(world)]
    pipe = SCHEDULES[schedule](stage, chunks=3, checkpoint=checkpoint)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(123 + rank)  # ranks start out of step: the pipeline must not depend on it
    states = []
    for _ in range(2):
        x = torch.randn(7, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(7, 6, generator=gen, dtype=torch.float64)
        for p in list(stage.parameters()) + list(reference.parameters()):
            p.grad = None
        loss, _ = pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
        ref_loss = _emulate_step(reference, balance, pipe.step_seed, x, y, 3)
        ref_loss.backward()
        if rank == world - 1:
            torch.testing.assert_close(loss, ref_loss.detach())
        ref_params = dict(reference.named_parameters())
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"grad of {name}: {m}")
        states.append(bytes(torch.get_rng_state().numpy()))
    return states


@pytest.mark.parametrize("schedule, checkpoint", [("gpipe", "always"), ("1f1b", "never"), ("1f1b", "except_last")])
def test_dropout_draws_depend_on_the_step_seed_microbatch_and_stage_only(schedule, checkpoint):
    """Dropout in the body draws from derive(step seed, microbatch, stage): the run equals the same
    microbatches run in one process with those seeds, whatever the schedule and checkpointing, and
    every rank ends each step in the same random state although they started in different ones."""
    states = distributed.run(_dropout, 2, schedule, checkpoint, timeout=120)
    for a, b in zip(*states):
        assert a == b


def _summed(rank, world, schedule):
    full = noisy_mlp()
    for block in full:
        block.dropout.p = 0.0
    reference = copy.deepcopy(full)
    stage = partition(full, rank, world)
    pipe = SCHEDULES[schedule](stage, chunks=3)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    mask = torch.rand(8, 6) > 0.5  # a different number of counted items per microbatch

    def masked_sum(out, target, m):
        return ((out - target) ** 2 * m).sum()

    ref_loss = masked_sum(reference(x), y, mask) / mask.sum()
    ref_loss.backward()
    loss, _ = pipe.forward_backward(x, criterion=masked_sum, labels=(y, mask), loss_reduction="sum",
                                    loss_scale=1.0 / mask.sum().item())
    if rank == world - 1:
        torch.testing.assert_close(loss / mask.sum(), ref_loss.detach())
    ref_params = dict(reference.named_parameters())
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"grad of {name}: {m}")
    return True


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_loss_averaged_over_masked_items_is_exact_as_a_scaled_sum(schedule):
    distributed.run(_summed, 2, schedule, timeout=120)


def test_loss_reduction_is_checked():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pipe = GPipe(noisy_mlp(), chunks=2)
        with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum', got 'avg'"):
            pipe.forward_backward(torch.zeros(2, 6, dtype=torch.float64), loss_reduction="avg")
    finally:
        dist.destroy_process_group()
