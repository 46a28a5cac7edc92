"""Pipeline efficiency on CPU: lightning_pipe's GPipe and 1F1B against ideal and against torch.

What it measures. One model, 8 x (Linear(1024, 1024) + ReLU) as an ``nn.Sequential`` of 16
children, split ``balance=[8, 8]`` over 2 stages; batch 256 in ``m = 8`` microbatches of 32,
float32, MSE loss against random targets, gradients zeroed every step and no optimizer. Every
rank process computes on one thread (``torch.set_num_threads(1)``); the ranks talk over gloo and
meet through a FileStore in a temporary directory (no ports). Variants:

* ``sequential``: rank 0 alone runs the 8 microbatches one after another through the whole model
  (forward and backward of each, accumulating gradients) while rank 1 waits in a barrier, so the
  baseline never shares the machine with a computing rank (rank 1's CPU use meanwhile is printed).
* ``ours gpipe`` / ``ours 1f1b``: :class:`lightning_pipe.GPipe` / :class:`lightning_pipe.PipeDream`
  ``forward_backward`` over the 2 ranks.
* ``torch gpipe`` / ``torch 1f1b``: ``torch.distributed.pipelining`` ``PipelineStage`` with
  ``ScheduleGPipe`` / ``Schedule1F1B`` on the same stage modules and the same microbatches.
* ``no-comm`` (reference): both ranks run their own stage's 8 forwards and backwards at the same
  time with no messages: what two busy cores of this machine allow, bubble and transport aside.

Before timing, every pipelined variant's gradients are checked against the sequential baseline's.
The two rank processes stay alive for the whole run: each of R rounds runs every variant (in an
order rotated per round) for W warm-up and K timed steps, a barrier before every step; a step's
time is the slowest rank's. Rounds stop early once ``--max-seconds`` have passed.

How to read it. The table gives the median ms/step over all R x K steps, the quartiles, the
speedup over ``sequential`` and, for our schedules, each rank's median busy fraction
(``Pipeline.last_step.compute_seconds / wall_seconds``). Two stages can at best reach
p * m / (m + p - 1) = 1.778x with busy 0.889: the bubble. The last line is

    efficiency_vs_ideal=<x> vs_torch_pipelining=<y>

with x = (T_seq / (p * T_ours)) / (m / (m + p - 1)) for our faster schedule (1.000: only the bubble
is lost) and y = T_torch / T_ours as the geometric mean of gpipe vs ``ScheduleGPipe`` and 1f1b vs
``Schedule1F1B`` (above 1: we are faster). The line before it gives both numbers computed per
round and then as a median over rounds, which is less sensitive to load that comes and goes.
Another process using the CPU skews everything: the script prints how many cores others used.

Run: ``python benchmarks/pipeline_efficiency.py --quick`` (under 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import resource
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import lightning_pipe
from lightning_pipe import partition

WIDTH = 1024
NUM_BLOCKS = 8  # Linear + ReLU pairs: 16 children
BATCH_SIZE = 256
NUM_MICROBATCHES = 8
NUM_STAGES = 2
BALANCE = [8, 8]
SEED = 0

PIPELINES = ("ours gpipe", "ours 1f1b", "torch gpipe", "torch 1f1b")
ALL_VARIANTS = ("sequential",) + PIPELINES + ("no-comm",)

# A timed step on one rank: (seconds, busy fraction or None).
Sample = Tuple[float, Optional[float]]


def build_model() -> nn.Sequential:
    """The same full model on every rank (seeded)."""
    torch.manual_seed(SEED)
    layers: List[nn.Module] = []
    for _ in range(NUM_BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def make_batch() -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and random targets (seeded, so every rank holds the same)."""
    generator = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(BATCH_SIZE, WIDTH, generator=generator)
    y = torch.randn(BATCH_SIZE, WIDTH, generator=generator)
    return x, y


# -- the variants' steps ------------------------------------------------------------------------
def sequential_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """The baseline: every microbatch through the whole model in turn, gradients accumulated."""
    model.zero_grad(set_to_none=True)
    for x_part, y_part in zip(x.chunk(NUM_MICROBATCHES), y.chunk(NUM_MICROBATCHES)):
        loss = F.mse_loss(model(x_part), y_part) / NUM_MICROBATCHES
        loss.backward()


