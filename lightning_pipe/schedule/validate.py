"""Check, simulate and draw schedule tables.

``validate`` proves a table safe before it runs: every stage/microbatch has its forward (and its
backward) exactly once, each forward precedes its backward, every receive is matched by one send
in the same order on both sides of each link, and simulating all ranks together reaches the end
(no deadlock). ``simulate`` replays the table under a cost model; ``format_table`` draws it.

The simulation model is that of the executor on gloo: sends never block, a receive waits until
its matching send has been issued. Tables that pass it also keep FIFO order per link, which is
what lets the transport match messages without tags or metadata.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence, Tuple

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedule.action import (
    RECV_B, RECV_F, RECV_SKIP, RECV_SKIP_GRAD, SEND_B, SEND_F, SEND_SKIP, SEND_SKIP_GRAD, Action, B, F,
)
from lightning_pipe.schedule.lower import is_lowered, lower

# the message a send or receive moves, and the compute action it follows (sends) or feeds (receives)
_MESSAGE_OF = {SEND_F: "F", RECV_F: "F", SEND_B: "B", RECV_B: "B",
               SEND_SKIP: "S", RECV_SKIP: "S", SEND_SKIP_GRAD: "G", RECV_SKIP_GRAD: "G"}
_COMPUTE_OF = {"F": F, "B": B, "S": F, "G": B}
_SENDS = (SEND_F, SEND_B, SEND_SKIP, SEND_SKIP_GRAD)


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured.

    Attributes:
        makespan: time from the first action to the last.
        bubble_fraction: share of rank-time spent idle, ``1 - busy / (num_ranks * makespan)``.
        peak_in_flight: per rank, the most microbatches forwarded but not yet backwarded.
        busy: per rank, the time spent computing.
        start_times: per rank, the start time of each compute action, in row order.
    """

    makespan: float
    bubble_fraction: float
    peak_in_flight: tuple
    busy: tuple
    start_times: tuple


def format_rows(tables: tuple, marks: dict | None = None) -> str:
    """List each rank's row as written, with ``<-- ERROR HERE`` after marked actions."""
    marks = marks or {}
    lines = []
    for r, row in enumerate(tables):
        tokens = []
        for j, a in enumerate(row):
            tokens.append(str(a) + (" <-- ERROR HERE" if marks.get(r) == j else ""))
        if marks.get(r) == len(row):
            tokens.append("<-- ERROR HERE")
        lines.append(f"rank {r}: " + " ".join(tokens))
    return "\n".join(lines)


