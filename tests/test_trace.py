"""Measured timelines of real plain-API runs: the Chrome trace, the metrics, the PNG, profiler ranges."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch

from lightning_pipe.schedule import SCHEDULES, Action
from lightning_pipe.trace import Recorder, StepRecord, pipeline_metrics
from tests import distributed
from tests.models import mlp

# Legend: p = num_stages (= ranks), m = num_microbatches; "1F3" = stage 1, forward, microbatch 3.
BATCH, M, STEPS = 8, 4, 3


def _traced_runs(rank, world, out):
    """Per pipeline size (2 stages on ranks 0-1, 3 on all) and schedule: 3 recorded steps, the
    first of which exchanges shapes, exported and gathered; then the PNG, a profiled step and an
    estimate of the clock offsets. One run of 3 processes: each process spends seconds importing."""
    import torch.distributed as dist

    from lightning_pipe import Pipeline, partition
    from lightning_pipe.trace import clock_offsets

    x, y = torch.randn(BATCH, 6, dtype=torch.float64), torch.randn(BATCH, 6, dtype=torch.float64)
    out_by_size = {}
    for p in (2, world):
        group = dist.new_group(list(range(p))) if p < world else None  # every rank creates every group
        if rank >= p:
            continue
        results, off = {}, True
        for schedule in SCHEDULES:
            pipe = Pipeline(partition(mlp(num_layers=3), rank, p), chunks=M, process_group=group, schedule=schedule)
            off = off and pipe.recorder is None and pipe.executor.recorder is None
            pipe.trace_steps()
            for _ in range(STEPS):
                pipe.forward_backward(x, criterion=torch.nn.functional.mse_loss, labels=(y,))
            path = pipe.export_trace(os.path.join(out, f"{schedule}-{p}.json"))
            results[schedule] = (path, pipe.gather_trace())
        png = pipe.save_timeline_png(os.path.join(out, f"timeline-{p}.png"))
        pipe.stop_tracing()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            pipe.forward_backward(x, criterion=torch.nn.functional.mse_loss, labels=(y,))
        ranges = sorted({e.name for e in profiler.events() if e.name.startswith("pipe/")})
        offsets = clock_offsets(pipe.group, estimate=True, rounds=4)  # the multi-host path, on one host
        out_by_size[p] = (results, png, ranges, offsets, off)
    return out_by_size


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trace"))
    return distributed.run(_traced_runs, 3, out, timeout=150)


@pytest.fixture(params=[2, 3], ids=["2-stages", "3-stages"])
def run(request, runs):
    """``(num_stages, [per rank: (results, png, profiler ranges, clock offsets, off by default)])``."""
    return request.param, [per_rank[request.param] for per_rank in runs[: request.param]]


def _events(path):
    with open(path) as f:
        trace = json.load(f)  # valid JSON, as ui.perfetto.dev and chrome://tracing need
    return trace["traceEvents"]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_trace_holds_every_action_once_per_step_in_schedule_order(run, schedule):
    p, results = run
    path, _ = results[0][0][schedule]
    assert all(path is None for path, _ in (r[0][schedule] for r in results[1:]))  # written once, by stage 0
    events = _events(path)
    for e in events:
        assert isinstance(e["name"], str) and e["ph"] in "XMsf"
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0, e
    compute = defaultdict(list)  # (rank, step) -> names in time order
    for e in sorted((e for e in events if e.get("cat") == "compute"), key=lambda e: e["ts"]):
        compute[(e["pid"], e["args"]["step"])].append(e["name"])
    plan = SCHEDULES[schedule](p, M)
    assert set(compute) == {(r, s) for r in range(p) for s in range(STEPS)}
    for (rank, step), names in compute.items():
        assert names == [str(a) for a in plan[rank]], (rank, step)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_send_starts_before_its_receive_ends(run, schedule):
    p, results = run
    events = _events(results[0][0][schedule][0])
    sends = {}  # (step, send action) -> start of the block that issued it
    for e in (e for e in events if e.get("cat") == "issue"):
        for name in e["args"]["actions"]:
            if Action.parse(name).is_send:
                sends[(e["args"]["step"], name)] = e["ts"]
    waits = [e for e in events if e.get("cat") == "wait" and "peer" in e["args"]]
    # every message crosses a link: p - 1 links, two directions, M microbatches, STEPS steps
    assert len(waits) == len(sends) == 2 * (p - 1) * M * STEPS
    for e in waits:
        a = Action.parse(e["name"])
        send = Action({"RF": "SF", "RB": "SB"}[a.kind], a.peer, a.microbatch_index, a.stage_index)
        assert sends[(e["args"]["step"], str(send))] <= e["ts"] + e["dur"], (e, send)
    assert len([e for e in events if e["ph"] == "s"]) == len(waits)  # one flow arrow per message


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_metrics_agree_with_the_trace(run, schedule):
    p, results = run
    path, records = results[0][0][schedule]
    metrics = pipeline_metrics(records, batch_size=BATCH)
    events = _events(path)
    steps = defaultdict(list)
    for e in (e for e in events if e.get("cat") == "step"):
        steps[e["args"]["step"]].append(e)
    total_us = sum(max(e["ts"] + e["dur"] for e in es) - min(e["ts"] for e in es) for es in steps.values())
    busy_us = [sum(e["dur"] for e in events if e.get("cat") == "compute" and e["pid"] == r) for r in range(p)]
    comm_us = [sum(e["dur"] for e in events if e.get("cat") in ("wait", "issue") and e["pid"] == r) for r in range(p)]
    assert metrics.num_steps == STEPS
    assert metrics.step_seconds == pytest.approx(total_us / STEPS * 1e-6, abs=1e-8)
    assert metrics.busy_fraction == pytest.approx([b / total_us for b in busy_us], abs=1e-6)
    assert metrics.bubble_fraction == pytest.approx(1 - sum(busy_us) / (p * total_us), abs=1e-6)
    assert metrics.wait_seconds == pytest.approx([c / STEPS * 1e-6 for c in comm_us], abs=1e-8)
    assert metrics.samples_per_second == pytest.approx(BATCH * STEPS / (total_us * 1e-6), rel=1e-6)
    assert 0 < metrics.bubble_fraction < 1


def test_timeline_png_is_a_valid_png(run):
    from matplotlib.image import imread

    p, results = run
    path = results[0][1]
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 500
    assert all(r[1] is None for r in results[1:])


def test_compute_actions_are_profiler_ranges(run):
    p, results = run
    for rank, (_, _, ranges, _, _) in enumerate(results):
        plan = SCHEDULES["1f1b"](p, M)[rank]  # the last pipeline of the run
        assert ranges == sorted(f"pipe/{a}" for a in plan)


def test_estimated_clock_offsets_on_one_host_are_within_their_error(run):
    p, results = run
    offsets = results[0][3]
    assert offsets[0] == (0.0, 0.0) and len(offsets) == p
    for offset, error in offsets[1:]:
        assert 0 < error < 0.5 and abs(offset) <= error + 1e-4  # one clock: the true offset is 0
    assert all(r[3] is None for r in results[1:])


def test_recording_is_off_by_default(run):
    p, results = run
    assert all(r[4] for r in results)


def test_recorder_keeps_the_latest_of_the_steps_asked_for():
    recorder = Recorder(keep=2)
    for step in range(4):
        recorder.close(recorder.start(step, (), 0), 0.0, 0.0, 0.0)
    assert [r.step for r in recorder.records] == [2, 3]
    assert Recorder(steps=range(5, 7)).start(4, (), 0) is None


def test_metrics_need_a_step_recorded_by_every_rank():
    from lightning_pipe.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="trace_steps"):
        pipeline_metrics([])


def test_records_survive_pickling_for_the_gather():
    import pickle

    record = StepRecord(3, 1, (Action("F", 1, 0),))
    record.on_compute(Action("F", 1, 0), 1.0, 2.0)
    copy = pickle.loads(pickle.dumps(record))
    assert (copy.step, copy.pp_rank, copy.compute, copy.busy_seconds()) == (3, 1, record.compute, 1.0)


def test_the_planned_timeline_of_a_split_backward_uses_the_measured_input_and_weight_costs():
    """Regression: only F and B costs reached the simulation, so a ZB-V or ZB-H1 plan ran every I and W
    at the 1 s default (a 6 s plan drawn under a 0.1 s step)."""
    from lightning_pipe.schedule import make_table
    from lightning_pipe.timeline import _plan_boxes

    tables = make_table("zbv", 2, 2)
    labels = {a: str(a) for row in tables for a in row}
    boxes = _plan_boxes(tables, {"F": 0.001, "I": 0.001, "W": 0.001}, labels)
    assert max(start + duration for row in boxes for _, _, start, duration in row) < 0.05
