"""Drawing recorded steps: one Chrome/Perfetto trace for all ranks, and a PNG beside the plan.

The trace is Chrome's JSON trace format (complete ``"X"`` events, microsecond timestamps), which
ui.perfetto.dev and chrome://tracing open: one process per pipeline rank, with a ``compute``
thread (the step and its compute actions, named like ``"1F3"``) and a ``communication`` thread
(receive waits, named like ``"1RF3@0"``; issued blocks, named by the sends and receives they
start), and a flow arrow from each send to the wait that received it.

The picture uses matplotlib (``pip install lightning-pipe[plot]``), imported only when drawing: it
is the plotting library that every Python install of PyTorch users already trusts, renders PNG
without a display, and needs no browser. It shows one row per rank in the layout of
:func:`~lightning_pipe.schedule.format_table` (time to the right, a box per action labelled
``F3``), the measured step above and the plan below: the same schedule simulated with the
measured mean duration of each kind of action, on the same time axis.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.schedule.action import RECV_KINDS, SEND_KINDS, B, F, I, W
from lightning_pipe.schedule.validate import simulate
from lightning_pipe.trace import StepRecord, by_step, pipeline_metrics

_COMPUTE_TID, _COMM_TID = 0, 1
_RECV_OF = dict(zip(SEND_KINDS, RECV_KINDS))  # SF -> RF, SB -> RB, ...
_COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#8172b2", "W": "#c44e52"}
_ORDER = "FIBW"


def _us(seconds: float, origin: float) -> float:
    return round((seconds - origin) * 1e6, 3)


def _args(record: StepRecord, action) -> dict:
    args = {"stage": action.stage_index, "microbatch": action.microbatch_index, "step": record.step}
    if action.peer is not None:
        args["peer"] = action.peer
    return args


def _rank_events(record: StepRecord, origin: float) -> List[dict]:
    pid, events = record.pp_rank, []

    def span(name, cat, tid, begin, end, args) -> None:
        ts = _us(begin, origin)  # the end rounded like the starts, so that adjacent spans never overlap
        events.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                       "ts": ts, "dur": round(_us(end, origin) - ts, 3), "args": args})

    span(f"step {record.step}", "step", _COMPUTE_TID, record.begin, record.end,
         {"step": record.step, "busy_ms": round(record.busy_seconds() * 1e3, 6)})
    for action, begin, end in record.compute:
        span(str(action), "compute", _COMPUTE_TID, begin, end, _args(record, action))
    for action, begin, end in record.waits:
        span(str(action), "wait", _COMM_TID, begin, end, _args(record, action))
    for actions, begin, end in record.issued:
        span(" ".join(map(str, actions)), "issue", _COMM_TID, begin, end,
             {"step": record.step, "actions": [str(a) for a in actions]})
    span("finish sends", "wait", _COMM_TID, record.finish[0], record.finish[1], {"step": record.step})
    return events


def _flow_events(records: Sequence[StepRecord], origin: float) -> List[dict]:
    """An arrow from each issued send to the receive wait that took its message."""
    sends = {}
    for record in records:
        for actions, begin, end in record.issued:
            for a in actions:
                if a.kind in _RECV_OF:  # keyed by the receive that matches it
                    key = (record.step, _RECV_OF[a.kind], a.peer, a.microbatch_index, a.stage_index)
                    sends[key] = (record.pp_rank, (begin + end) / 2)
    events = []
    for record in records:
        for a, begin, end in record.waits:
            key = (record.step, a.kind, a.stage_index, a.microbatch_index, a.peer)
            if key not in sends:
                continue
            flow = len(events) // 2
            pid, ts = sends[key]
            common = {"name": "message", "cat": "message", "id": flow}
            events.append({**common, "ph": "s", "pid": pid, "tid": _COMM_TID, "ts": _us(ts, origin)})
            events.append({**common, "ph": "f", "bp": "e", "pid": record.pp_rank, "tid": _COMM_TID,
                           "ts": _us((begin + end) / 2, origin)})
    return events


def chrome_trace(records: Sequence[StepRecord]) -> dict:
    """The Chrome trace (``{"traceEvents": [...]}``) of records from one or more ranks.

    Times are microseconds from the earliest step's start; the records' clocks must be aligned
    (as :func:`~lightning_pipe.trace.gather_records` returns them).

    Example:
        >>> from lightning_pipe.schedule import Action
        >>> record = StepRecord(0, 0, ())
        >>> record.compute = [(Action("F", 0, 0), 0.0, 0.001)]
        >>> record.end, record.finish = 0.001, (0.001, 0.001)
        >>> [(e["name"], e["ts"], e["dur"]) for e in chrome_trace([record])["traceEvents"] if e["ph"] == "X"]
        [('step 0', 0.0, 1000.0), ('0F0', 0.0, 1000.0), ('finish sends', 1000.0, 0.0)]
    """
    records = list(records)
    if not records:
        raise ConfigurationError("no steps were recorded: call Pipeline.trace_steps() before the steps to trace")
    origin = min(r.begin for r in records)
    events: List[dict] = []
    for rank in sorted({r.pp_rank for r in records}):
        meta = {"ph": "M", "pid": rank, "tid": _COMPUTE_TID, "ts": 0}
        events.append({**meta, "name": "process_name", "args": {"name": f"pp_rank {rank}"}})
        events.append({**meta, "name": "process_sort_index", "args": {"sort_index": rank}})
        for tid, name in ((_COMPUTE_TID, "compute"), (_COMM_TID, "communication")):
            events.append({**meta, "name": "thread_name", "tid": tid, "args": {"name": name}})
    for record in records:
        events.extend(_rank_events(record, origin))
    events.extend(_flow_events(records, origin))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "lightning_pipe", "clock": "perf_counter (CLOCK_MONOTONIC), aligned per host"}}


def write_chrome_trace(records: Sequence[StepRecord], path: str) -> str:
    """Write :func:`chrome_trace` as JSON to ``path`` (open it in ui.perfetto.dev) and return the path."""
    with open(path, "w") as f:
        json.dump(chrome_trace(records), f)
    return str(path)


# -- the picture ---------------------------------------------------------------------------------
Box = Tuple[str, str, float, float]  # label, kind, start, duration (seconds from the step's start)


def _figure(num_panels: int, num_ranks: int):
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "drawing a timeline needs matplotlib, which lightning_pipe installs only on request: "
            "pip install lightning-pipe[plot] (or pip install matplotlib)"
        ) from exc
    return Figure(figsize=(12, 0.9 + num_panels * (0.6 + 0.45 * num_ranks)), layout="constrained")


def _labels(plan: Sequence[Sequence]) -> Dict:
    """Labels as :func:`format_table` writes them: ``F3``, or ``1F3`` where a rank runs several stages."""
    multi = any(len({a.stage_index for a in row}) > 1 for row in plan)
    return {a: str(a) if multi else f"{a.kind}{a.microbatch_index}" for row in plan for a in row}


def _draw(ax, rows: Sequence[Sequence[Box]], waits: Sequence[Sequence[Box]], title: str, width: float) -> None:
    for r, row in enumerate(rows):
        for start, duration in ((b[2], b[3]) for b in waits[r] if b[3] > 0):
            ax.barh(r, duration, left=start, height=0.25, color="#d0d0d0", linewidth=0)
        for label, kind, start, duration in row:
            ax.barh(r, duration, left=start, height=0.8, color=_COLORS.get(kind, "#8c8c8c"),
                    edgecolor="white", linewidth=0.5)
            if duration >= width * 0.011 * len(label):  # the label fits in its box
                ax.text(start + duration / 2, r, label, ha="center", va="center", color="white", fontsize=7)
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_title(title, fontsize=9, loc="left")


def _plan_boxes(tables: tuple, costs: Dict[str, float], labels: Dict) -> List[List[Box]]:
    """Boxes of ``tables`` (compute-only or lowered, e.g. with skip routes) as simulated."""
    # a split backward measures I and W, not B: each at its own cost (B's default would be 1 s)
    result = simulate(tables, costs.get(F, 1.0), costs.get(B, 1.0), input_cost=costs.get(I), weight_cost=costs.get(W))
    plan = [[a for a in row if a.is_compute] for row in tables]
    return [[(labels[a], a.kind, start, costs.get(a.kind, 0.0)) for a, start in zip(row, starts)]
            for row, starts in zip(plan, result.start_times)]


def save_timeline_png(records: Sequence[StepRecord], path: str, step: Optional[int] = None) -> str:
    """Draw one recorded step of every rank above its simulated plan, as a PNG at ``path``.

    Args:
        records: all ranks' records on one clock (:func:`~lightning_pipe.trace.gather_records`).
        path: where to write the PNG.
        step: the step to draw; default the last step that every rank recorded.

    Returns:
        ``path``.
    """
    steps = by_step(records)
    num_ranks = max((len(v) for v in steps.values()), default=0)
    complete = [s for s, v in steps.items() if len(v) == num_ranks]
    if step is None and complete:
        step = complete[-1]
    if step not in complete:
        raise ConfigurationError(f"step {step} was not recorded by every rank; recorded by all: {complete}")
    per_rank = [steps[step][r] for r in sorted(steps[step])]
    origin = min(r.begin for r in per_rank)
    plan = [r.plan() for r in per_rank]
    labels = _labels(plan)
    measured = [[(labels[a], a.kind, b - origin, e - b) for a, b, e in r.compute] for r in per_rank]
    waits = [[("", "wait", b - origin, e - b) for b, e in r.communication()] for r in per_rank]
    durations: Dict[str, List[float]] = {}
    for row in measured:
        for _, kind, _, duration in row:
            durations.setdefault(kind, []).append(duration)
    costs = {kind: sum(d) / len(d) for kind, d in durations.items()}
    planned = _plan_boxes(tuple(r.row for r in per_rank), costs, labels)
    metrics = pipeline_metrics(per_rank)
    makespan = max(r.end for r in per_rank) - origin
    plan_makespan = max((s + d for row in planned for _, _, s, d in row), default=0.0)
    width = max(makespan, plan_makespan)
    means = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in sorted(costs.items(), key=lambda kv: _ORDER.find(kv[0])))
    figure = _figure(2, len(per_rank))
    top, bottom = figure.subplots(2, 1, sharex=True)
    _draw(top, _scaled(measured), _scaled(waits),
          f"measured: step {step}, {makespan * 1e3:.3g} ms, bubble {metrics.bubble_fraction:.1%} "
          f"(grey: in communication)", width * 1e3)
    _draw(bottom, _scaled(planned), [[] for _ in planned],
          f"plan: the same schedule simulated with mean {means}: {plan_makespan * 1e3:.3g} ms", width * 1e3)
    bottom.set_xlabel("ms since the step started")
    figure.savefig(path, dpi=120)
    return str(path)


def _scaled(rows: Sequence[Sequence[Box]]) -> List[List[Box]]:
    return [[(label, kind, start * 1e3, duration * 1e3) for label, kind, start, duration in row] for row in rows]


def save_schedule_png(tables: tuple, path: str, forward_cost: float = 1.0, backward_cost: float = 1.0,
                      title: str = "") -> str:
    """Draw a schedule's simulated plan (no measurement) as a PNG at ``path`` and return ``path``."""
    plan = [[a for a in row if a.is_compute] for row in tables]
    labels = _labels(plan)
    # as `show` prints it: a split backward's I and W take one backward's time each
    planned = _plan_boxes(tables, {F: forward_cost, B: backward_cost, I: backward_cost, W: backward_cost}, labels)
    width = max((s + d for row in planned for _, _, s, d in row), default=1.0)
    figure = _figure(1, len(plan))
    ax = figure.subplots(1, 1)
    _draw(ax, planned, [[] for _ in planned], title or f"plan, makespan {width:g}", width)
    ax.set_xlabel(f"time (forward {forward_cost:g}, backward {backward_cost:g})")
    figure.savefig(path, dpi=120)
    return str(path)
