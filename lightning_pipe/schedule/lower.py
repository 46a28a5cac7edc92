"""Lowering: add the communication that a table of compute actions implies.

After lowering, each rank's row says exactly what to receive, compute and send, in order, so the
executor only follows the row. Rules, for stage ``s`` of ``num_stages``:

* before ``sFi`` on ``s > 0``: receive microbatch ``i``'s activations from ``s - 1`` (``sRFi@s-1``)
* after ``sFi`` on ``s < last``: send them on to ``s + 1`` (``sSFi@s+1``)
* before ``sBi`` on ``s < last``: receive their gradients from ``s + 1`` (``sRBi@s+1``)
* after ``sBi`` on ``s > 0``: send the input gradients back to ``s - 1`` (``sSBi@s-1``)

and for each skip route ``(a, b)`` (stage ``a`` stashes tensors that stage ``b`` pops): ``aSSi@b``
after ``aFi``, ``bRSi@a`` before ``bFi``, ``bSGi@a`` after ``bBi`` and ``aRGi@b`` before ``aBi``.
"""

from __future__ import annotations

from lightning_pipe.errors import ScheduleError
from typing import Sequence, Tuple

from lightning_pipe.schedule.action import (
    RECV_B, RECV_F, RECV_SKIP, RECV_SKIP_GRAD, SEND_B, SEND_F, SEND_SKIP, SEND_SKIP_GRAD, Action, B, F,
)


def num_stages_of(tables: tuple) -> int:
    """The number of stages that a table's compute actions name."""
    return max((a.stage_index for row in tables for a in row if a.kind in (F, B)), default=-1) + 1


def is_lowered(tables: tuple) -> bool:
    """Whether a table already holds communication actions."""
    return any(a.kind not in (F, B) for row in tables for a in row)


def lower(tables: tuple, routes: Sequence[Tuple[int, int]] = ()) -> tuple:
    """Return ``tables`` with the send/receive actions that its compute actions imply.

    ``routes`` are the (stash stage, pop stage) pairs of skip connections that cross stages.

    Example:
        >>> from lightning_pipe.schedule import gpipe
        >>> lower(gpipe(2, 1))
        ((0F0, 0SF0@1, 0RB0@1, 0B0), (1RF0@0, 1F0, 1B0, 1SB0@0))
    """
    if is_lowered(tables):
        raise ScheduleError("lower() takes a table of compute actions only; this one is lowered already")
    last = num_stages_of(tables) - 1
    # per stage, the (kind, peer) messages before and after each F and B
    around = {}
    for s in range(last + 1):
        outgoing = sorted(b for a, b in routes if a == s)
        incoming = sorted(a for a, b in routes if b == s)
        around[(F, s)] = (
            [(RECV_F, s - 1)] * (s > 0) + [(RECV_SKIP, p) for p in incoming],
            [(SEND_F, s + 1)] * (s < last) + [(SEND_SKIP, p) for p in outgoing],
        )
        around[(B, s)] = (
            [(RECV_B, s + 1)] * (s < last) + [(RECV_SKIP_GRAD, p) for p in outgoing],
            [(SEND_B, s - 1)] * (s > 0) + [(SEND_SKIP_GRAD, p) for p in incoming],
        )
    new = tuple.__new__  # Action(...) without NamedTuple's argument handling: lowering is hot
    lowered = []
    for row in tables:
        out = []
        append = out.append
        for a in row:
            kind, s, i = a.kind, a.stage_index, a.microbatch_index
            try:
                before, after = around[(kind, s)]
            except KeyError:  # pragma: no cover - guarded by is_lowered
                raise ScheduleError(f"unexpected action {a} in a compute table") from None
            for message, peer in before:
                append(new(Action, (message, s, i, peer)))
            append(a)
            for message, peer in after:
                append(new(Action, (message, s, i, peer)))
        lowered.append(tuple(out))
    return tuple(lowered)
