"""Lowering: add the communication that a table of compute actions implies.

After lowering, each rank's row says exactly what to receive, compute and send, in order, so the
executor only follows the row. Rules, for stage ``s`` of ``num_stages``, where "the backward" is
``sBi`` or, when the backward is split, ``sIi`` (``sWi`` never communicates):

* before ``sFi`` on ``s > 0``: receive microbatch ``i``'s activations from ``s - 1`` (``sRFi@s-1``)
* after ``sFi`` on ``s < last``: send them on to ``s + 1`` (``sSFi@s+1``)
* before the backward on ``s < last``: receive their gradients from ``s + 1`` (``sRBi@s+1``)
* after the backward on ``s > 0``: send the input gradients back to ``s - 1`` (``sSBi@s-1``)

and for each skip route ``(a, b)`` (stage ``a`` stashes tensors that stage ``b`` pops): ``aSSi@b``
after ``aFi``, ``bRSi@a`` before ``bFi``, ``bSGi@a`` after ``b``'s backward and ``aRGi@b`` before
``a``'s backward.

**Same-rank hand-offs.** A message between two stages that run on the same rank (see
:mod:`~lightning_pipe.schedule.placement`: ZB-V's two middle stages on the last rank, or every
stage when there is one rank) is not lowered at all: the row holds no send and no receive for it.
The consumer finds the producer's output locally: ``1F0`` takes what ``0F0`` produced, and ``0I0``
the input gradients that ``1I0`` produced, on the same rank and earlier in the row (``validate``
checks that order). Skip routes between two stages on one rank are not lowered either.
"""

from __future__ import annotations

from typing import Sequence, Tuple

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedule._gc import gc_paused
from lightning_pipe.schedule.action import (
    COMPUTE_KINDS, RECV_B, RECV_F, RECV_SKIP, RECV_SKIP_GRAD, SEND_B, SEND_F, SEND_SKIP, SEND_SKIP_GRAD,
    Action, B, F, I, W,
)
from lightning_pipe.schedule.placement import stage_ranks


def num_stages_of(tables: tuple) -> int:
    """The number of stages that a table's compute actions name."""
    return max((a.stage_index for row in tables for a in row if a.kind in COMPUTE_KINDS), default=-1) + 1


def is_lowered(tables: tuple) -> bool:
    """Whether a table already holds communication actions."""
    return any(a.kind not in COMPUTE_KINDS for row in tables for a in row)


def message_templates(ranks: tuple, routes: Sequence[Tuple[int, int]] = ()) -> dict:
    """Per compute kind and stage, the ``(kind, peer)`` messages to receive before and send after it.

    ``ranks`` is each stage's rank (:func:`~lightning_pipe.schedule.placement.stage_ranks`);
    messages between stages on the same rank are left out. ``templates[kind][stage]`` is a pair
    ``(before, after)``.
    """
    last = len(ranks) - 1
    templates: dict = {F: [], B: [], I: [], W: []}
    for s in range(last + 1):
        rank = ranks[s]
        outgoing = sorted(b for a, b in routes if a == s and ranks[b] != rank)
        incoming = sorted(a for a, b in routes if b == s and ranks[a] != rank)
        previous = [s - 1] if s > 0 and ranks[s - 1] != rank else []
        following = [s + 1] if s < last and ranks[s + 1] != rank else []
        templates[F].append((
            [(RECV_F, p) for p in previous] + [(RECV_SKIP, p) for p in incoming],
            [(SEND_F, p) for p in following] + [(SEND_SKIP, p) for p in outgoing],
        ))
        backward = (
            [(RECV_B, p) for p in following] + [(RECV_SKIP_GRAD, p) for p in outgoing],
            [(SEND_B, p) for p in previous] + [(SEND_SKIP_GRAD, p) for p in incoming],
        )
        templates[B].append(backward)
        templates[I].append(backward)
        templates[W].append(((), ()))
    return templates


@gc_paused
def lower(tables: tuple, routes: Sequence[Tuple[int, int]] = ()) -> tuple:
    """Return ``tables`` with the send/receive actions that its compute actions imply.

    ``routes`` are the (stash stage, pop stage) pairs of skip connections that cross stages.

    Example:
        >>> from lightning_pipe.schedule import gpipe, zbv
        >>> lower(gpipe(2, 1))
        ((0F0, 0SF0@1, 0RB0@1, 0B0), (1RF0@0, 1F0, 1B0, 1SB0@0))
        >>> lower(zbv(1, 1))  # both stages on one rank: nothing to send
        ((0F0, 1F0, 1I0, 0I0, 1W0, 0W0),)
    """
    if is_lowered(tables):
        raise ScheduleError("lower() takes a table of compute actions only; this one is lowered already")
    return lower_placed(tables, stage_ranks(tables), routes)


def lower_placed(tables: tuple, ranks: tuple, routes: Sequence[Tuple[int, int]] = ()) -> tuple:
    """:func:`lower` for a compute table whose stage ranks are known already."""
    for a, b in routes:
        if not (0 <= a < len(ranks) and 0 <= b < len(ranks)):
            raise ScheduleError(f"skip route ({a}, {b}) names a stage that no rank runs (stages 0..{len(ranks) - 1})")
    templates = message_templates(ranks, routes)
    new = tuple.__new__  # Action(...) without NamedTuple's argument handling: lowering is hot
    lowered = []
    for row in tables:
        out = []
        append = out.append
        for a in row:
            before, after = templates[a[0]][a[1]]
            for message, peer in before:
                append(new(Action, (message, a[1], a[2], peer)))
            append(a)
            for message, peer in after:
                append(new(Action, (message, a[1], a[2], peer)))
        lowered.append(tuple(out))
    return tuple(lowered)
