"""Activation memory under every schedule: exact bytes per stage and per rank, and ZB's bounds.

The model's blocks are ``Linear(w, 2w) -> ReLU -> Linear(2w, w)`` (no bias, float32): a block
saves its input (w values a sample) and the ReLU's output (2w, which the second Linear saves
too), and nothing saves its output but the next block, so a stage boundary is held once (by the
receiving stage, which keeps its input). The loss is the last stage's mean, which saves nothing.
A stage of ``k`` blocks therefore holds ``3 k w`` floats per sample from its forward until the
backward part that frees it (``B``, or ``W`` when split); checkpointed, only its input (``w``)
until the backward, and under a split backward the recomputed ``3 k w`` from ``I`` until ``W``
(recomputed once, for both parts; on the first stage, whose ``I`` has no input to differentiate,
``W`` recomputes and frees at once).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe import Pipeline, partition
from lightning_pipe.checkpoint import should_checkpoint
from lightning_pipe.schedule import ALL_SCHEDULES
from lightning_pipe.schedule.action import B, F, I, W
from tests import distributed

WIDTH, FLOAT32, SAMPLES = 8, 4, 2  # samples per microbatch
SCHEDULES = (("1f1b", None), ("gpipe", None), ("zb_h1", None), ("zb_h2", None), ("zbv", None), ("interleaved_1f1b", 2))


class Block(nn.Sequential):
    calls = 0  # forwards run, recomputations included

    def __init__(self, width: int) -> None:
        super().__init__(nn.Linear(width, 2 * width, bias=False), nn.ReLU(), nn.Linear(2 * width, width, bias=False))

    def forward(self, x):
        Block.calls += 1
        return super().forward(x)


class Mean(nn.Module):
    def forward(self, x):
        return x.mean()


def _model(num_blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(WIDTH) for _ in range(num_blocks)], Mean())


def _balance(num_blocks: int, num_stages: int) -> list:
    balance = [num_blocks // num_stages] * num_stages
    balance[-1] += 1  # the loss
    return balance


def _expected(row, balance, checkpoint: str, m: int) -> tuple:
    """Replay the row: (rank peak, {stage: peak}) in bytes."""
    full = {s: 3 * WIDTH * (count if s < len(balance) - 1 else count - 1) * FLOAT32 * SAMPLES
            for s, count in enumerate(balance)}
    held, peaks, rank_peak = {}, {}, 0
    for action in row:
        kind, s, i, _ = action
        if kind == F:
            checkpointed = should_checkpoint(checkpoint, i, m)
            held[(s, i)] = WIDTH * FLOAT32 * SAMPLES if checkpointed else full[s]
        elif kind == I and s > 0:
            held[(s, i)] = full[s]  # recomputed, kept until W (stage 0's I has nothing to do: W recomputes)
        elif kind in (B, W):
            del held[(s, i)]
        else:
            continue
        per_stage = {}
        for (t, _), nbytes in held.items():
            per_stage[t] = per_stage.get(t, 0) + nbytes
        for t, nbytes in per_stage.items():
            peaks[t] = max(peaks.get(t, 0), nbytes)
        rank_peak = max(rank_peak, sum(held.values()))
    return rank_peak, peaks


def _peaks(rank, world, num_blocks, cases):
    results = {}
    for schedule, v, m, checkpoint in cases:
        spec = ALL_SCHEDULES[schedule]
        stages = world * spec.virtual_stages(v)
        balance = _balance(num_blocks, stages)
        parts = partition(_model(num_blocks), rank, world, balance, num_model_chunks=spec.virtual_stages(v),
                          placement=spec.placement)
        pipe = Pipeline(parts, chunks=m, schedule=schedule, virtual_stages=v, checkpoint=checkpoint,
                        count_activations=True)
        Block.calls = 0
        pipe.forward_backward(torch.randn(SAMPLES * m, WIDTH))
        forwards = sum(len(p) - (1 if isinstance(p[-1], Mean) else 0) for p in parts) * m
        expected_rank, expected_stages = _expected(pipe._row(schedule, m), balance, checkpoint, m)
        results[(schedule, v, m, checkpoint)] = dict(
            rank=pipe.meter.peak_bytes, expected_rank=expected_rank, held=pipe.meter.held_bytes,
            stages={s.stage_index: s.meter.peak_bytes for s in pipe.stages}, expected_stages=expected_stages,
            calls=Block.calls, forwards=forwards,
        )
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"p{p}")
def peaks(request):
    p = request.param
    cases = [(s, v, m, c) for s, v in SCHEDULES for m in (p, 2 * p + 1) for c in ("never", "except_last", "always")]
    return p, cases, distributed.run(_peaks, p, 4 * p, cases, timeout=180)


def test_every_stage_and_rank_holds_exactly_the_bytes_its_row_implies(peaks):
    p, cases, results = peaks
    for case in cases:
        for rank in range(p):
            got = results[rank][case]
            assert got["stages"] == got["expected_stages"], (case, rank, got)
            assert got["rank"] == got["expected_rank"], (case, rank, got)
            assert got["held"] == 0, (case, rank, got)


def test_checkpointed_forwards_are_recomputed_once_under_a_split_backward(peaks):
    p, cases, results = peaks
    for case in cases:
        schedule, _, m, checkpoint = case
        recomputed = sum(should_checkpoint(checkpoint, i, m) for i in range(m))
        for rank in range(p):
            got = results[rank][case]
            blocks = got["forwards"] // m
            assert got["calls"] == got["forwards"] + blocks * recomputed, (case, rank, got)


def test_zero_bubble_schedules_hold_no_more_than_1f1b_on_the_busiest_rank(peaks):
    p, cases, results = peaks
    for m in (p, 2 * p + 1):
        busiest = {s: max(results[r][(s, v, m, "never")]["rank"] for r in range(p)) for s, v in SCHEDULES}
        assert busiest["zb_h1"] <= busiest["1f1b"], busiest
        assert busiest["zbv"] <= busiest["1f1b"], busiest
        assert busiest["1f1b"] < busiest["gpipe"] or m <= p, busiest


def test_zb_h2_holds_more_than_zb_h1_and_no_more_than_gpipe_on_the_busiest_rank(peaks):
    """ZB-H2 holds up to 2p - 1 microbatches on every rank, where ZB-H1 holds p."""
    p, cases, results = peaks
    for m in (p, 2 * p + 1):
        busiest = {s: max(results[r][(s, v, m, "never")]["rank"] for r in range(p)) for s, v in SCHEDULES}
        assert busiest["zb_h1"] <= busiest["zb_h2"] <= busiest["gpipe"], busiest
        assert busiest["zb_h2"] > busiest["zb_h1"] or m <= p, busiest
