"""Pipeline efficiency on CPU: every lightning_pipe schedule against ideal, the machine, and torch.

What it measures. One model split over p = 2 ranks (gloo, one thread per rank, FileStore
rendezvous in a temporary directory, no ports), in one of two sizes:

* default: 8 x (Linear(1024, 1024) + ReLU), an ``nn.Sequential`` of 16 children, batch 256 in
  m = 8 microbatches of 32, float32, MSE loss against random targets;
* ``--tiny``: 4 x Linear(4, 4), batch 256 in m = 64 microbatches of 4: overhead-bound, so it
  measures the engine's cost per action rather than compute.

Variants, each timed in the same two rank processes, in every round, in an order rotated per
round (gradients zeroed every step, no optimizer):

* ``sequential``: rank 0 alone runs the m microbatches one after another through the whole model
  while rank 1 waits in a barrier (its CPU use meanwhile is printed).
* ``ours <schedule>``: :class:`lightning_pipe.Pipeline` ``forward_backward`` for ``gpipe``,
  ``1f1b``, ``interleaved_1f1b`` (v = 2), ``zb_h1``, ``zbv`` and ``zb_h2`` (which torch lacks).
* ``torch <schedule>``: ``torch.distributed.pipelining`` on the same stage modules and the same
  microbatches: ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` (2 stages per
  rank), ``ScheduleInterleavedZeroBubble`` with one stage per rank (torch's ZB-H1-like looped
  zero bubble) and ``ScheduleZBVZeroBubble``.
* ``no-comm`` (reference): both ranks run their own half of the model's m forwards and backwards
  at once with no messages: what two busy cores of this machine allow, bubble and transport aside.

Before timing, every pipelined variant's gradients are checked against the sequential baseline's.
Each round runs every variant for W warm-up and K timed steps, a barrier before every step; a
step's time is the slowest rank's. Rounds stop early once ``--max-seconds`` have passed. After
the rounds, a few more steps of each of our schedules are recorded (``Pipeline.trace_steps``) for
the per-action breakdown and the simulated-vs-measured table.

The last line is ``efficiency_vs_ideal=<x> vs_torch_pipelining=<y> vs_machine_cap=<z> best=<s>``:
x = (T_seq / (p * T_best)) / (m / (m + p - 1)) for our fastest schedule s of the six (1.000: only a 1F1B
bubble is lost; zero-bubble schedules can exceed it), y = the geometric mean of
T_torch / T_ours over the five schedules both have (above 1: we are faster), z = T_no-comm /
T_best (1.000: two busy cores with no bubble and no messages).

``--main-thread-waits`` (measurement only) makes our pipelines wait for each message with a
blocking ``wait()`` on the main thread, as torch does, instead of through each link's helper
thread: what the helper threads, which let a rank stop when a peer fails, cost.

``--message-delay-ms D`` (measurement only) emulates a slow link for our schedules: each of their
sends leaves D ms after the executor issues it (a thread per rank issues it then; the step also
waits for its delayed sends to leave). Only our variants and no-comm run (torch's sends cannot be
delayed the same way, so there is no y), and the simulated column uses D as each message's cost.

The table's last column is each rank's median number of minor page faults per step: memory glibc
returned to the OS and the step touched again (gradients allocated anew after ``zero_grad``, freed
activations), each costing the rank about 1.7 µs here. ``--steady-allocator`` (measurement only)
starts the ranks with glibc told to keep what it frees (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), so that no variant pays them: what the comparison is without the
allocator's part.

Run: ``python benchmarks/pipeline_efficiency.py --quick`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import queue
import resource
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

# measure the checkout this script lives in, not whichever lightning_pipe is installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import lightning_pipe  # noqa: E402
from lightning_pipe import partition  # noqa: E402
from lightning_pipe.schedule import ALL_SCHEDULES, make_table, simulate  # noqa: E402

NUM_RANKS = 2
SEED = 0
SHARED = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")  # schedules both libraries have
SCHEDULES = SHARED + ("zb_h2",)  # ours
VIRTUAL = {"interleaved_1f1b": 2}
# --steady-allocator: glibc's largest fixed mmap threshold (32 MiB: gradients and activations come from the heap)
# and a trim threshold no step reaches (freed memory stays mapped)
STEADY_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


@dataclass(frozen=True)
class Config:
    """The model and batch: ``layers`` Linear(width, width), each followed by a ReLU if ``relu``."""

    name: str
    width: int
    layers: int
    relu: bool
    batch_size: int
    num_microbatches: int

    def describe(self) -> str:
        layer = f"(Linear({self.width},{self.width})+ReLU)" if self.relu else f"Linear({self.width},{self.width})"
        return (f"model {self.layers} x {layer}, batch {self.batch_size}, m={self.num_microbatches} microbatches, "
                f"p={NUM_RANKS} ranks, float32, 1 thread per rank, gloo")


DEFAULT = Config("default", 1024, 8, True, 256, 8)
TINY = Config("tiny", 4, 4, False, 256, 64)

Sample = Tuple[float, Optional[float], int]  # a timed step on one rank: (seconds, busy fraction or None, page faults)


def build_model(config: Config) -> nn.Sequential:
    """The same full model on every rank (seeded)."""
    torch.manual_seed(SEED)
    layers: List[nn.Module] = []
    for _ in range(config.layers):
        layers += [nn.Linear(config.width, config.width)] + ([nn.ReLU()] if config.relu else [])
    return nn.Sequential(*layers)


def make_batch(config: Config) -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(config.batch_size, config.width, generator=generator)
    return x, torch.randn(config.batch_size, config.width, generator=generator)


def compared(args: argparse.Namespace) -> Tuple[str, ...]:
    """The schedules torch runs too: every shared one, none when our sends are delayed."""
    return () if args.message_delay_ms else SHARED


def variants(torch_schedules: Tuple[str, ...] = SHARED) -> Tuple[str, ...]:
    return ("sequential",) + tuple(f"{who} {s}" for s in SCHEDULES for who in ("ours", "torch")
                                   if who == "ours" or s in torch_schedules) + ("no-comm",)


# -- the variants' steps ------------------------------------------------------------------------
def sequential_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> None:
    """The baseline: every microbatch through the whole model in turn, gradients accumulated."""
    model.zero_grad(set_to_none=True)
    for x_part, y_part in zip(x.chunk(m), y.chunk(m)):
        (F.mse_loss(model(x_part), y_part) / m).backward()


def ours_step(pipe: lightning_pipe.Pipeline, x: torch.Tensor, y: torch.Tensor) -> float:
    """One ``forward_backward``; returns this rank's busy fraction."""
    pipe.module.zero_grad(set_to_none=True)
    pipe.forward_backward(*((x,) if pipe.holds_first else ()), criterion=F.mse_loss,
                          labels=(y,) if pipe.holds_last else ())
    return pipe.last_step.compute_seconds / pipe.last_step.wall_seconds


