"""Pipeline schedules as data: generators, lowering, validation, simulation and drawing."""

from lightning_pipe.schedule.action import Action, format_rows, parse_table
from lightning_pipe.schedule.draw import format_table
from lightning_pipe.schedule.gpipe import gpipe, gpipe_forward
from lightning_pipe.schedule.grouped import grouped_deadlock
from lightning_pipe.schedule.interleaved import interleaved_1f1b
from lightning_pipe.schedule.lower import lower
from lightning_pipe.schedule.one_f_one_b import one_f_one_b
from lightning_pipe.schedule.placement import placement, stage_ranks
from lightning_pipe.schedule.registry import ALL_SCHEDULES, ScheduleSpec, forward_only, make_table
from lightning_pipe.schedule.simulate import SimulationResult, simulate
from lightning_pipe.schedule.validate import validate
from lightning_pipe.schedule.zero_bubble import zb_h1, zb_h2, zbv

# the one-stage-per-rank schedules with a whole backward, (num_stages, num_microbatches) -> table;
# the executor runs every schedule in ALL_SCHEDULES (see lightning_pipe.Pipeline)
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}

__all__ = [
    "ALL_SCHEDULES",
    "SCHEDULES",
    "Action",
    "ScheduleSpec",
    "SimulationResult",
    "format_rows",
    "format_table",
    "forward_only",
    "gpipe",
    "gpipe_forward",
    "grouped_deadlock",
    "interleaved_1f1b",
    "lower",
    "make_table",
    "one_f_one_b",
    "parse_table",
    "placement",
    "simulate",
    "stage_ranks",
    "validate",
    "zb_h1",
    "zb_h2",
    "zbv",
]