def ours_step(pipe: lightning_pipe.Pipeline, rank: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """One ``forward_backward``; returns this rank's busy fraction."""
    pipe.module.zero_grad(set_to_none=True)
    if rank == 0:
        pipe.forward_backward(x, criterion=F.mse_loss)
    else:
        pipe.forward_backward(criterion=F.mse_loss, labels=(y,))
    result = pipe.last_step
    return result.compute_seconds / result.wall_seconds


def torch_step(schedule, module: nn.Module, rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """One ``schedule.step``: inputs on the first rank, targets on the last."""
    module.zero_grad(set_to_none=True)
    if rank == 0:
        schedule.step(x, return_outputs=False)
    else:
        schedule.step(target=y, return_outputs=False)


def no_comm_step(stage: nn.Module, rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Reference: this rank's share of the compute with no communication and no bubble.

    Both ranks run it at once, so its time is what two busy cores of this machine allow.
    """
    stage.zero_grad(set_to_none=True)
    for x_part, y_part in zip(x.chunk(NUM_MICROBATCHES), y.chunk(NUM_MICROBATCHES)):
        if rank == 0:
            stage(x_part).backward(y_part)  # y_part stands in for the gradient rank 1 would send
        else:
            F.mse_loss(stage(x_part.detach().requires_grad_()), y_part).backward()


def make_pipeline_steps(rank: int, x: torch.Tensor, y: torch.Tensor) -> Tuple[nn.Module, Dict[str, Callable]]:
    """This rank's stage and every pipelined variant's step on it (all share the one module)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = partition(build_model(), rank, NUM_STAGES, balance=BALANCE)
    gpipe = lightning_pipe.GPipe(stage, chunks=NUM_MICROBATCHES)
    one_f_one_b = lightning_pipe.PipeDream(stage, chunks=NUM_MICROBATCHES)
    torch_stage = PipelineStage(stage, rank, NUM_STAGES, torch.device("cpu"))
    torch_gpipe = ScheduleGPipe(torch_stage, NUM_MICROBATCHES, loss_fn=F.mse_loss)
    torch_1f1b = Schedule1F1B(torch_stage, NUM_MICROBATCHES, loss_fn=F.mse_loss)
    return stage, {
        "ours gpipe": lambda: ours_step(gpipe, rank, x, y),
        "ours 1f1b": lambda: ours_step(one_f_one_b, rank, x, y),
        "torch gpipe": lambda: torch_step(torch_gpipe, stage, rank, x, y),
        "torch 1f1b": lambda: torch_step(torch_1f1b, stage, rank, x, y),
        "no-comm": lambda: no_comm_step(stage, rank, x, y),
    }


def check_gradients(stage: nn.Module, steps: Dict[str, Callable], x: torch.Tensor, y: torch.Tensor) -> float:
    """Check that every pipelined variant computes the baseline's gradients; returns the worst error.

    Each rank compares its own stage's parameters against a full model that runs ``sequential_step``.
    """
    reference = build_model()
    sequential_step(reference, x, y)
    expected = dict(reference.named_parameters())
    worst = 0.0
    for name in PIPELINES:
        dist.barrier()
        steps[name]()
        for key, parameter in stage.named_parameters():
            error = (parameter.grad - expected[key].grad).abs().max().item()
            if not torch.allclose(parameter.grad, expected[key].grad, rtol=1e-4, atol=1e-6):
                raise AssertionError(f"{name} computes other gradients than the baseline: {key} differs by {error}")
            worst = max(worst, error)
    return worst


# -- timing -------------------------------------------------------------------------------------
def time_steps(step: Callable[[], Optional[float]], warmup: int, steps: int) -> List[Sample]:
    """Run ``warmup`` untimed then ``steps`` timed steps, each after a barrier."""
    for _ in range(warmup):
        dist.barrier()
        step()
    samples = []
    for _ in range(steps):
        dist.barrier()
        begin = time.perf_counter()
        busy = step()
        samples.append((time.perf_counter() - begin, busy))
    return samples


def time_sequential(rank: int, model: nn.Module, x, y, warmup: int, steps: int) -> Tuple[List[Sample], float]:
    """Rank 0 runs the baseline while rank 1 waits in a barrier.

    Returns rank 0's samples (empty on rank 1) and the fraction of one core this rank used while
    rank 0 timed the baseline (rank 1's number is the one that matters: it should be near 0).
    """
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    samples = []
    if rank == 0:
        for _ in range(warmup):
            sequential_step(model, x, y)
        for _ in range(steps):
            begin = time.perf_counter()
            sequential_step(model, x, y)
            samples.append((time.perf_counter() - begin, None))
    dist.barrier()
    return samples, (time.process_time() - cpu) / (time.perf_counter() - wall)


def out_of_time(deadline: float) -> bool:
    """Whether rank 0 has passed ``deadline``; every rank gets the same answer."""
    flag = torch.tensor([float(dist.get_rank() == 0 and time.monotonic() > deadline)])
    dist.all_reduce(flag)
    return bool(flag.item())


def run_rounds(rank: int, args: argparse.Namespace) -> Tuple[Dict[str, List[Sample]], List[float], float]:
    """Every variant in every round, the order rotated per round.

    Returns this rank's samples, its CPU use during the baseline and the gradient check's worst
    error. Rounds stop early (whole rounds only) once ``args.max_seconds`` have passed.
    """
    deadline = time.monotonic() + args.max_seconds
    x, y = make_batch()
    stage, pipeline_steps = make_pipeline_steps(rank, x, y)
    gradient_error = check_gradients(stage, pipeline_steps, x, y)
    baseline = build_model() if rank == 0 else None
    samples: Dict[str, List[Sample]] = {name: [] for name in ALL_VARIANTS}
    idle_cpu = []
    for round_index in range(args.rounds):
        shift = round_index % len(ALL_VARIANTS)
        for name in ALL_VARIANTS[shift:] + ALL_VARIANTS[:shift]:
            if name == "sequential":
                got, cpu = time_sequential(rank, baseline, x, y, args.warmup, args.steps)
                idle_cpu.append(cpu)
            else:
                got = time_steps(pipeline_steps[name], args.warmup, args.steps)
            samples[name].extend(got)
        if out_of_time(deadline):
            break
    return samples, idle_cpu, gradient_error


def rank_main(rank: int, world_size: int, workdir: str, args: argparse.Namespace) -> None:
    """One rank process: gloo over a FileStore in ``workdir``; its samples go to a file there."""
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        results = run_rounds(rank, args)
        with open(os.path.join(workdir, f"rank{rank}.pkl"), "wb") as file:
            pickle.dump(results, file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- reporting ----------------------------------------------------------------------------------
def step_times(per_rank: Dict[int, Dict[str, List[Sample]]], name: str) -> List[float]:
    """Per step, the slowest rank's time (the baseline runs on rank 0 only)."""
    columns = [per_rank[r][name] for r in sorted(per_rank) if per_rank[r][name]]
    return [max(sample[0] for sample in step) for step in zip(*columns)]


def busy_fractions(per_rank: Dict[int, Dict[str, List[Sample]]], name: str) -> List[Optional[float]]:
    """Each rank's median busy fraction in ``name``'s steps (None where it is not measured)."""
    out = []
    for rank in sorted(per_rank):
        values = [busy for _, busy in per_rank[rank][name] if busy is not None]
        out.append(statistics.median(values) if values else None)
    return out


def headline(medians: Dict[str, float]) -> Tuple[float, float, str]:
    """``(efficiency_vs_ideal, vs_torch_pipelining, our best schedule)`` from per-variant times."""
    p, m = NUM_STAGES, NUM_MICROBATCHES
    best = min(("ours gpipe", "ours 1f1b"), key=medians.get)
    efficiency = medians["sequential"] / (p * medians[best]) / (m / (m + p - 1))
    vs_torch = math.sqrt(
        medians["torch gpipe"] / medians["ours gpipe"] * medians["torch 1f1b"] / medians["ours 1f1b"]
    )
    return efficiency, vs_torch, best


def paired_headline(per_rank, steps: int) -> Tuple[float, float]:
    """The headline per round (variants run seconds apart), then the median over rounds."""
    times = {name: step_times(per_rank, name) for name in ALL_VARIANTS}
    rounds = len(times["sequential"]) // steps
    per_round = [
        headline({name: statistics.median(t[k * steps : (k + 1) * steps]) for name, t in times.items()})
        for k in range(rounds)
    ]
    return statistics.median(h[0] for h in per_round), statistics.median(h[1] for h in per_round)


def format_table(per_rank, medians: Dict[str, float]) -> List[str]:
    header = f"{'variant':<12} {'median ms/step':>14} {'p25-p75 ms':>15} {'vs sequential':>13}   busy (rank 0, rank 1)"
    lines = [header, "-" * len(header)]
    for name in ALL_VARIANTS:
        times = sorted(step_times(per_rank, name))
        quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        busy = busy_fractions(per_rank, name)
        busy_text = ", ".join(f"{b:.3f}" for b in busy) if all(b is not None for b in busy) else "-"
        speedup = medians["sequential"] / medians[name]
        lines.append(
            f"{name:<12} {medians[name] * 1e3:>14.1f} {quartiles[0] * 1e3:>7.1f}-{quartiles[2] * 1e3:<7.1f}"
            f" {speedup:>12.3f}x   {busy_text}"
        )
    return lines


def notes(per_rank, medians: Dict[str, float], idle_cpu: List[float], best: str) -> List[str]:
    """What bounds the numbers: the bubble, and this machine's two cores computing at once."""
    p, m = NUM_STAGES, NUM_MICROBATCHES
    bubble_bound = m / (m + p - 1)
    machine_bound = medians["no-comm"] * (m + p - 1) / m
    lines = [
        f"ideal for p={p}, m={m}: {p * bubble_bound:.3f}x vs sequential, busy {bubble_bound:.3f} "
        "(the bubble bound m/(m+p-1))",
        "no-comm (reference): both ranks compute their own stage at once, with no messages and no bubble;",
        f"  so on this machine a flush schedule needs at least {machine_bound * 1e3:.1f} ms "
        f"(no-comm x (m+p-1)/m, {medians['sequential'] / machine_bound:.3f}x vs sequential); "
        f"{best} takes {medians[best] / machine_bound:.3f}x that",
    ]
    busy = [b for name in ("ours gpipe", "ours 1f1b") for b in busy_fractions(per_rank, name)]
    if max(busy) > bubble_bound + 0.02:
        lines.append(
            "busy above the bubble bound: the bound assumes equal stages, but the last stage also computes "
            "the loss and its input gradients, so it does more work than stage 0"
        )
    lines.append(f"rank 1 CPU use while rank 0 timed the baseline: {max(idle_cpu):.1%} of one core at most")
    return lines


def summarize(per_rank, idle_cpu: List[float], args: argparse.Namespace) -> List[str]:
    """The table, notes and, last, ``efficiency_vs_ideal=<x> vs_torch_pipelining=<y>``."""
    medians = {name: statistics.median(step_times(per_rank, name)) for name in ALL_VARIANTS}
    efficiency, vs_torch, best = headline(medians)
    paired_efficiency, paired_vs_torch = paired_headline(per_rank, args.steps)
    rounds = len(step_times(per_rank, "sequential")) // args.steps
    return [
        f"model {NUM_BLOCKS} x (Linear({WIDTH},{WIDTH})+ReLU), batch {BATCH_SIZE}, m={NUM_MICROBATCHES} "
        f"microbatches, p={NUM_STAGES} stages, balance {BALANCE}, float32, 1 thread per rank, gloo",
        f"{rounds} rounds x ({args.warmup} warm-up + {args.steps} timed steps) per variant; median over "
        f"{rounds * args.steps} steps" + (" (stopped early: --max-seconds)" if rounds < args.rounds else ""),
        "",
        *format_table(per_rank, medians),
        "",
        *notes(per_rank, medians, idle_cpu, best),
        f"per-round paired estimate (median over rounds): efficiency_vs_ideal {paired_efficiency:.3f}, "
        f"vs_torch_pipelining {paired_vs_torch:.3f}",
        f"our best schedule: {best}",
        f"efficiency_vs_ideal={efficiency:.3f} vs_torch_pipelining={vs_torch:.3f}",
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (under 3 minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, help="rounds over all variants (default 30, --quick 12)")
    parser.add_argument("--steps", type=int, help="timed steps per variant and round (default 5, --quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant and round (default 1)")
    parser.add_argument(
        "--max-seconds", type=float, help="start no new round after this long (default 480, --quick 120)"
    )
    args = parser.parse_args()
    defaults = (12, 3, 1, 120.0) if args.quick else (30, 5, 1, 480.0)
    for name, default in zip(("rounds", "steps", "warmup", "max_seconds"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be at least 1, --warmup at least 0")
    return args


class LoadMonitor:
    """How many cores other processes kept busy during the run (Linux ``/proc/stat``; else None).

    The whole machine's busy CPU time minus this process's and its children's, over the wall time.
    Two ranks on a 2-core machine leave no room: anything else running skews every number.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> Optional[Tuple[float, float, float]]:
        if not os.path.exists("/proc/stat"):
            return None
        with open("/proc/stat") as file:
            fields = [int(v) for v in file.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait
        own = sum(
            getattr(resource.getrusage(who), kind)
            for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
            for kind in ("ru_utime", "ru_stime")
        )
        return time.monotonic(), busy, own

    def other_cores(self) -> Optional[float]:
        end = self._sample()
        if self._start is None or end is None:
            return None
        wall, busy, own = (b - a for a, b in zip(self._start, end))
        return max(0.0, (busy - own) / wall)


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    monitor = LoadMonitor()
    per_rank, idle_cpu, gradient_errors = {}, [], []
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(rank_main, args=(NUM_STAGES, workdir, args), nprocs=NUM_STAGES, join=True)
        for rank in range(NUM_STAGES):
            with open(os.path.join(workdir, f"rank{rank}.pkl"), "rb") as file:
                per_rank[rank], cpu, error = pickle.load(file)
            idle_cpu = cpu if rank == 1 else idle_cpu
            gradient_errors.append(error)
    others = monitor.other_cores()
    lines = summarize(per_rank, idle_cpu, args)
    error = max(gradient_errors)
    print(f"gradients: every pipelined variant matches the sequential baseline (max abs diff {error:.1e})")
    print(*lines[:-1], sep="\n")
    if others is not None:
        verdict = "quiet" if others < 0.1 else "BUSY: other processes competed for the cores; rerun when idle"
        print(f"other processes kept {others:.2f} cores busy on average during the run ({verdict})")
    print(f"(benchmark wall time {time.perf_counter() - start:.0f} s)")
    print(lines[-1])


if __name__ == "__main__":
    main()
