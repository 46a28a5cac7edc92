"""Activation memory: the exact bytes a stage holds, and 1F1B's bound against GPipe's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe import ConfigurationError, GPipe, PipeDream, partition
from lightning_pipe.memory import ActivationMeter
from lightning_pipe.microbatch import microbatch_sizes
from tests import distributed

PIPELINES = {"gpipe": GPipe, "1f1b": PipeDream}
FLOAT32 = 4  # bytes


def _widths(world: int) -> list:
    return [3 + 2 * s for s in range(world + 1)]  # distinct per stage: 3, 5, 7, ...


def _model(world: int) -> nn.Sequential:
    torch.manual_seed(0)
    widths = _widths(world)
    layers = []
    for s in range(world):
        layers += [nn.Linear(widths[s], widths[s + 1], bias=False), nn.ReLU()]
    return nn.Sequential(*layers)  # float32


def _expected_bytes_per_sample(stage_index: int, world: int) -> int:
    """Worked out by hand for ``Linear(bias=False) -> ReLU`` in float32.

    Every stage keeps its input (stage 0: the microbatch it was given; later stages: the received
    buffer), which is also what the Linear saves for its weight gradient (counted once); the weight
    is a parameter and not counted; ReLU saves its output. The last stage's ``mse_loss`` also saves
    its input (the ReLU output, already counted) and the label microbatch.
    """
    width_in, width_out = _widths(world)[stage_index], _widths(world)[stage_index + 1]
    labels = width_out if stage_index == world - 1 else 0
    return FLOAT32 * (width_in + width_out + labels)


def _peaks(rank, world, cases):
    results = {}
    for schedule, batch, chunks in cases:
        stage = partition(_model(world), rank, world, balance=[2] * world)
        pipe = PIPELINES[schedule](stage, chunks=chunks, count_activations=True)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(batch, _widths(world)[0], generator=gen)
        y = torch.randn(batch, _widths(world)[-1], generator=gen)
        peaks = []
        for _ in range(2):
            pipe.stage.meter.reset_peak()
            pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
            peaks.append(pipe.stage.meter.peak_bytes)
        results[(schedule, batch, chunks)] = (peaks, pipe.stage.meter.held_bytes)
    return results


CASES = [(schedule, batch, chunks) for schedule in PIPELINES for batch, chunks in [(16, 8), (10, 4), (8, 1)]]


def _expected_peak(schedule: str, stage_index: int, world: int, batch: int, chunks: int) -> int:
    sizes = microbatch_sizes(batch, chunks)
    in_flight = len(sizes) if schedule == "gpipe" else min(world - stage_index, len(sizes))
    # 1F1B holds a sliding window of consecutive microbatches; the first ones are the largest.
    return sum(sizes[:in_flight]) * _expected_bytes_per_sample(stage_index, world)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"p{p}")
def peaks(request):
    world = request.param
    return world, distributed.run(_peaks, world, CASES, timeout=120)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_exact_activation_bytes_on_every_stage(peaks, case):
    world, results = peaks
    schedule, batch, chunks = case
    for rank in range(world):
        (first, second), held = results[rank][case]
        expected = _expected_peak(schedule, rank, world, batch, chunks)
        assert first == expected, (rank, first, expected)
        assert second == first, f"rank {rank}: reset_peak() then the same step gave {second} after {first}"
        assert held == 0, f"rank {rank} still holds {held} bytes after the step"


def test_one_f_one_b_bounds_stage_0_memory_by_num_stages(peaks):
    world, results = peaks
    m = 8
    (gpipe_peak, _), _ = results[0][("gpipe", 16, m)]
    (one_f_one_b_peak, _), _ = results[0][("1f1b", 16, m)]
    assert gpipe_peak > 0
    assert one_f_one_b_peak <= min(world, m) / m * gpipe_peak * 1.05, (one_f_one_b_peak, gpipe_peak)


# -- the meter alone ----------------------------------------------------------------------------
def test_meter_counts_saved_tensors_once_and_skips_parameters():
    layer = nn.Linear(4, 6, bias=False)
    meter = ActivationMeter(layer.parameters())
    x = torch.ones(2, 4)
    with meter.record(0, inputs=(x,)):
        y = layer(x).relu()
    assert meter.held_bytes == meter.peak_bytes == FLOAT32 * 2 * (4 + 6)
    with meter.record(1, inputs=()):
        z = (y * 2).sum()
    assert meter.held_bytes == FLOAT32 * 2 * (4 + 6)  # a product with a Python number and a sum save no tensor
    meter.release(0)
    assert meter.held_bytes == 0 and meter.peak_bytes == FLOAT32 * 2 * (4 + 6)
    meter.reset_peak()
    assert meter.peak_bytes == 0
    assert z.requires_grad


def test_meter_counts_each_microbatch_view_of_one_batch_separately():
    batch = torch.randn(4, 3, requires_grad=True)
    meter = ActivationMeter([])
    for i, part in enumerate(batch.split(2)):
        with meter.record(i, inputs=(part,)):
            part.exp()  # exp saves its result, a fresh tensor
    assert meter.held_bytes == 2 * FLOAT32 * (2 * 3 + 2 * 3)
    meter.release(5)  # unknown microbatch: nothing held, nothing changes
    assert meter.held_bytes == 2 * FLOAT32 * 12


def test_meter_counts_expanded_and_overlapping_views_by_the_bytes_they_span():
    """Regression (review T): an expanded tensor (16 bytes of storage) counted as 16,000 bytes, and two overlapping
    slices of one saved 256 KiB output as 784,384 bytes."""
    meter = ActivationMeter([])
    x = torch.randn(1, 4)
    h = torch.randn(256, 256)
    with meter.record(0, inputs=(x.expand(1000, 4), h[:, 1:], h[:, :-1])):
        pass
    assert meter.held_bytes == FLOAT32 * (4 + 256 * 256)
    with meter.record(1, inputs=(h.t(), h[:128], h[128:])):  # a transpose spans h's bytes; the halves make them up
        pass
    assert meter.held_bytes == FLOAT32 * (4 + 2 * 256 * 256)


def _uncounted(rank, world):
    pipe = PIPELINES["1f1b"](partition(_model(world), rank, world, balance=[2] * world), chunks=2)
    hooked = []
    pipe.stage.module.register_forward_hook(
        lambda *_: hooked.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None))
    x, y = torch.randn(4, _widths(world)[0]), torch.randn(4, _widths(world)[-1])
    pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
    errors = []
    for read in (lambda: pipe.stage.meter.peak_bytes, lambda: pipe.meter.held_bytes, pipe.stage.meter.reset_peak):
        try:
            read()
        except ConfigurationError as error:
            errors.append(str(error))
    return hooked, errors


def test_counting_is_off_unless_asked_for_and_reading_a_count_then_raises():
    """Off by default: no saved-tensor hook wraps a stage's forward (it costs time), and a count read
    anyway raises, naming the switch, instead of answering 0."""
    for hooked, errors in distributed.run(_uncounted, 2, timeout=60):
        assert hooked == [False, False], hooked
        assert len(errors) == 3 and all("count_activations=True" in e for e in errors), errors
