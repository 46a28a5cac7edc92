"""make_subgroups and data x pipeline parallelism with the plain API."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe import ConfigurationError, PipeDream, make_subgroups, partition
from tests import distributed
from tests.models import mlp


def _dp_pp(rank, world, use_group):
    group = dist.new_group(list(range(world))) if use_group else None
    dp_group, pp_group = make_subgroups(2, group=group)
    assert dist.get_process_group_ranks(pp_group) == [rank % 2, rank % 2 + 2]  # pp outermost
    assert dist.get_process_group_ranks(dp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    full = mlp()
    reference = copy.deepcopy(full)
    stage = partition(full, dist.get_rank(pp_group), 2)
    pipe = PipeDream(stage, chunks=2, process_group=pp_group)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        replica = rank % 2  # each replica gets half of the batch
        opt.zero_grad()
        pipe.forward_backward(x[replica * 4:(replica + 1) * 4], criterion=nn.functional.mse_loss,
                              labels=(y[replica * 4:(replica + 1) * 4],))
        for p in stage.parameters():
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= 2
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    expected = reference.state_dict()
    for name, value in stage.state_dict().items():
        torch.testing.assert_close(value, expected[name])
    return True


def _all_cases(rank, world):
    with pytest.raises(ConfigurationError, match=r"pp_size \* dp_size == the group's 4 ranks"):
        make_subgroups(3)
    return _dp_pp(rank, world, use_group=False) and _dp_pp(rank, world, use_group=True)


def test_dp_x_pp_with_make_subgroups_equals_one_process():
    """On the world (a DeviceMesh) and on a sub-group; a bad size is named before any group is made."""
    distributed.run(_all_cases, 4, timeout=180)