def torch_step(schedule, modules: List[nn.Module], first: bool, last: bool, x, y) -> None:
    for module in modules:
        module.zero_grad(set_to_none=True)
    schedule.step(*((x,) if first else ()), **({"target": y} if last else {}), return_outputs=False)


def no_comm_step(stage: nn.Module, rank: int, x: torch.Tensor, y: torch.Tensor, m: int) -> None:
    """Reference: this rank's half of the compute with no communication and no bubble."""
    stage.zero_grad(set_to_none=True)
    for x_part, y_part in zip(x.chunk(m), y.chunk(m)):
        if rank == 0:
            stage(x_part).backward(y_part)  # y_part stands in for the gradient rank 1 would send
        else:
            F.mse_loss(stage(x_part.detach().requires_grad_()), y_part).backward()


def _torch_schedule(name: str, modules: List[nn.Module], stage_indices: Tuple[int, ...], m: int):
    from torch.distributed import pipelining as tp

    classes = {"gpipe": tp.ScheduleGPipe, "1f1b": tp.Schedule1F1B, "interleaved_1f1b": tp.ScheduleInterleaved1F1B,
               "zb_h1": tp.ScheduleInterleavedZeroBubble, "zbv": tp.ScheduleZBVZeroBubble}
    num_stages = NUM_RANKS * len(modules)
    stages = [tp.PipelineStage(mod, s, num_stages, torch.device("cpu")) for mod, s in zip(modules, stage_indices)]
    cls = classes[name]
    if name in ("gpipe", "1f1b"):
        return cls(stages[0], m, loss_fn=F.mse_loss)
    return cls(stages, m, loss_fn=F.mse_loss)


