"""Lowering: add the communication that a table of compute actions implies.

After lowering, each rank's row says exactly what to receive, compute and send, in order, so the
executor only follows the row. Rules, for stage ``s`` of ``num_stages``:

* before ``sFi`` on ``s > 0``: receive microbatch ``i``'s activations from ``s - 1`` (``sRFi@s-1``)
* after ``sFi`` on ``s < last``: send them on to ``s + 1`` (``sSFi@s+1``)
* before ``sBi`` on ``s < last``: receive their gradients from ``s + 1`` (``sRBi@s+1``)
* after ``sBi`` on ``s > 0``: send the input gradients back to ``s - 1`` (``sSBi@s-1``)
"""

from __future__ import annotations

from lightning_pipe.errors import ScheduleError
from lightning_pipe.schedule.action import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action


def num_stages_of(tables: tuple) -> int:
    """The number of stages that a table's compute actions name."""
    return max((a.stage_index for row in tables for a in row if a.kind in (F, B)), default=-1) + 1


def is_lowered(tables: tuple) -> bool:
    """Whether a table already holds communication actions."""
    return any(a.kind not in (F, B) for row in tables for a in row)


def lower(tables: tuple) -> tuple:
    """Return ``tables`` with the send/receive actions that its compute actions imply.

    Example:
        >>> from lightning_pipe.schedule import gpipe
        >>> lower(gpipe(2, 1))
        ((0F0, 0SF0@1, 0RB0@1, 0B0), (1RF0@0, 1F0, 1B0, 1SB0@0))
    """
    if is_lowered(tables):
        raise ScheduleError("lower() takes a table of compute actions only; this one is lowered already")
    last = num_stages_of(tables) - 1
    new = tuple.__new__  # Action(...) without NamedTuple's argument handling: lowering is hot
    lowered = []
    for row in tables:
        out = []
        append = out.append
        for a in row:
            kind, s, i = a.kind, a.stage_index, a.microbatch_index
            if kind == F:
                if s > 0:
                    append(new(Action, (RECV_F, s, i, s - 1)))
                append(a)
                if s < last:
                    append(new(Action, (SEND_F, s, i, s + 1)))
            elif kind == B:
                if s < last:
                    append(new(Action, (RECV_B, s, i, s + 1)))
                append(a)
                if s > 0:
                    append(new(Action, (SEND_B, s, i, s - 1)))
            else:  # pragma: no cover - guarded by is_lowered
                raise ScheduleError(f"unexpected action {a} in a compute table")
        lowered.append(tuple(out))
    return tuple(lowered)
