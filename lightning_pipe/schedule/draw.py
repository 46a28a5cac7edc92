"""Draw a schedule table as a timeline, one line per rank."""

from __future__ import annotations

from typing import Optional

from lightning_pipe.schedule.action import B, F, I, W
from lightning_pipe.schedule.simulate import simulate


def format_table(
    tables: tuple,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
    *,
    input_cost: Optional[float] = None,
    weight_cost: Optional[float] = None,
) -> str:
    """Draw a table as a timeline, one row per rank, ``..`` where a rank waits.

    By default every compute action takes one slot (``I`` and ``W`` cost ``backward_cost`` unless
    given). A row holding one stage shows ``F3``; when some rank holds several stages, every
    action shows its stage too (``4F3``), so that interleaved and V tables stay readable.

    Example:
        >>> from lightning_pipe.schedule import one_f_one_b, zb_h1
        >>> print(format_table(one_f_one_b(2, 3)))
        rank 0: F0 F1 .. B0 F2 B1 .. B2
        rank 1: .. F0 B0 F1 B1 F2 B2 ..
        >>> print(format_table(zb_h1(2, 3)))
        rank 0: F0 F1 .. I0 W0 F2 I1 W1 I2 W2
        rank 1: .. F0 I0 F1 I1 W0 F2 I2 W1 W2
    """
    costs = {F: forward_cost, B: backward_cost,
             I: backward_cost if input_cost is None else input_cost,
             W: backward_cost if weight_cost is None else weight_cost}
    result = simulate(tables, forward_cost, backward_cost, input_cost=costs[I], weight_cost=costs[W])
    compute = [[a for a in row if a.is_compute] for row in tables]
    multi = any(len({a.stage_index for a in row}) > 1 for row in compute)
    labels = [[str(a) if multi else f"{a.kind}{a.microbatch_index}" for a in row] for row in compute]
    width = max((len(t) for row in labels for t in row), default=2)
    used = {a.kind for row in compute for a in row}
    slot = min([forward_cost, backward_cost] + [costs[kind] for kind in (I, W) if kind in used])
    num_slots = int(round(result.makespan / slot))
    lines = []
    for r, row in enumerate(compute):
        cells = ["." * width] * num_slots
        for a, label, start in zip(row, labels[r], result.start_times[r]):
            first = int(round(start / slot))
            for k in range(first, first + int(round(costs[a.kind] / slot))):
                cells[k] = label.ljust(width)
        lines.append(f"rank {r}: " + " ".join(cells))
    return "\n".join(lines)