def wait_on_main_thread(pipe: lightning_pipe.Pipeline) -> None:
    """Measurement only (``--main-thread-waits``): wait for every message with a blocking ``wait()`` on
    the main thread, as torch does, instead of through the link's helper thread; a failed peer that
    stays alive would then block this rank until the process group's timeout."""
    pipe.transport.arrivals = None
    pipe.transport.errors.wait = lambda work, what: work.wait()


class DelayedSends:
    """Measurement only (``--message-delay-ms``): every send of a pipeline leaves ``delay`` seconds
    after the executor issues it, in issue order, from one thread of this rank: a slow link."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._queue: "queue.Queue" = queue.Queue()
        self._works: list = []
        threading.Thread(target=self._run, daemon=True).start()

    def wrap(self, pipe: lightning_pipe.Pipeline) -> None:
        transport = pipe.transport
        issue = transport.issue

        def delayed(ops: list, pending=()) -> None:
            sends = [op for op in ops if op.is_send]
            issue([op for op in ops if not op.is_send], pending)
            if sends:
                self._queue.put((time.monotonic() + self.delay, transport._process_group, sends))

        transport.issue = delayed

    def _run(self) -> None:
        while True:
            due, group, sends = self._queue.get()
            time.sleep(max(0.0, due - time.monotonic()))
            self._works += [(group.send([op.tensor], op.peer, op.tag), op.tensor) for op in sends]
            self._queue.task_done()

    def flush(self) -> None:
        """Wait until every delayed send has left."""
        self._queue.join()
        for work, _ in self._works:
            work.wait()
        self._works = []


def make_steps(rank: int, config: Config, x, y, main_thread_waits: bool = False, delayed: Optional[DelayedSends] = None,
               torch_schedules: Tuple[str, ...] = SHARED) -> Tuple[nn.Module, Dict[str, Callable], Dict[str, object]]:
    """Every pipelined variant's step on this rank, the no-comm stage and our pipelines by schedule."""
    m = config.num_microbatches
    steps: Dict[str, Callable] = {}
    pipes: Dict[str, lightning_pipe.Pipeline] = {}
    families: Dict[Tuple[str, int], list] = {}  # (placement, stages per rank) -> this rank's modules
    for name in SCHEDULES:
        spec = ALL_SCHEDULES[name]
        v = spec.virtual_stages(VIRTUAL.get(name))
        key = (spec.placement, v)
        if key not in families:
            num_stages = NUM_RANKS * v
            per = len(build_model(config)) // num_stages
            parts = partition(build_model(config), rank, NUM_RANKS, [per] * num_stages, num_model_chunks=v,
                              placement=spec.placement)
            families[key] = parts
        parts = families[key]
        pipe = lightning_pipe.Pipeline(parts, chunks=m, schedule=name, virtual_stages=VIRTUAL.get(name))
        if main_thread_waits:
            wait_on_main_thread(pipe)
        pipes[name] = pipe
        if delayed is None:
            steps[f"ours {name}"] = lambda pipe=pipe: ours_step(pipe, x, y)
        else:
            delayed.wrap(pipe)
            steps[f"ours {name}"] = lambda pipe=pipe: (ours_step(pipe, x, y), delayed.flush())[0]
        if name in torch_schedules:
            schedule = _torch_schedule(name, parts, pipe.stage_indices, m)
            steps[f"torch {name}"] = lambda s=schedule, parts=parts, pipe=pipe: torch_step(
                s, parts, pipe.holds_first, pipe.holds_last, x, y)
    stage = families[("loop", 1)][0]
    steps["no-comm"] = lambda: no_comm_step(stage, rank, x, y, m)
    return stage, steps, pipes


