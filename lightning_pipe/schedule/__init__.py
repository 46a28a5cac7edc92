"""Pipeline schedules as data: generators, lowering, validation, simulation and drawing."""

from lightning_pipe.schedule.action import Action, parse_table
from lightning_pipe.schedule.gpipe import gpipe, gpipe_forward
from lightning_pipe.schedule.lower import lower
from lightning_pipe.schedule.one_f_one_b import one_f_one_b
from lightning_pipe.schedule.validate import SimulationResult, format_table, simulate, validate

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}

__all__ = [
    "SCHEDULES",
    "Action",
    "SimulationResult",
    "format_table",
    "gpipe",
    "gpipe_forward",
    "lower",
    "one_f_one_b",
    "parse_table",
    "simulate",
    "validate",
]
