"""The 1F1B schedule (PipeDream-flush, Narayanan et al., 2021).

Stage ``s`` runs ``w = min(num_stages - s - 1, num_microbatches)`` warm-up forwards, then
alternates one forward and one backward, then drains the remaining ``w`` backwards. At most
``min(num_stages - s, num_microbatches)`` microbatches are in flight on stage ``s`` (GPipe holds all
``num_microbatches``), for the same bubble. ``num_microbatches < num_stages`` is allowed.
"""

from __future__ import annotations

from lightning_pipe.schedule._checks import check_grid
from lightning_pipe.schedule._gc import gc_paused
from lightning_pipe.schedule.action import B, F, Action


@gc_paused
def one_f_one_b(num_stages: int, num_microbatches: int) -> tuple:
    """Return 1F1B's compute actions, one tuple per rank (rank ``s`` runs stage ``s``).

    Example:
        >>> one_f_one_b(2, 3)
        ((0F0, 0F1, 0B0, 0F2, 0B1, 0B2), (1F0, 1B0, 1F1, 1B1, 1F2, 1B2))
    """
    check_grid(num_stages, num_microbatches)
    m = num_microbatches
    tables = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, m)
        row = [Action(F, s, i) for i in range(warmup)]
        for i in range(m - warmup):
            row.append(Action(F, s, warmup + i))
            row.append(Action(B, s, i))
        row.extend(Action(B, s, i) for i in range(m - warmup, m))
        tables.append(tuple(row))
    return tuple(tables)