def check_gradients(config: Config, pipes: Dict[str, object], steps: Dict[str, Callable], x, y,
                    torch_schedules: Tuple[str, ...] = SHARED) -> float:
    """Every pipelined variant computes the baseline's gradients (each rank checks its stages)."""
    reference = build_model(config)
    sequential_step(reference, x, y, config.num_microbatches)
    expected = dict(reference.named_parameters())
    worst = 0.0
    for name in SCHEDULES:
        for who in ("ours", "torch") if name in torch_schedules else ("ours",):
            dist.barrier()
            steps[f"{who} {name}"]()
            for part in pipes[name].modules:
                for key, parameter in part.named_parameters():
                    error = (parameter.grad - expected[key].grad).abs().max().item()
                    if not torch.allclose(parameter.grad, expected[key].grad, rtol=1e-4, atol=1e-6):
                        raise AssertionError(f"{who} {name} computes other gradients than the baseline: {key} by {error}")
                    worst = max(worst, error)
    return worst


# -- timing -------------------------------------------------------------------------------------
def time_steps(step: Callable[[], Optional[float]], warmup: int, steps: int) -> List[Sample]:
    for _ in range(warmup):
        dist.barrier()
        step()
    samples = []
    for _ in range(steps):
        dist.barrier()
        faults, begin = _page_faults(), time.perf_counter()
        busy = step()
        samples.append((time.perf_counter() - begin, busy, _page_faults() - faults))
    return samples


def _page_faults() -> int:
    """This process's minor page faults so far: pages the allocator got back from the OS and touched anew."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_sequential(rank: int, config: Config, model, x, y, warmup: int, steps: int) -> Tuple[List[Sample], float]:
    """Rank 0 runs the baseline while rank 1 waits; returns rank 0's samples and this rank's CPU use."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    samples = []
    if rank == 0:
        for _ in range(warmup):
            sequential_step(model, x, y, config.num_microbatches)
        for _ in range(steps):
            faults, begin = _page_faults(), time.perf_counter()
            sequential_step(model, x, y, config.num_microbatches)
            samples.append((time.perf_counter() - begin, None, _page_faults() - faults))
    dist.barrier()
    return samples, (time.process_time() - cpu) / (time.perf_counter() - wall)


def out_of_time(deadline: float) -> bool:
    flag = torch.tensor([float(dist.get_rank() == 0 and time.monotonic() > deadline)])
    dist.all_reduce(flag)
    return bool(flag.item())


def record_steps(pipes: Dict[str, object], steps: Dict[str, Callable], count: int) -> Dict[str, list]:
    """``count`` recorded steps of each of our schedules (after the timing, so it costs nothing there)."""
    records = {}
    for name, pipe in pipes.items():
        recorder = pipe.trace_steps()
        for _ in range(count):
            dist.barrier()
            steps[f"ours {name}"]()
        pipe.stop_tracing()
        records[name] = recorder.records
    return records


def run_rounds(rank: int, args: argparse.Namespace) -> dict:
    """Every variant in every round, the order rotated per round; then the recorded steps."""
    config = TINY if args.tiny else DEFAULT
    deadline = time.monotonic() + args.max_seconds
    x, y = make_batch(config)
    delayed = DelayedSends(args.message_delay_ms / 1e3) if args.message_delay_ms else None
    torch_schedules = compared(args)
    stage, steps, pipes = make_steps(rank, config, x, y, args.main_thread_waits, delayed, torch_schedules)
    gradient_error = check_gradients(config, pipes, steps, x, y, torch_schedules)
    baseline = build_model(config) if rank == 0 else None
    names = variants(torch_schedules)
    samples: Dict[str, List[Sample]] = {name: [] for name in names}
    idle_cpu = []
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if name == "sequential":
                got, cpu = time_sequential(rank, config, baseline, x, y, args.warmup, args.steps)
                idle_cpu.append(cpu)
            else:
                got = time_steps(steps[name], args.warmup, args.steps)
            samples[name].extend(got)
        if out_of_time(deadline):
            break
    records = record_steps(pipes, steps, max(3, args.steps))
    return dict(samples=samples, idle_cpu=idle_cpu, gradient_error=gradient_error, records=records)


