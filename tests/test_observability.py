"""Seeing inside PipeStrategy runs: timelines written by PipelineTrace, pipe/ metrics, measured balance.

The runs are tests/lm_app.py launches shared through ``lm_runs`` (tests/conftest.py): ``llama_p2``
(GPipe, 2 stages) records batches 2 and 3, ``llama_p3`` (1F1B, 3 stages) batch 3; both log every step.
"""

from __future__ import annotations

import json
import re

import pytest

from lightning_pipe.schedule import SCHEDULES


def _trace(root, name):
    with open(root / name / "version_0" / "pipeline_trace.json") as f:
        return json.load(f)["traceEvents"]


@pytest.mark.parametrize("launch, name, schedule, stages, batches", [
    ("world2", "llama_p2", "gpipe", 2, [2, 3]), ("world3", "llama_p3", "1f1b", 3, [3]),
])
def test_the_trace_holds_every_action_of_the_schedule_once_per_step_in_order(lm_runs, launch, name, schedule,
                                                                            stages, batches):
    _, root, output = lm_runs(launch)
    assert f"PipelineTrace: batches {batches[0]}..{batches[-1]} written to" in output
    # into the logger's folder: asking Lightning for it is a collective (regression: only rank 0 asked, and hung)
    png = (root / name / "version_0" / "pipeline_timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    events = [e for e in _trace(root, name) if e.get("ph") == "X" and e.get("cat") == "compute"]
    assert all(e["dur"] >= 0 for e in events)
    plan = [[str(a) for a in row] for row in SCHEDULES[schedule](stages, 3)]
    steps = sorted({e["args"]["step"] for e in events})
    assert len(steps) == len(batches)
    for step in steps:
        for rank in range(stages):
            done = sorted((e for e in events if e["args"]["step"] == step and e["pid"] == rank), key=lambda e: e["ts"])
            assert [e["name"] for e in done] == plan[rank], (step, rank)


def test_the_logged_pipeline_metrics_agree_with_the_trace(lm_runs):
    """Each traced step's pipe/ values are computed from the records the trace shows."""
    results, root, _ = lm_runs("world2")
    rows = [r for r in results["llama_p2"]["csv"] if r.get("pipe/bubble_fraction")]
    assert len(rows) == 6  # every training step: log_every_n_steps=1
    events = [e for e in _trace(root, "llama_p2") if e.get("ph") == "X"]
    steps = sorted({e["args"]["step"] for e in events if e["cat"] == "step"})
    for step, row in zip(steps, rows[2:4]):  # batches 2 and 3 were traced
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] == "step" and e["args"]["step"] == step]
        makespan = max(end for _, end in spans) - min(begin for begin, _ in spans)
        busy = [sum(e["dur"] for e in events if e["cat"] == "compute" and e["pid"] == rank and e["args"]["step"] == step)
                for rank in (0, 1)]
        for rank in (0, 1):
            assert float(row[f"pipe/busy_fraction/stage_{rank}"]) == pytest.approx(busy[rank] / makespan, rel=1e-3)
        assert float(row["pipe/bubble_fraction"]) == pytest.approx(1 - sum(busy) / (2 * makespan), rel=1e-3, abs=1e-4)
    for row in rows:
        assert 0 <= float(row["pipe/bubble_fraction"]) < 1 and float(row["pipe/samples_per_second"]) > 0


@pytest.mark.parametrize("balance", ["time", "flops"])
def test_balance_by_measurement_puts_the_heavy_blocks_apart(lm_runs, balance):
    """6 Linear layers then 2 parameter-free token-mixing blocks (each dozens of Linear layers of work):
    counting parameters splits [3, 5]; measuring splits [7, 1], and the summary shows each stage's cost.
    [7, 1] beats [6, 2] exactly when the last block costs more than the 6 Linear layers. (Regression: with
    4 mixing blocks, [8, 2] against [7, 3] turned on the measured differences between identical blocks,
    which a busy machine's timings make large enough to flip the split.)"""
    _, _, output = lm_runs("world2")
    # each run's whole summary: the 4-stage interleaved run of the 4-block model prints stage rows like these too
    header = r"PipeStrategy: 2 stages x 1 replicas, [^\n]*\n"
    assert re.search(header + r"  stage 0: layers 0\.\.2 \(3\), 3,168 parameters, ranks \[0\]\n"
                              r"  stage 1: layers 3\.\.7 \(5\), 3,168 parameters, ranks \[1\]\n", output)
    assert re.search(header + rf"  stage 0: layers 0\.\.6 \(7\), 6,336 parameters, ranks \[0\], {balance} [\d.e+]+ [^\n]*\n"
                              rf"  stage 1: layers 7\.\.7 \(1\), 0 parameters, ranks \[1\], {balance} [\d.e+]+ [^\n]*\n", output)