def simulate(
    tables: tuple, forward_cost: float = 1.0, backward_cost: float = 2.0, comm_cost: float = 0.0,
    _check_order: bool = False,
) -> SimulationResult:
    """Run all ranks of a table together under a cost model.

    Args:
        tables: one row of actions per rank, lowered or not (compute-only tables are lowered).
        forward_cost: time of one ``F``.
        backward_cost: time of one ``B`` (2x forward by default).
        comm_cost: time between a send and the matching receive becoming available.

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
    num_ranks = len(tables)
    ptr = [0] * num_ranks
    clock = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    in_flight = [0] * num_ranks
    peak = [0] * num_ranks
    starts = [[] for _ in range(num_ranks)]
    ready: dict = {}
    waiting: dict = {}
    links: dict = {}  # (message, source, target) -> microbatches sent and not yet received, in order
    runnable = deque(range(num_ranks))
    while runnable:
        r = runnable.popleft()
        row = tables[r]
        while ptr[r] < len(row):
            a = row[ptr[r]]
            kind = a.kind
            if kind == F or kind == B:
                starts[r].append(clock[r])
                cost = forward_cost if kind == F else backward_cost
                clock[r] += cost
                busy[r] += cost
                in_flight[r] += 1 if kind == F else -1
                if in_flight[r] > peak[r]:
                    peak[r] = in_flight[r]
            elif kind in _SENDS:
                key = (_MESSAGE_OF[kind], a.stage_index, a.peer, a.microbatch_index)
                ready[key] = clock[r] + comm_cost
                if _check_order:
                    links.setdefault(key[:3], deque()).append(key[3])
                if key in waiting:
                    runnable.append(waiting.pop(key))
            else:
                key = (_MESSAGE_OF[kind], a.peer, a.stage_index, a.microbatch_index)
                if key not in ready:
                    waiting[key] = r
                    break
                arrival = ready.pop(key)
                if _check_order:
                    pending = links[key[:3]]
                    if pending[0] != key[3]:
                        _raise(tables, [(r, ptr[r], f"receives out of order: the next message on this link is "
                                                    f"microbatch {pending[0]}")])
                    pending.popleft()
                if arrival > clock[r]:
                    clock[r] = arrival
            ptr[r] += 1
    blocked = {r: ptr[r] for r in range(num_ranks) if ptr[r] < len(tables[r])}
    if blocked:
        raise ScheduleError(
            "the schedule deadlocks: these receives wait for sends that never come first\n"
            + format_rows(tables, blocked)
        )
    makespan = max(clock) if clock else 0.0
    total = num_ranks * makespan
    return SimulationResult(
        makespan=makespan,
        bubble_fraction=(1.0 - sum(busy) / total) if total else 0.0,
        peak_in_flight=tuple(peak),
        busy=tuple(busy),
        start_times=tuple(tuple(s) for s in starts),
    )


def _check_compute(tables: tuple) -> None:
    seen: dict = {}
    stage_rank: dict = {}
    errors = []
    for r, row in enumerate(tables):
        for j, a in enumerate(row):
            if a.kind != F and a.kind != B:
                continue
            owner = stage_rank.setdefault(a.stage_index, r)
            if owner != r:
                errors.append((r, j, f"stage {a.stage_index} runs on rank {owner} and on rank {r}"))
            key = (a.kind, a.stage_index, a.microbatch_index)
            if key in seen:
                errors.append((r, j, f"{a} appears twice"))
            seen[key] = (r, j)
            if a.kind == B and (F, a.stage_index, a.microbatch_index) not in seen:
                errors.append((r, j, f"{a} runs before its forward"))
    stages = sorted(stage_rank)
    microbatches = sorted({mb for (_, _, mb) in seen})
    has_backward = any(kind == B for (kind, _, _) in seen)
    if stages != list(range(len(stages))) or microbatches != list(range(len(microbatches))):
        errors.append((None, None, f"stages {stages} and microbatches {microbatches} must count from 0 without gaps"))
    for s in stages:
        rank = stage_rank[s]
        for i in microbatches:
            for kind in (F, B) if has_backward else (F,):
                if (kind, s, i) not in seen:  # marked at the end of the row of the rank that runs stage s
                    errors.append((rank, len(tables[rank]), f"{Action(kind, s, i)} is missing"))
    if errors:
        _raise(tables, errors)


def _check_links(tables: tuple) -> None:
    """Every receive has its send, in the same order on both ends of each link."""
    stage_rank = {a.stage_index: r for r, row in enumerate(tables) for a in row if a.kind in (F, B)}
    last = max(stage_rank)
    sent: dict = {}
    received: dict = {}
    errors = []
    for r, row in enumerate(tables):
        done = set()
        recvs = set()
        for j, a in enumerate(row):
            kind, s, i = a.kind, a.stage_index, a.microbatch_index
            if kind == F or kind == B:
                done.add((kind, s, i))
                continue
            if a.peer not in stage_rank:
                errors.append((r, j, f"{a} names stage {a.peer}, which no rank runs"))
                continue
            message = _MESSAGE_OF[kind]
            compute = _COMPUTE_OF[message]
            if kind in _SENDS:
                if (compute, s, i) not in done:
                    errors.append((r, j, f"{a} sends before {Action(compute, s, i)} ran"))
                sent.setdefault((message, r, stage_rank[a.peer]), []).append(((s, a.peer, i), r, j))
            else:
                if (compute, s, i) in done:
                    errors.append((r, j, f"{a} receives the input of {Action(compute, s, i)} after it ran"))
                recvs.add((compute, s, i))
                received.setdefault((message, stage_rank[a.peer], r), []).append(((a.peer, s, i), r, j))
        for j, a in enumerate(row):
            if a.kind == F or a.kind == B:
                needs_input = a.stage_index > 0 if a.kind == F else a.stage_index < last
                if needs_input and (a.kind, a.stage_index, a.microbatch_index) not in recvs:
                    errors.append((r, j, f"{a} runs without receiving its input"))
    for link in set(sent) | set(received):
        s_list, r_list = sent.get(link, []), received.get(link, [])
        for n in range(max(len(s_list), len(r_list))):
            if n >= len(s_list):
                errors.append((r_list[n][1], r_list[n][2], "no matching send"))
            elif n >= len(r_list):
                errors.append((s_list[n][1], s_list[n][2], "no matching receive"))
            elif s_list[n][0] != r_list[n][0]:
                errors.append(
                    (r_list[n][1], r_list[n][2], f"receives out of order: message {n} on this link is "
                     f"stage {s_list[n][0][0]} -> {s_list[n][0][1]}, microbatch {s_list[n][0][2]}")
                )
                break
    if errors:
        _raise(tables, errors)


def _raise(tables: tuple, errors: list) -> None:
    lines = [
        f"- rank {r}, action {j}: {msg}" if r is not None and j < len(tables[r]) else f"- {msg}"
        for r, j, msg in errors[:20]
    ]
    if len(errors) > 20:
        lines.append(f"- ... and {len(errors) - 20} more")
    marks = {r: j for r, j, _ in reversed(errors) if r is not None}
    raise ScheduleError("invalid schedule:\n" + "\n".join(lines) + "\n" + format_rows(tables, marks))


def validate(tables: tuple, routes: Sequence[Tuple[int, int]] = ()) -> tuple:
    """Check a table and return it lowered (with skip ``routes``, see :func:`lower`).

    Raises:
        ScheduleError: listing every problem found, and the table with ``<-- ERROR HERE`` marks.

    Example:
        >>> from lightning_pipe.schedule import one_f_one_b, parse_table
        >>> len(validate(one_f_one_b(4, 8)))
        4
        >>> validate(parse_table(["0B0 0F0"]))
        Traceback (most recent call last):
        ...
        lightning_pipe.errors.ScheduleError: invalid schedule:
        - rank 0, action 0: 0B0 runs before its forward
        rank 0: 0B0 <-- ERROR HERE 0F0
    """
    _check_compute(tables)
    if is_lowered(tables):  # written by hand: check every send and receive against its compute action
        _check_links(tables)
        simulate(tables)
        return tables
    # lowered here, so each compute action has its receives right before it and its sends right
    # after; what is left to prove is that messages meet in order and nothing deadlocks
    lowered = lower(tables, routes)
    simulate(lowered, _check_order=True)
    return lowered


def format_table(tables: tuple, forward_cost: float = 1.0, backward_cost: float = 1.0) -> str:
    """Draw a table as a timeline, one row per rank, ``..`` where a rank waits.

    Example:
        >>> from lightning_pipe.schedule import one_f_one_b
        >>> print(format_table(one_f_one_b(2, 3)))
        rank 0: F0 F1 .. B0 F2 B1 .. B2
        rank 1: .. F0 B0 F1 B1 F2 B2 ..
    """
    result = simulate(tables, forward_cost, backward_cost)
    compute = [[a for a in row if a.is_compute] for row in tables]
    multi = any(len({a.stage_index for a in row}) > 1 for row in compute)
    labels = [[str(a) if multi else f"{a.kind}{a.microbatch_index}" for a in row] for row in compute]
    width = max((len(t) for row in labels for t in row), default=2)
    slot = min(forward_cost, backward_cost)
    num_slots = int(round(result.makespan / slot))
    lines = []
    for r, row in enumerate(compute):
        cells = ["." * width] * num_slots
        for a, label, start in zip(row, labels[r], result.start_times[r]):
            first = int(round(start / slot))
            span = int(round((forward_cost if a.kind == F else backward_cost) / slot))
            for k in range(first, first + span):
                cells[k] = label.ljust(width)
        lines.append(f"rank {r}: " + " ".join(cells))
    return "\n".join(lines)