def rank_main(rank: int, world_size: int, workdir: str, args: argparse.Namespace) -> None:
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
def step_times(per_rank: Dict[int, dict], name: str) -> List[float]:
    """Per step, the slowest rank's time (the baseline runs on rank 0 only)."""
    columns = [per_rank[r]["samples"][name] for r in sorted(per_rank) if per_rank[r]["samples"][name]]
    return [max(sample[0] for sample in step) for step in zip(*columns)]


def busy_fractions(per_rank: Dict[int, dict], name: str) -> List[Optional[float]]:
    out = []
    for rank in sorted(per_rank):
        values = [busy for _, busy, _ in per_rank[rank]["samples"][name] if busy is not None]
        out.append(statistics.median(values) if values else None)
    return out


def page_faults(per_rank: Dict[int, dict], name: str) -> List[Optional[int]]:
    """Per rank, the median minor page faults of a step (None where the rank timed none: the baseline's rank 1)."""
    return [int(statistics.median(s[2] for s in per_rank[r]["samples"][name])) if per_rank[r]["samples"][name]
            else None for r in sorted(per_rank)]


def headline(medians: Dict[str, float], config: Config,
             torch_schedules: Tuple[str, ...] = SHARED) -> Tuple[float, float, float, str]:
    """``(efficiency_vs_ideal, vs_torch_pipelining (nan without torch), vs_machine_cap, our best schedule)``."""
    p, m = NUM_RANKS, config.num_microbatches
    best = min(SCHEDULES, key=lambda s: medians[f"ours {s}"])
    t_best = medians[f"ours {best}"]
    efficiency = medians["sequential"] / (p * t_best) / (m / (m + p - 1))
    ratios = [medians[f"torch {s}"] / medians[f"ours {s}"] for s in torch_schedules]
    vs_torch = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else math.nan
    return efficiency, vs_torch, medians["no-comm"] / t_best, best


def format_table(per_rank, medians: Dict[str, float], torch_schedules: Tuple[str, ...] = SHARED) -> List[str]:
    header = (f"{'variant':<22} {'median ms/step':>14} {'p25-p75 ms':>15} {'vs sequential':>13}   "
              f"{'busy (rank 0, rank 1)':<22} page faults/step")
    lines = [header, "-" * len(header)]
    for name in variants(torch_schedules):
        times = sorted(step_times(per_rank, name))
        quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        busy = busy_fractions(per_rank, name)
        busy_text = ", ".join(f"{b:.3f}" for b in busy) if all(b is not None for b in busy) else "-"
        faults_text = ", ".join(str(f) for f in page_faults(per_rank, name) if f is not None)
        lines.append(f"{name:<22} {medians[name] * 1e3:>14.1f} {quartiles[0] * 1e3:>7.1f}-{quartiles[2] * 1e3:<7.1f}"
                     f" {medians['sequential'] / medians[name]:>12.3f}x   {busy_text:<22} {faults_text}")
    return lines


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def breakdown(per_rank, medians: Dict[str, float], config: Config) -> List[str]:
    """Where our time goes per action, from the recorded steps (means over ranks and steps, µs)."""
    compute_per_action = medians["no-comm"] / (2 * config.num_microbatches)  # one F or B of a rank's half
    header = (f"{'ours':<18} {'compute/action':>14} {'of which engine':>15} {'issue/block':>11} {'wait/recv':>9} "
              f"{'sends done':>10} {'other/step':>10}")
    lines = ["where our time goes (recorded steps; µs; 'of which engine' = compute span minus no-comm's "
             f"{compute_per_action * 1e6:.0f} µs per F or B of a rank's half, per F/B-equivalent)", header]
    for name in SCHEDULES:
        records = [rec for r in sorted(per_rank) for rec in per_rank[r]["records"][name]]
        compute = [e - b for rec in records for _, b, e in rec.compute]
        units = sum(0.5 if a.kind in ("I", "W") else 1.0 for rec in records for a, _, _ in rec.compute)
        v = ALL_SCHEDULES[name].virtual_stages(VIRTUAL.get(name))
        engine = (sum(compute) / units * v - compute_per_action) if units else 0.0  # v stages share a rank's half
        issue = [e - b for rec in records for _, b, e in rec.issued]
        waits = [e - b for rec in records for _, b, e in rec.waits]
        finish = [rec.finish[1] - rec.finish[0] for rec in records]
        other = [(rec.end - rec.begin) - sum(e - b for _, b, e in rec.compute) - sum(e - b for _, b, e in rec.waits)
                 - sum(e - b for _, b, e in rec.issued) - (rec.finish[1] - rec.finish[0]) for rec in records]
        lines.append(f"{name:<18} {_mean(compute) * 1e6:>14.0f} {engine / v * 1e6:>15.0f} {_mean(issue) * 1e6:>11.0f} "
                     f"{_mean(waits) * 1e6:>9.0f} {_mean(finish) * 1e6:>10.0f} {_mean(other) * 1e6:>10.0f}")
    return lines


