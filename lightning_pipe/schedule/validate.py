"""Check schedule tables before they run.

``validate`` proves a table safe: every stage/microbatch has its forward and its backward exactly
once (one ``B``, or one ``I`` and a later ``W`` on the same rank), each stage runs on one rank,
each forward precedes its backward, a stage whose input comes from a stage on the same rank runs
after it in the row, every receive is matched by one send in the same order on both ends of each
link, and simulating all ranks together reaches the end (no deadlock).

A link is a pair of ranks and a kind of message (activations, gradients, skip tensors, skip
gradients): messages of one kind between two ranks must be received in the order they were sent,
whichever stages they come from, which is what lets the transport match them without tags or
metadata per stage.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence, Tuple

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedule._gc import gc_paused
from lightning_pipe.schedule.action import COMPUTE_KINDS, B, F, I, W, Action, format_rows
from lightning_pipe.schedule.draw import format_table
from lightning_pipe.schedule.lower import is_lowered, lower_placed
from lightning_pipe.schedule.simulate import MESSAGE_OF, SENDS, SimulationResult, _run, simulate

__all__ = ["SimulationResult", "format_rows", "format_table", "simulate", "validate"]

# the compute action that produces (sends) or consumes (receives) each message, I counting as B
_COMPUTE_OF = {"F": F, "B": B, "S": F, "G": B}
_DEFAULT_COSTS = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}  # simulate()'s; only order matters for validation
_COMPUTE = frozenset(COMPUTE_KINDS)


def _first_pass(tables: tuple) -> tuple:
    """Index the compute actions (by position in their row) and find what one look at each shows."""
    seen: dict = {}
    errors: list = []
    for r, row in enumerate(tables):
        for j, a in enumerate(row):
            kind = a[0]
            if kind not in _COMPUTE:
                continue
            if a[3] is not None:
                a = Action(kind, a[1], a[2])
            size = len(seen)
            seen[a] = j
            if len(seen) == size:
                errors.append((r, j, f"{a} appears twice"))
            if kind == F:
                continue
            s, i = a[1], a[2]
            if kind == W:
                if (I, s, i, None) not in seen:
                    errors.append((r, j, f"{a} runs before its input gradient {Action(I, s, i)}"))
                continue
            if (F, s, i, None) not in seen:
                errors.append((r, j, f"{a} runs before its forward"))
            if ((B if kind == I else I), s, i, None) in seen:
                errors.append((r, j, f"{Action(B, s, i)} and {Action(I, s, i)} both appear: a backward is "
                                     "either one B, or one I and one W"))
    return seen, errors


def _owners(tables: tuple) -> tuple:
    """The rank of each stage (the first row that holds it), and an error per action of it elsewhere."""
    owner: dict = {}
    split = set()
    for r, row in enumerate(tables):
        for s in {a[1] for a in row if a[0] in _COMPUTE}:
            if owner.setdefault(s, r) != r:
                split.add(s)
    errors = [(r, j, f"stage {a[1]} runs on rank {owner[a[1]]} and on rank {r}")
              for r, row in enumerate(tables) if split for j, a in enumerate(row)
              if a[0] in _COMPUTE and a[1] in split and owner[a[1]] != r]
    return owner, errors


def _complete(seen: dict, owner: dict) -> bool:
    """Whether every stage and microbatch has its forward and backward: counted, so it is fast."""
    if not seen or sorted(owner) != list(range(len(owner))):
        return False
    count = Counter(a[0] for a in seen)
    grid = len(owner) * (1 + max(a[2] for a in seen))
    backwards = count[B] + count[I]
    return count[F] == grid and backwards in (0, grid) and count[W] == count[I]


def _missing(seen: dict, owner: dict, tables: tuple) -> list:
    """The forwards and backwards that no row holds, marked at the end of the stage's row."""
    errors = []
    stages = sorted(owner)
    microbatches = sorted({key[2] for key in seen})
    if stages != list(range(len(stages))) or microbatches != list(range(len(microbatches))):
        return [(None, None, f"stages {stages} and microbatches {microbatches} must count from 0 without gaps")]
    kinds = {key[0] for key in seen}
    split = I in kinds or W in kinds
    for s in stages:
        end = (owner[s], len(tables[owner[s]]))
        for i in microbatches:
            needed = [F]
            if (B, s, i, None) not in seen and (kinds - {F}):
                needed += [I, W] if split or (I, s, i, None) in seen else [B]
            errors.extend((*end, f"{Action(kind, s, i)} is missing") for kind in needed if (kind, s, i, None) not in seen)
    return errors


