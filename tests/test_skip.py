"""Skip connections, checkpoint modes and deferred BatchNorm against the same model in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_pipe import GPipe, PipeDream, is_checkpointing, is_recomputing, partition
from lightning_pipe.batchnorm import DeferredBatchNorm, commit_deferred_batch_norm
from lightning_pipe.skip import Namespace, pop, skippable, stash, verify_skippables
from tests import distributed
from tests.models import resnet, unet

SCHEDULES = {"gpipe": GPipe, "1f1b": PipeDream}
MODES = ("never", "except_last", "always")


def _reference_step(model, x, y, chunks):
    """One step of the plain model on the same microbatches in sequence (BatchNorm sees each one)."""
    parts_x, parts_y = torch.tensor_split(x, min(chunks, len(x))), torch.tensor_split(y, min(chunks, len(x)))
    loss = 0.0
    for px, py in zip(parts_x, parts_y):
        part = nn.functional.mse_loss(model(px), py) * (len(px) / len(x))
        part.backward()
        loss = loss + part.detach()
    return loss


def _compare(rank, world, build, balance, schedule, checkpoint, chunks, deferred):
    full = build()
    reference = copy.deepcopy(full)
    if deferred:  # the same deferred model in one process, microbatches in sequence, committed per step
        reference = DeferredBatchNorm.convert_deferred_batch_norm(reference)
    stage = partition(full, rank, world, balance=balance)
    pipe = SCHEDULES[schedule](stage, chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=deferred)
    opt = torch.optim.SGD(stage.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(10, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(10, 6, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_loss = _reference_step(reference, x, y, chunks)
        commit_deferred_batch_norm(reference)
        loss, _ = pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
        if rank == world - 1:
            torch.testing.assert_close(loss, ref_loss)
        ref_params = dict(reference.named_parameters())
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"{name} step {step}: {m}")
        opt.step()
        ref_opt.step()
    expected = reference.state_dict()
    if "0.bn.num_batches_tracked" in expected:  # deferred: once per step; plain: once per microbatch
        assert expected["0.bn.num_batches_tracked"] == (3 if deferred else 3 * min(chunks, 10))
    for name, value in stage.state_dict().items():
        torch.testing.assert_close(value, expected[name], msg=lambda m: f"{name}: {m}")
    # evaluation uses the running statistics
    stage.eval()
    reference.eval()
    with torch.no_grad():
        out = pipe.forward(torch.ones(4, 6, dtype=torch.float64))
    if rank == world - 1 or isinstance(pipe, GPipe):
        torch.testing.assert_close(out, reference(torch.ones(4, 6, dtype=torch.float64)))


def _grid(rank, world, cases):
    for case in cases:
        _compare(rank, world, *case)
    return len(cases)


UNET_BALANCE = {2: [3, 5], 3: [1, 3, 4], 4: [1, 2, 3, 2]}  # skips cross 1, 2 and 3 boundaries
RESNET_BALANCE = {2: [2, 3], 3: [2, 2, 1], 4: [2, 1, 1, 1]}


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_unet_skips_every_checkpoint_mode_and_schedule(num_stages):
    cases = [(unet, UNET_BALANCE[num_stages], s, c, 3, False) for s in SCHEDULES for c in MODES]
    distributed.run(_grid, num_stages, cases, timeout=240)


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_resnet_deferred_batch_norm(num_stages):
    cases = [(resnet, RESNET_BALANCE[num_stages], s, c, 4, True) for s in SCHEDULES for c in MODES]
    cases.append((resnet, RESNET_BALANCE[num_stages], "gpipe", "never", 4, False))  # plain BN: per microbatch
    distributed.run(_grid, num_stages, cases, timeout=240)


def test_skippable_model_runs_without_a_pipeline():
    model = unet()
    x = torch.randn(5, 6, dtype=torch.float64)
    h = torch.tanh(model[0].module.linear(x))
    h2 = torch.tanh(model[1].module.linear(h))
    h3 = model[2](h2)
    h4 = model[4](h3)
    h5 = h4 * (1 + (h3 > 0).to(h3.dtype))
    expected = torch.tanh(model[7].module.linear(torch.tanh(model[6].module.linear(h5)) + h2)) + h
    torch.testing.assert_close(model(x), expected)


def test_verify_skippables_lists_every_mismatch():
    @skippable(stash=["a"])
    class StashA(nn.Module):
        def forward(self, x):
            yield stash("a", x)
            return x

    @skippable(pop=["a"])
    class PopA(nn.Module):
        def forward(self, x):
            a = yield pop("a")
            return x + a

    @skippable(pop=["b"])
    class PopB(nn.Module):
        def forward(self, x):
            b = yield pop("b")
            return x + b

    verify_skippables(nn.Sequential(StashA(), PopA()))
    ns = Namespace()
    verify_skippables(nn.Sequential(StashA(), StashA().isolate(ns), PopA().isolate(ns), PopA()))
    with pytest.raises(TypeError) as info:
        verify_skippables(nn.Sequential(StashA(), StashA(), PopA(), PopA(), PopB(), StashA().isolate(ns)))
    message = str(info.value)
    assert "layer '1' stashes 'a' again (layer '0' stashes it first)" in message
    assert "layer '3' pops 'a' again (layer '2' pops it first)" in message
    assert "layer '4' pops 'b', which no earlier layer stashes" in message
    assert f"layer '5' stashes 'a' (namespace {ns.id}), which no later layer pops" in message
    assert message.count("  - ") == 4


def test_is_checkpointing_and_is_recomputing_tell_the_passes_apart():
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append((is_checkpointing(), is_recomputing()))
            return x * x  # saves x for backward, so backward recomputes

    from lightning_pipe.checkpoint import checkpointed

    x = torch.ones(2, requires_grad=True)
    checkpointed(Spy(), x).sum().backward()
    assert seen == [(True, False), (False, True)]
    assert (is_checkpointing(), is_recomputing()) == (False, False)


@pytest.mark.parametrize("shape, momentum", [((12, 3), 0.1), ((12, 3, 4, 5), None)])
def test_deferred_batch_norm_equals_one_forward_of_the_whole_batch(shape, momentum):
    """Microbatches through a checkpointed DeferredBatchNorm, committed once: plain BN on the batch."""
    from lightning_pipe.checkpoint import checkpointed

    plain = (nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d)(3, momentum=momentum).double()
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain))
    for _ in range(2):
        batch = torch.randn(*shape, dtype=torch.float64) * 3 + 1
        plain(batch)
        for part in batch.chunk(4):
            checkpointed(deferred, part.requires_grad_()).sum().backward()  # the recompute is not counted
        deferred.commit()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(deferred.state_dict()[name], value)


def test_deferred_batch_norm_converts_and_rejects_sync_batch_norm():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm1d(3)))
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model)
    assert [type(m).__name__ for m in converted.modules()].count("DeferredBatchNorm") == 2
    with pytest.raises(ValueError, match="SyncBatchNorm cannot be deferred"):
        DeferredBatchNorm.convert_deferred_batch_norm(nn.SyncBatchNorm(3))


def test_skip_layout_sends_crossing_skips_directly_and_keeps_local_ones_local():
    from lightning_pipe.partition import split_points
    from lightning_pipe.skip import SkipLayout
    from lightning_pipe.skip.layout import declarations

    model = unet()
    layers = list(model.named_children())
    for balance, routes, crossing in (
        ([3, 5], ((0, 1),), {(0, 1): 2}),  # both U-Net skips cross one boundary together; the mask stays on stage 1
        ([1, 3, 4], ((0, 2), (1, 2)), {(0, 2): 1, (1, 2): 2}),  # outer skip 0 -> 2 directly; inner + mask 1 -> 2
        ([1, 2, 3, 2], ((0, 3), (1, 3)), {(0, 3): 1, (1, 3): 1}),  # crosses 3 and 2 boundaries; mask local
    ):
        per_stage = [declarations(layers[a:b]) for a, b in split_points(balance)]
        layout = SkipLayout(per_stage)
        assert layout.routes == routes
        assert {k: len(v) for k, v in layout.crossing.items()} == crossing
