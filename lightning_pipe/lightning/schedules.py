"""Which schedules PipeStrategy runs, with how many stages per process, and their ideal bubble.

Checked in the strategy's constructor, on every rank from the same arguments, so a bad
combination fails everywhere before any process group exists.
"""

from __future__ import annotations

from typing import Optional

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.schedule import ALL_SCHEDULES, make_table, simulate


def check_schedule(schedule: str, virtual_stages: Optional[int]) -> int:
    """The stages per rank that ``schedule`` runs with ``virtual_stages``; a named error for what does not fit.

    Example:
        >>> check_schedule("1f1b", None), check_schedule("interleaved_1f1b", 2)
        (1, 2)
    """
    spec = ALL_SCHEDULES.get(schedule)
    if spec is None:
        raise ConfigurationError(f"PipeStrategy(schedule={schedule!r}): choose one of {sorted(ALL_SCHEDULES)}")
    if virtual_stages is not None and (not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool)
                                       or virtual_stages < 1):
        raise ConfigurationError(f"PipeStrategy(virtual_stages={virtual_stages!r}): give a positive integer or None")
    if spec.stages_per_rank is None:  # interleaved: the caller chooses, at least 2
        if virtual_stages is None or virtual_stages < 2:
            raise ConfigurationError(
                f"PipeStrategy(schedule={schedule!r}, virtual_stages={virtual_stages!r}): the schedule runs several "
                "stages per rank; pass virtual_stages >= 2 (e.g. virtual_stages=2), or schedule='1f1b' for one")
        return virtual_stages
    if virtual_stages not in (None, spec.stages_per_rank):
        one = spec.stages_per_rank == 1
        runs = "one stage per rank" if one else f"exactly {spec.stages_per_rank} stages per rank"
        raise ConfigurationError(
            f"PipeStrategy(schedule={schedule!r}, virtual_stages={virtual_stages}): {schedule!r} runs {runs}; for "
            f"{'several' if one else 'another number'} use schedule='interleaved_1f1b', or leave virtual_stages out")
    return spec.stages_per_rank


def ideal_bubble(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: Optional[int] = None) -> float:
    """The schedule's idle fraction when every F, I and W costs the same and messages cost nothing.

    Example:
        >>> round(ideal_bubble("1f1b", 2, 4), 3), round(ideal_bubble("zb_h1", 2, 4), 3)
        (0.2, 0.077)
        >>> round(ideal_bubble("interleaved_1f1b", 2, 4, virtual_stages=2), 3)
        0.111
    """
    return simulate(make_table(schedule, num_ranks, num_microbatches, virtual_stages)).bubble_fraction