def _same_rank_order(seen: dict, owner: dict) -> list:
    """A stage that takes its input from a stage on the same rank must run after it in the row."""
    errors = []
    num_microbatches = 1 + max((key[2] for key in seen), default=-1)
    for s in range(1, len(owner)):
        if owner[s] != owner[s - 1]:
            continue
        for i in range(num_microbatches):
            for consumer, producer, what in (
                (Action(F, s, i), Action(F, s - 1, i), "output"),
                (_backward_of(seen, s - 1, i), _backward_of(seen, s, i), "input gradient"),
            ):
                if consumer in seen and producer in seen and seen[consumer] < seen[producer]:
                    errors.append((owner[s], seen[consumer], f"{consumer} runs before {producer}, "
                                                              f"whose {what} it takes on the same rank"))
    return errors


def _backward_of(seen: dict, s: int, i: int) -> Action:
    return Action(I, s, i) if (I, s, i, None) in seen else Action(B, s, i)


def _check_compute(tables: tuple) -> tuple:
    """Check the compute actions; return each stage's rank."""
    seen, errors = _first_pass(tables)
    owner, split = _owners(tables)
    errors = split + errors
    if errors or not _complete(seen, owner):
        errors += _missing(seen, owner, tables)
    if not errors:
        errors = _same_rank_order(seen, owner)
    if errors:
        _raise(tables, errors)
    return tuple(owner[s] for s in range(len(owner)))


def _check_links(tables: tuple, ranks: tuple) -> None:
    """Every receive has its send, in the same order on both ends of each link."""
    last = len(ranks) - 1
    sent: dict = {}
    received: dict = {}
    errors = []
    for r, row in enumerate(tables):
        done = set()
        recvs = set()
        for j, a in enumerate(row):
            kind, s, i = a.kind, a.stage_index, a.microbatch_index
            if kind in COMPUTE_KINDS:
                done.add((B if kind == I else kind, s, i))
                continue
            if a.peer is None or not 0 <= a.peer <= last:
                errors.append((r, j, f"{a} names stage {a.peer}, which no rank runs"))
                continue
            if ranks[a.peer] == r:
                errors.append((r, j, f"{a} names stage {a.peer} on the same rank: a same-rank hand-off has no message"))
                continue
            message = MESSAGE_OF[kind]
            if kind in SENDS:
                compute = _COMPUTE_OF[message]
                if (compute, s, i) not in done:
                    errors.append((r, j, f"{a} sends before {Action(compute, s, i)} ran"))
                sent.setdefault((message, r, ranks[a.peer]), []).append(((s, a.peer, i), r, j))
            else:
                compute = _COMPUTE_OF[message]
                if (compute, s, i) in done:
                    errors.append((r, j, f"{a} receives the input of {Action(compute, s, i)} after it ran"))
                recvs.add((compute, s, i))
                received.setdefault((message, ranks[a.peer], r), []).append(((a.peer, s, i), r, j))
        for j, a in enumerate(row):
            if a.kind in (F, B, I):
                s = a.stage_index
                neighbour = s - 1 if a.kind == F else s + 1
                needs_input = 0 <= neighbour <= last and ranks[neighbour] != r
                if needs_input and (B if a.kind == I else a.kind, s, a.microbatch_index) not in recvs:
                    errors.append((r, j, f"{a} runs without receiving its input"))
    errors += _unmatched(sent, received)
    if errors:
        _raise(tables, errors)


def _unmatched(sent: dict, received: dict) -> list:
    errors = []
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
    return errors


def _raise(tables: tuple, errors: list) -> None:
    lines = [
        f"- rank {r}, action {j}: {msg}" if r is not None and j < len(tables[r]) else f"- {msg}"
        for r, j, msg in errors[:20]
    ]
    if len(errors) > 20:
        lines.append(f"- ... and {len(errors) - 20} more")
    marks = {r: j for r, j, _ in reversed(errors) if r is not None}
    raise ScheduleError("invalid schedule:\n" + "\n".join(lines) + "\n" + format_rows(tables, marks))


@gc_paused
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
    ranks = _check_compute(tables)
    if is_lowered(tables):  # written by hand: check every send and receive against its compute action
        _check_links(tables, ranks)
        _run(tables, _DEFAULT_COSTS, 0.0, ranks, False)
        return tables
    # lowered here, so each compute action has its receives right before it and its sends right
    # after; what is left to prove is that messages meet in order and nothing deadlocks
    lowered = lower_placed(tables, ranks, routes)
    _run(lowered, _DEFAULT_COSTS, 0.0, ranks, True)
    return lowered
