"""Which schedules PipeStrategy runs, with how many stages per process, and their ideal bubble and memory.

Checked in the strategy's constructor, on every rank from the same arguments, so a bad
combination fails everywhere before any process group exists.
"""

from __future__ import annotations

from typing import Optional

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.schedule import ALL_SCHEDULES, SimulationResult, make_table, simulate


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


def ideal(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: Optional[int] = None) -> SimulationResult:
    """The schedule simulated with every F, I and W costing the same and free messages.

    Its ``bubble_fraction`` is the schedule's ideal bubble; ``max(peak_memory)`` the activations the
    busiest process holds at its peak, in microbatches through all of a process's layers.

    Example:
        >>> round(ideal("1f1b", 2, 4).bubble_fraction, 3), round(ideal("zb_h1", 2, 4).bubble_fraction, 3)
        (0.2, 0.077)
        >>> round(ideal("interleaved_1f1b", 2, 4, virtual_stages=2).bubble_fraction, 3)
        0.111
        >>> max(ideal("1f1b", 2, 4).peak_memory), max(ideal("zb_h2", 2, 4).peak_memory)
        (2.0, 3.0)
    """
    return simulate(make_table(schedule, num_ranks, num_microbatches, virtual_stages))
