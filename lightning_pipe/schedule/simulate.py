"""Replay a schedule table on all ranks together under a cost model.

The model is that of the executor on gloo: compute actions take their cost, sends never block,
and a receive waits until its matching send has been issued (plus ``comm_cost``). A stage's input
from a stage on the same rank needs no message (see :mod:`~lightning_pipe.schedule.lower`): the
row order already puts the producer first, which ``validate`` checks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedule._gc import gc_paused
from lightning_pipe.schedule.action import (
    RECV_B, RECV_F, RECV_SKIP, RECV_SKIP_GRAD, SEND_B, SEND_F, SEND_SKIP, SEND_SKIP_GRAD, B, F, I, W, format_rows,
)
from lightning_pipe.schedule.lower import is_lowered, lower
from lightning_pipe.schedule.placement import stage_ranks

# the message a send or receive moves: activations, their gradients, skip tensors, skip gradients
MESSAGE_OF = {SEND_F: "F", RECV_F: "F", SEND_B: "B", RECV_B: "B",
              SEND_SKIP: "S", RECV_SKIP: "S", SEND_SKIP_GRAD: "G", RECV_SKIP_GRAD: "G"}
SENDS = frozenset((SEND_F, SEND_B, SEND_SKIP, SEND_SKIP_GRAD))
# what a compute action does to the microbatches a rank holds: F takes one, B and W free it
_HELD = {F: 1, B: -1, I: 0, W: -1}


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured.

    Attributes:
        makespan: time from the first action to the last.
        bubble_fraction: share of rank-time spent idle, ``1 - busy / (num_ranks * makespan)``.
        peak_in_flight: per rank, the most (stage, microbatch) pairs held at once: from the
            forward until the backward ``B``, or until ``W`` when the backward is split.
        busy: per rank, the time spent computing.
        start_times: per rank, the start time of each compute action, in row order.
        peak_memory: per rank, ``peak_in_flight`` weighed by stage size: a pair counts
            ``1 / v`` on a rank that holds ``v`` stages (the rank's layers split evenly), so
            that one stage per rank and ``v`` stages per rank compare in units of one
            microbatch's activations through all of a rank's layers.
    """

    makespan: float
    bubble_fraction: float
    peak_in_flight: tuple
    busy: tuple
    start_times: tuple
    peak_memory: tuple = ()


@gc_paused
def simulate(
    tables: tuple,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    comm_cost: float = 0.0,
    *,
    input_cost: Optional[float] = None,
    weight_cost: Optional[float] = None,
    _check_order: bool = False,
) -> SimulationResult:
    """Run all ranks of a table together under a cost model.

    Args:
        tables: one row of actions per rank, lowered or not (compute-only tables are lowered).
        forward_cost: time of one ``F``.
        backward_cost: time of one whole backward ``B`` (2x forward by default).
        comm_cost: time between a send and the matching receive becoming available.
        input_cost: time of one ``I``; ``backward_cost / 2`` when not given.
        weight_cost: time of one ``W``; ``backward_cost / 2`` when not given (so that by default
            ``F``, ``I`` and ``W`` cost the same, the zero-bubble paper's assumption).

    Raises:
        ScheduleError: the table deadlocks, the message naming the blocked actions.

    Example:
        >>> from lightning_pipe.schedule import gpipe
        >>> result = simulate(gpipe(2, 4), forward_cost=1, backward_cost=1)
        >>> result.makespan, round(result.bubble_fraction, 2)
        (10.0, 0.2)
    """
    if not is_lowered(tables):
        tables = lower(tables)
    half = backward_cost / 2
    costs = {F: forward_cost, B: backward_cost,
             I: half if input_cost is None else input_cost, W: half if weight_cost is None else weight_cost}
    return _run(tables, costs, comm_cost, stage_ranks(tables), _check_order)


def _run(tables: tuple, costs: dict, comm_cost: float, ranks: tuple, check_order: bool) -> SimulationResult:
    """The simulation proper, on a lowered table whose stage ranks are known (hot: kept flat)."""
    num_ranks = len(tables)
    ptr, clock, busy = [0] * num_ranks, [0.0] * num_ranks, [0.0] * num_ranks
    held, peak = [0] * num_ranks, [0] * num_ranks
    starts = [[] for _ in range(num_ranks)]
    ready: dict = {}  # (message, source stage, target stage, microbatch) -> when it can be received
    waiting: dict = {}  # the same key -> the rank blocked on it
    links: dict = {}  # (message, source rank, target rank) -> messages sent and not yet received, in order
    runnable = deque(range(num_ranks))
    while runnable:
        r = runnable.popleft()
        row, p, t, spent, h, top = tables[r], ptr[r], clock[r], busy[r], held[r], peak[r]
        n, record = len(row), starts[r].append
        while p < n:
            a = row[p]
            kind = a[0]
            cost = costs.get(kind)
            if cost is not None:
                record(t)
                t += cost
                spent += cost
                h += _HELD[kind]
                if h > top:
                    top = h
            elif kind in SENDS:
                key = (MESSAGE_OF[kind], a[1], a[3], a[2])
                ready[key] = t + comm_cost
                if check_order:
                    link = (key[0], r, ranks[a[3]])
                    if link not in links:
                        links[link] = deque()
                    links[link].append(key)
                if key in waiting:
                    runnable.append(waiting.pop(key))
            else:
                key = (MESSAGE_OF[kind], a[3], a[1], a[2])
                arrival = ready.pop(key, None)
                if arrival is None:
                    waiting[key] = r
                    break
                if check_order:
                    pending = links[(key[0], ranks[a[3]], r)]
                    if pending[0] != key:
                        _raise_out_of_order(tables, pending[0], key, r, p)
                    pending.popleft()
                if arrival > t:
                    t = arrival
            p += 1
        ptr[r], clock[r], busy[r], held[r], peak[r] = p, t, spent, h, top
    blocked = {r: ptr[r] for r in range(num_ranks) if ptr[r] < len(tables[r])}
    if blocked:
        raise ScheduleError(
            "the schedule deadlocks: these receives wait for sends that never come first\n"
            + format_rows(tables, blocked)
        )
    return _result(clock, busy, peak, starts, ranks)


def _raise_out_of_order(tables: tuple, first: tuple, key: tuple, r: int, position: int) -> None:
    """Raise because ``first`` was sent on the link before ``key``, which rank ``r`` receives first."""
    what = (f"microbatch {first[3]}" if first[1:3] == key[1:3]
            else f"stage {first[1]} -> {first[2]}, microbatch {first[3]}")
    raise ScheduleError(
        f"invalid schedule:\n- rank {r}, action {position}: receives out of order: the next message on "
        f"this link is {what}\n" + format_rows(tables, {r: position})
    )


def _result(clock: list, busy: list, peak: list, starts: list, ranks: tuple) -> SimulationResult:
    stages_per_rank = [0] * len(clock)
    for rank in ranks:
        stages_per_rank[rank] += 1
    makespan = max(clock) if clock else 0.0
    total = len(clock) * makespan
    return SimulationResult(
        makespan=makespan,
        bubble_fraction=(1.0 - sum(busy) / total) if total else 0.0,
        peak_in_flight=tuple(peak),
        busy=tuple(busy),
        start_times=tuple(tuple(s) for s in starts),
        peak_memory=tuple(k / v if v else 0.0 for k, v in zip(peak, stages_per_rank)),
    )