def simulated(per_rank, medians: Dict[str, float], config: Config, comm_cost: float = 0.0) -> List[str]:
    """Each schedule simulated with the mean measured duration of each action kind, against the run."""
    messages = f"{comm_cost * 1e3:g} ms per message" if comm_cost else "free messages"
    lines = [f"{'schedule':<18} {'sim bubble':>10} {'sim ms':>8} {'measured ms':>11} {'measured/sim':>12}   "
             f"(sim: the table replayed with measured mean F, B, I, W per stage, {messages})"]
    for name in SCHEDULES:
        durations: Dict[str, List[float]] = {}
        for r in sorted(per_rank):
            for rec in per_rank[r]["records"][name]:
                for a, b, e in rec.compute:
                    durations.setdefault(a.kind, []).append(e - b)
        cost = {kind: _mean(values) for kind, values in durations.items()}
        table = make_table(name, NUM_RANKS, config.num_microbatches, VIRTUAL.get(name))
        result = simulate(table, cost.get("F", 1.0), cost.get("B", 2 * cost.get("F", 1.0)), comm_cost,
                          input_cost=cost.get("I"), weight_cost=cost.get("W"))
        measured = medians[f"ours {name}"]
        lines.append(f"{name:<18} {result.bubble_fraction:>10.3f} {result.makespan * 1e3:>8.1f} {measured * 1e3:>11.1f} "
                     f"{measured / result.makespan:>12.3f}")
    return lines


def notes(medians: Dict[str, float], idle_cpu: List[float], best: str, config: Config) -> List[str]:
    p, m = NUM_RANKS, config.num_microbatches
    bubble_bound = m / (m + p - 1)
    machine_bound = medians["no-comm"] * (m + p - 1) / m
    return [
        f"ideal 1F1B for p={p}, m={m}: {p * bubble_bound:.3f}x vs sequential, busy {bubble_bound:.3f} (m/(m+p-1))",
        "no-comm (reference): both ranks compute their own half at once, with no messages and no bubble;",
        f"  a 1F1B-bubble schedule needs at least {machine_bound * 1e3:.1f} ms here (no-comm x (m+p-1)/m); "
        f"our best ({best}) takes {medians[f'ours {best}'] / medians['no-comm']:.3f}x no-comm",
        f"rank 1 CPU use while rank 0 timed the baseline: {max(idle_cpu):.1%} of one core at most",
    ]


