"""Interleaved 1F1B: ``v`` stages per rank, in Megatron-LM's order (Narayanan et al., 2021).

Legend: ``p`` ranks, ``v`` stages per rank (``virtual_stages``), ``m`` microbatches. The model is
cut into ``v * p`` stages and stage ``s`` runs on rank ``s % p`` (the "loop" placement), so each
microbatch goes round the ranks ``v`` times. Each rank runs its forwards in one fixed order:
microbatches are taken in groups of about ``p``; inside a group, every microbatch goes through
the rank's first stage, then every one through its second stage, and so on (depth first).
Backwards follow the same order with the stages reversed. Rank ``r`` first runs
``2 * (p - 1 - r) + (v - 1) * g`` forwards (``g`` the first group's size), then alternates one
forward and one backward, then drains its backwards.

**Microbatch counts.** Megatron-LM requires ``m % p == 0`` (groups of exactly ``p``); then this is
its table. Here any ``m`` works: ``max(1, m // p)`` groups that differ in size by at most one,
larger groups first (a group smaller than the first would make a backward run before its
forward). One difference from Megatron-LM: with ``m == p`` it runs all forwards first on every
rank; here the steady phase is kept, for the same bubble and less memory.

**Bubble.** With ``F`` and ``B`` of one stage each costing 1 (a rank's whole share of the model
costing ``v`` each way), the makespan is ``2 * (v * m + p - 1)`` for ``m >= p``: a bubble of
``(p - 1) / (v * m + p - 1)``, ``v`` times less idle time than 1F1B. For ``m < p`` the first
microbatch comes back round to rank 0 before the rank has other work, and the makespan is
``2 * (v * p + m - 1)``, still no more than 1F1B's ``2 * v * (m + p - 1)``.
"""

from __future__ import annotations

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.schedule._checks import check_positive
from lightning_pipe.schedule._gc import gc_paused
from lightning_pipe.schedule.action import B, F, Action


def microbatch_groups(num_ranks: int, num_microbatches: int) -> list:
    """Split microbatches into ``max(1, num_microbatches // num_ranks)`` groups, larger ones first.

    Example:
        >>> microbatch_groups(4, 10)
        [range(0, 5), range(5, 10)]
        >>> microbatch_groups(4, 11)
        [range(0, 6), range(6, 11)]
    """
    count = max(1, num_microbatches // num_ranks)
    size, extra = divmod(num_microbatches, count)
    groups, start = [], 0
    for k in range(count):
        stop = start + size + (k < extra)
        groups.append(range(start, stop))
        start = stop
    return groups


@gc_paused
def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int) -> tuple:
    """Return interleaved 1F1B's compute actions, one tuple per rank (stage ``s`` on rank ``s % p``).

    Raises:
        ConfigurationError: an argument is not a positive integer, or ``virtual_stages < 2``.

    Example:
        >>> for row in interleaved_1f1b(2, 4, 2): print(" ".join(map(str, row)))
        0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
        1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
    """
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches, virtual_stages=virtual_stages)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if v < 2:
        raise ConfigurationError(
            f"interleaved_1f1b needs virtual_stages >= 2 (stages per rank), got {v}; "
            "for one stage per rank use one_f_one_b"
        )
    groups = microbatch_groups(p, m)
    # (chunk, microbatch) in the order each rank runs its forwards; chunk c of rank r is stage c*p + r
    order = [(c, i) for group in groups for c in range(v) for i in group]
    total = v * m
    tables = []
    for r in range(p):
        warmup = min(2 * (p - 1 - r) + (v - 1) * len(groups[0]), total)
        forwards = [Action(F, c * p + r, i) for c, i in order]
        backwards = [Action(B, (v - 1 - c) * p + r, i) for c, i in order]
        row = forwards[:warmup]
        for j in range(total - warmup):
            row.append(forwards[warmup + j])
            row.append(backwards[j])
        row.extend(backwards[total - warmup:])
        tables.append(tuple(row))
    return tuple(tables)
