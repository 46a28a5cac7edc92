"""Schedules at a glance: ``python -m lightning_pipe.schedule show <schedule> --stages P --microbatches M``.

Prints the schedule's table as :func:`~lightning_pipe.schedule.format_table` draws it, then what
:func:`~lightning_pipe.schedule.simulate` finds under the same costs: the makespan, the bubble and
the peak of microbatches in flight per rank; ``--png FILE`` also draws the plan (needs matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from lightning_pipe.errors import ConfigurationError, PipelineError
from lightning_pipe.schedule import SCHEDULES, format_table, simulate


def schedule_tables(name: str, num_stages: int, num_microbatches: int, virtual_stages: Optional[int] = None) -> tuple:
    """The compute table of schedule ``name``: the one place ``show`` looks schedules up.

    Raises:
        ConfigurationError: an unknown name, or virtual stages for a schedule without them.

    Example:
        >>> schedule_tables("gpipe", 2, 1)
        ((0F0, 0B0), (1F0, 1B0))
    """
    if name not in SCHEDULES:
        raise ConfigurationError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if virtual_stages not in (None, 1):
        raise ConfigurationError(
            f"schedule {name!r} runs one stage per rank, so --virtual-stages {virtual_stages} does not apply; "
            "leave it out or pass 1"
        )
    return SCHEDULES[name](num_stages, num_microbatches)


def show(name: str, num_stages: int, num_microbatches: int, virtual_stages: Optional[int] = None,
         forward_cost: float = 1.0, backward_cost: float = 1.0, png: Optional[str] = None) -> str:
    """The text ``show`` prints (and the PNG it writes when ``png`` names a file).

    Example:
        >>> print(show("1f1b", 2, 3))
        rank 0: F0 F1 .. B0 F2 B1 .. B2
        rank 1: .. F0 B0 F1 B1 F2 B2 ..
        <BLANKLINE>
        1f1b, 2 stages, 3 microbatches, forward 1, backward 1:
          makespan 8, bubble 25.0%
          peak in-flight microbatches per rank: 2 1
    """
    tables = schedule_tables(name, num_stages, num_microbatches, virtual_stages)
    result = simulate(tables, forward_cost, backward_cost)
    lines = [
        format_table(tables, forward_cost, backward_cost),
        "",
        f"{name}, {num_stages} stages, {num_microbatches} microbatches, forward {forward_cost:g}, "
        f"backward {backward_cost:g}:",
        f"  makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}",
        "  peak in-flight microbatches per rank: " + " ".join(map(str, result.peak_in_flight)),
    ]
    if png:
        from lightning_pipe.timeline import save_schedule_png

        title = f"{name}: {num_stages} stages, {num_microbatches} microbatches, bubble {result.bubble_fraction:.1%}"
        save_schedule_png(tables, png, forward_cost, backward_cost, title)
        lines.append(f"  picture: {png}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.schedule", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("show", help="print a schedule's table, bubble and peak in-flight microbatches")
    cmd.add_argument("schedule", help=f"one of {', '.join(sorted(SCHEDULES))}")
    cmd.add_argument("--stages", type=int, required=True, help="num_stages (P)")
    cmd.add_argument("--microbatches", type=int, required=True, help="num_microbatches (M)")
    cmd.add_argument("--virtual-stages", type=int, default=None, help="stages per rank (interleaved schedules)")
    cmd.add_argument("--forward-cost", type=float, default=1.0, help="time of one forward (default 1)")
    cmd.add_argument("--backward-cost", type=float, default=1.0,
                     help="time of one backward (default 1, as in the table; 2 is closer to real models)")
    cmd.add_argument("--png", metavar="FILE", default=None, help="also draw the plan into FILE (needs matplotlib)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        print(show(args.schedule, args.stages, args.microbatches, args.virtual_stages,
                   args.forward_cost, args.backward_cost, args.png))
    except (PipelineError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
