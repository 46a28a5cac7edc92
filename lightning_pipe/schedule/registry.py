"""Every schedule this package can generate, by name, built through one call.

``ALL_SCHEDULES`` maps a name to a :class:`ScheduleSpec`; :func:`make_table` builds any of them from
``(num_ranks, num_microbatches, virtual_stages)``, checking that ``virtual_stages`` fits the
schedule, and :func:`forward_only` derives the evaluation table of the same placement.
``SCHEDULES`` (in the package) stays the subset the executor runs today.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.schedule._checks import check_positive
from lightning_pipe.schedule.action import F
from lightning_pipe.schedule.gpipe import gpipe
from lightning_pipe.schedule.interleaved import interleaved_1f1b
from lightning_pipe.schedule.one_f_one_b import one_f_one_b
from lightning_pipe.schedule.placement import placement
from lightning_pipe.schedule.zero_bubble import zb_h1, zb_h2, zbv


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule's generator and the facts a caller needs before building it.

    Attributes:
        name: the registry name.
        generator: ``(num_ranks, num_microbatches[, virtual_stages]) -> table``.
        placement: ``"loop"`` or ``"v"`` (see :mod:`~lightning_pipe.schedule.placement`).
        stages_per_rank: the fixed number of stages per rank, or None when the caller chooses it
            with ``virtual_stages``.
        split_backward: whether the table splits backwards into ``I`` and ``W``.
        runs_on_nccl: whether the NCCL transport runs it. It issues the sends and receives between
            two compute actions as one group; under the schedules marked False, two ranks' groups
            can each wait for the other's (a deadlock once messages outgrow NCCL's buffers), as
            :func:`~lightning_pipe.schedule.grouped.grouped_deadlock` finds.
    """

    name: str
    generator: Callable[..., tuple]
    placement: str
    stages_per_rank: Optional[int]
    split_backward: bool
    runs_on_nccl: bool = True

    def virtual_stages(self, virtual_stages: Optional[int] = None) -> int:
        """Return the number of stages per rank, checking a requested ``virtual_stages``."""
        fixed = self.stages_per_rank
        if fixed is None:
            if virtual_stages is None:
                raise ConfigurationError(
                    f"schedule {self.name!r} needs virtual_stages (stages per rank, at least 2), e.g. virtual_stages=2"
                )
            check_positive(virtual_stages=virtual_stages)
            return virtual_stages
        if virtual_stages is not None and virtual_stages != fixed:
            raise ConfigurationError(
                f"schedule {self.name!r} runs exactly {fixed} stage{'s' if fixed > 1 else ''} per rank, "
                f"got virtual_stages={virtual_stages!r}; leave virtual_stages out or pass {fixed}"
            )
        return fixed

    def nccl_refusal(self) -> str:
        """Why the NCCL transport does not run this schedule, with what to do instead."""
        runnable = [repr(name) for name, spec in ALL_SCHEDULES.items() if spec.runs_on_nccl]
        return (f"schedule {self.name!r} does not run over NCCL yet: the NCCL transport issues the sends and receives "
                "between two compute actions as one group, and under this schedule two ranks' groups can each wait "
                f"for the other's; use a gloo process group, or {', '.join(runnable[:-1])} or {runnable[-1]}")

    def stage_ranks(self, num_ranks: int, virtual_stages: Optional[int] = None) -> tuple:
        """Return the rank of each stage, without building the table.

        Example:
            >>> ALL_SCHEDULES["interleaved_1f1b"].stage_ranks(2, virtual_stages=3)
            (0, 1, 0, 1, 0, 1)
        """
        check_positive(num_ranks=num_ranks)
        return placement(self.placement, num_ranks, num_ranks * self.virtual_stages(virtual_stages))


ALL_SCHEDULES = {
    "gpipe": ScheduleSpec("gpipe", gpipe, "loop", 1, False),
    "1f1b": ScheduleSpec("1f1b", one_f_one_b, "loop", 1, False),
    "interleaved_1f1b": ScheduleSpec("interleaved_1f1b", interleaved_1f1b, "loop", None, False, runs_on_nccl=False),
    "zb_h1": ScheduleSpec("zb_h1", zb_h1, "loop", 1, True),
    "zb_h2": ScheduleSpec("zb_h2", zb_h2, "loop", 1, True, runs_on_nccl=False),
    "zbv": ScheduleSpec("zbv", zbv, "v", 2, True, runs_on_nccl=False),
}


def make_table(name: str, num_ranks: int, num_microbatches: int, virtual_stages: Optional[int] = None) -> tuple:
    """Build the named schedule's compute table, one tuple of actions per rank.

    Raises:
        ConfigurationError: an unknown name, or ``virtual_stages`` that the schedule does not take.

    Example:
        >>> make_table("1f1b", 2, 2)
        ((0F0, 0F1, 0B0, 0B1), (1F0, 1B0, 1F1, 1B1))
        >>> len(make_table("interleaved_1f1b", 2, 4, virtual_stages=2)[0])
        16
    """
    if name not in ALL_SCHEDULES:
        raise ConfigurationError(f"unknown schedule {name!r}: choose one of {sorted(ALL_SCHEDULES)}")
    spec = ALL_SCHEDULES[name]
    v = spec.virtual_stages(virtual_stages)
    if spec.stages_per_rank is None:
        return spec.generator(num_ranks, num_microbatches, v)
    return spec.generator(num_ranks, num_microbatches)


def forward_only(tables: tuple) -> tuple:
    """Keep only the forwards of a table, in row order: evaluation on the same stage placement.

    Dropping backwards only removes waits, so a valid table stays valid. Of a 1F1B table this is
    ``gpipe_forward``'s.

    Example:
        >>> forward_only(make_table("zbv", 2, 2))
        ((0F0, 0F1, 3F0, 3F1), (1F0, 2F0, 1F1, 2F1))
    """
    return tuple(tuple(a for a in row if a.kind == F) for row in tables)