def summarize(per_rank, args: argparse.Namespace) -> List[str]:
    config = TINY if args.tiny else DEFAULT
    torch_schedules = compared(args)
    medians = {name: statistics.median(step_times(per_rank, name)) for name in variants(torch_schedules)}
    efficiency, vs_torch, vs_machine, best = headline(medians, config, torch_schedules)
    rounds = len(step_times(per_rank, "sequential")) // args.steps
    idle_cpu = per_rank[1]["idle_cpu"]
    return [
        config.describe() + ("; ours waiting on the main thread (--main-thread-waits, measurement only)"
                             if args.main_thread_waits else "")
        + (f"; our sends delayed {args.message_delay_ms:g} ms (--message-delay-ms, measurement only; torch not run)"
           if args.message_delay_ms else "")
        + ("; glibc keeping freed memory (--steady-allocator, measurement only)" if args.steady_allocator else ""),
        f"{rounds} rounds x ({args.warmup} warm-up + {args.steps} timed steps) per variant; median over "
        f"{rounds * args.steps} steps" + (" (stopped early: --max-seconds)" if rounds < args.rounds else ""),
        "", *format_table(per_rank, medians, torch_schedules), "",
        *notes(medians, idle_cpu, best, config), "",
        *breakdown(per_rank, medians, config), "",
        *simulated(per_rank, medians, config, args.message_delay_ms / 1e3), "",
        "ours vs torch per schedule (torch ms / ours ms): "
        + (", ".join(f"{s} {medians[f'torch {s}'] / medians[f'ours {s}']:.3f}" for s in torch_schedules) or "n/a"),
        f"efficiency_vs_ideal={efficiency:.3f} vs_torch_pipelining={vs_torch:.3f} vs_machine_cap={vs_machine:.3f} "
        f"best={best}",
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="4 x Linear(4, 4), m=64: the engine's overhead")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about 3 minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, help="rounds over all variants (default 20, --quick 6)")
    parser.add_argument("--steps", type=int, help="timed steps per variant and round (default 5, --quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant and round (default 1)")
    parser.add_argument("--main-thread-waits", action="store_true",
                        help="measurement only: our waits block the main thread as torch's do (no fail-fast)")
    parser.add_argument("--message-delay-ms", type=float, default=0.0,
                        help="measurement only: our sends leave this late (a slow link); torch is not run")
    parser.add_argument("--steady-allocator", action="store_true",
                        help="measurement only: glibc keeps freed memory, so no variant page-faults it back each step")
    parser.add_argument("--max-seconds", type=float, help="start no new round after this long (default 600, --quick 150)")
    args = parser.parse_args()
    defaults = (6, 3, 1, 150.0) if args.quick else (20, 5, 1, 600.0)
    for name, default in zip(("rounds", "steps", "warmup", "max_seconds"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be at least 1, --warmup at least 0")
    return args


class LoadMonitor:
    """How many cores other processes kept busy during the run (Linux ``/proc/stat``; else None)."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> Optional[Tuple[float, float, float]]:
        if not os.path.exists("/proc/stat"):
            return None
        with open("/proc/stat") as file:
            fields = [int(v) for v in file.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait
        own = sum(getattr(resource.getrusage(who), kind) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for kind in ("ru_utime", "ru_stime"))
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
    if args.steady_allocator:  # read by glibc when each rank's interpreter starts (mp.spawn starts new ones)
        os.environ.update(STEADY_ALLOCATOR)
    per_rank: Dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(rank_main, args=(NUM_RANKS, workdir, args), nprocs=NUM_RANKS, join=True)
        for rank in range(NUM_RANKS):
            with open(os.path.join(workdir, f"rank{rank}.pkl"), "rb") as file:
                per_rank[rank] = pickle.load(file)
    others = monitor.other_cores()
    lines = summarize(per_rank, args)
    error = max(per_rank[r]["gradient_error"] for r in per_rank)
    print(f"gradients: every pipelined variant matches the sequential baseline (max abs diff {error:.1e})")
    print(*lines[:-1], sep="\n")
    if others is not None:
        verdict = "quiet" if others < 0.1 else "BUSY: other processes competed for the cores; rerun when idle"
        print(f"other processes kept {others:.2f} cores busy on average during the run ({verdict})")
    print(f"(benchmark wall time {time.perf_counter() - start:.0f} s)")
    print(lines[-1])


if __name__ == "__main__":
    main()
