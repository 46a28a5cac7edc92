"""Schedules at a glance: ``python -m lightning_pipe.schedule show|compare ...``.

``show <schedule> --stages P --microbatches M`` prints the schedule's table as
:func:`~lightning_pipe.schedule.format_table` draws it, then what
:func:`~lightning_pipe.schedule.simulate` finds under the same costs: the makespan, the bubble and
the peak of microbatches in flight per rank; ``--png FILE`` also draws the plan (needs matplotlib).

``compare --stages P --microbatches M`` simulates every schedule for the same model and batch
(costs per rank's share of the model, a message latency if given) and prints one line each: the
makespan, the bubble and the activations the busiest rank holds, to choose a schedule with.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from lightning_pipe.errors import ConfigurationError, PipelineError
from lightning_pipe.schedule import ALL_SCHEDULES, format_table, make_table, simulate


def schedule_tables(name: str, num_stages: int, num_microbatches: int, virtual_stages: Optional[int] = None) -> tuple:
    """The compute table of schedule ``name``: the one place ``show`` looks schedules up.

    ``num_stages`` counts ranks; schedules with several stages per rank place ``virtual_stages``
    (interleaved 1F1B) or two (ZB-V) on each.

    Raises:
        ConfigurationError: an unknown name, or virtual stages the schedule does not take.

    Example:
        >>> schedule_tables("gpipe", 2, 1)
        ((0F0, 0B0), (1F0, 1B0))
    """
    return make_table(name, num_stages, num_microbatches, virtual_stages)


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
          peak activations per rank (microbatches through its share): 2 1
    """
    tables = schedule_tables(name, num_stages, num_microbatches, virtual_stages)
    # as format_table draws them: I and W take one backward's time each
    result = simulate(tables, forward_cost, backward_cost, input_cost=backward_cost, weight_cost=backward_cost)
    lines = [
        format_table(tables, forward_cost, backward_cost),
        "",
        f"{name}, {num_stages} stages, {num_microbatches} microbatches, forward {forward_cost:g}, "
        f"backward {backward_cost:g}:",
        f"  makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}",
        # a rank holding v stages keeps 1/v of its share per (stage, microbatch): as compare and the summary count
        "  peak activations per rank (microbatches through its share): "
        + " ".join(f"{m:g}" for m in result.peak_memory),
    ]
    if png:
        from lightning_pipe.timeline import save_schedule_png

        title = f"{name}: {num_stages} stages, {num_microbatches} microbatches, bubble {result.bubble_fraction:.1%}"
        save_schedule_png(tables, png, forward_cost, backward_cost, title)
        lines.append(f"  picture: {png}")
    return "\n".join(lines)


def compare(num_stages: int, num_microbatches: int, virtual_stages: int = 2, forward_cost: float = 1.0,
            backward_cost: float = 2.0, comm_cost: float = 0.0) -> str:
    """The text ``compare`` prints: every schedule simulated for the same model, batch and costs.

    ``forward_cost`` and ``backward_cost`` are one microbatch's through a rank's share of the model
    (a rank holding ``v`` stages spends ``1 / v`` of them per stage; a split backward's ``I`` and ``W``
    take half each); ``comm_cost`` is each message's latency. Peak activations are in microbatches
    through a rank's share, on the busiest rank.

    Example:
        >>> print(compare(2, 4, comm_cost=0.5))
        2 stages, 4 microbatches, forward 1, backward 2, message latency 0.5 (interleaved_1f1b: 2 stages per rank)
        schedule          stages/rank  makespan  bubble  peak activations
        1f1b                        1        17   29.4%                 2
        gpipe                       1        16   25.0%                 4
        interleaved_1f1b            2      16.5   27.3%               2.5
        zb_h1                       1        15   20.0%                 2
        zb_h2                       1      13.5   11.1%                 3
        zbv                         2        15   20.0%                 2
    """
    lines = [f"{num_stages} stages, {num_microbatches} microbatches, forward {forward_cost:g}, backward "
             f"{backward_cost:g}, message latency {comm_cost:g} (interleaved_1f1b: {virtual_stages} stages per rank)",
             f"{'schedule':<17} {'stages/rank':>11} {'makespan':>9} {'bubble':>7} {'peak activations':>17}"]
    for name in sorted(ALL_SCHEDULES):
        spec = ALL_SCHEDULES[name]
        chosen = virtual_stages if spec.stages_per_rank is None else None  # the others fix their stages per rank
        v = spec.virtual_stages(chosen)
        result = simulate(make_table(name, num_stages, num_microbatches, chosen), forward_cost / v, backward_cost / v,
                          comm_cost)
        lines.append(f"{name:<17} {v:>11} {result.makespan:>9g} {result.bubble_fraction:>7.1%} "
                     f"{max(result.peak_memory):>17g}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.schedule", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("show", help="print a schedule's table, bubble and peak activations")
    cmd.add_argument("schedule", help=f"one of {', '.join(sorted(ALL_SCHEDULES))}")
    cmd.add_argument("--stages", type=int, required=True, help="num_stages (P)")
    cmd.add_argument("--microbatches", type=int, required=True, help="num_microbatches (M)")
    cmd.add_argument("--virtual-stages", type=int, default=None, help="stages per rank (interleaved_1f1b)")
    cmd.add_argument("--forward-cost", type=float, default=1.0, help="time of one forward (default 1)")
    cmd.add_argument("--backward-cost", type=float, default=1.0,
                     help="time of one backward, and of each of its halves I and W (default 1, as in the table)")
    cmd.add_argument("--png", metavar="FILE", default=None, help="also draw the plan into FILE (needs matplotlib)")
    cmd = commands.add_parser("compare", help="every schedule's simulated makespan, bubble and peak activations")
    cmd.add_argument("--stages", type=int, required=True, help="num_stages (P): ranks")
    cmd.add_argument("--microbatches", type=int, required=True, help="num_microbatches (M)")
    cmd.add_argument("--virtual-stages", type=int, default=2, help="stages per rank of interleaved_1f1b (default 2)")
    cmd.add_argument("--forward-cost", type=float, default=1.0,
                     help="one microbatch's forward through a rank's share of the model (default 1)")
    cmd.add_argument("--backward-cost", type=float, default=2.0,
                     help="its whole backward (default 2); split into I and W, each takes half (unlike show's drawing)")
    cmd.add_argument("--comm-cost", type=float, default=0.0, help="each message's latency (default 0)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "compare":
            print(compare(args.stages, args.microbatches, args.virtual_stages, args.forward_cost, args.backward_cost,
                          args.comm_cost))
        else:
            print(show(args.schedule, args.stages, args.microbatches, args.virtual_stages,
                       args.forward_cost, args.backward_cost, args.png))
    except (PipelineError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
