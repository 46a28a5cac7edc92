"""What PipeStrategy's Lightning glue costs per training step, against the plain API on the same stages.

Model (generated here): ``embed`` Linear(512, 512), a body of 8 x (Linear(512, 512) + ReLU),
``head`` Linear(512, 512) (``--width N``: N instead of 512), MSE loss against random targets;
batch 64 in 4 microbatches, 2 stages, 1F1B, AdamW, float32, 2 CPU processes over gloo, one thread
each. The stages are the same in both runs: stage 0 holds ``embed`` and body layers 0-3, stage 1
body layers 4-7 and ``head``.

* ``lightning``: ``Trainer(strategy=PipeStrategy(...))`` with a LightningModule whose step logs its
  loss every step (Lightning's defaults otherwise: ``log_every_n_steps=50``, so the ``pipe/``
  metrics are measured every 50 steps). A step is timed from ``on_train_batch_start`` to
  ``on_train_batch_end`` on global rank 0: the pipelined forward and backward with the user's
  step run per microbatch, log recording and replay, the per-step broadcast of the last stage's
  results, gradient hand-off, ``optimizer.step`` and ``zero_grad``.
* ``plain``: then, in the same two processes, :class:`lightning_pipe.PipeDream` on the same stage
  modules: ``forward_backward``, ``optimizer.step()``, ``zero_grad()``.

Both steps start with a barrier outside the timed span, so that each is timed from the two ranks
starting together. Without it, each step's time depended on the step before it: the last stage's
optimizer step takes longer than stage 0's here (10 against 5 ms), and stage 0 then waited for the
last stage at the start of whichever step came next, by as much as the previous step let it lag.

Printed with it: Lightning's own ``self.log`` call (stage 0 replays the step's call once; a plain
single-device Trainer pays the same call), measured in the same steps; whether the last stage
skipped its rerun of the code before the body after the first step (``embed``, whose output only
feeds the body: see :mod:`lightning_pipe.lightning.stale`); and, after the pipelined run, Lightning's
own loop on one process: a single-device Trainer step on the whole model over a plain loop step
(median of the per-step differences), which any Lightning run pays, with the ratio left once it is
taken off (``glue_own_vs_plain``); and the same split measured inside the pipelined run on rank 0
(``glue_own_in_run_vs_plain``: the time in PipeStrategy's ``training_step`` and ``backward`` and in
the optimizer's own ``step`` and ``zero_grad``, less Lightning's ``self.log`` that the strategy
replays, over the plain step; every wait inside the strategy's hooks counts as ours). The last
line is ``glue_vs_plain=<x>``: the median Lightning step over the median plain step (goal: at most
1.05). The line before the last three gives the median of the per-pair ratios, which cancels slow
drift better.

With ``--actions`` (measurement only: recording costs about a microsecond per action), both
pipelines record their steps (:meth:`lightning_pipe.Pipeline.trace_steps`) and the script also
prints, per rank and per action of the schedule, the median start (from the step's start) and
duration in each kind of step, and what comes after the rank's last action: where the Lightning
step's extra time builds up.

    python benchmarks/glue_cost.py      # about 30 s on 2 cores; Lightning starts rank 1 itself
    python benchmarks/glue_cost.py --actions
    python benchmarks/glue_cost.py --width 1024   # 4 times the compute per step, the same glue: about 1 minute
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import lightning_pipe  # noqa: E402
from lightning_pipe.lightning import logs  # noqa: E402


def _option(name: str, default: int) -> int:
    """``name N`` from the command line, else ``default`` (Lightning starts rank 1 with the same arguments)."""
    args = sys.argv[1:]
    return int(args[args.index(name) + 1]) if name in args else default


WIDTH, DEPTH, BATCH, MICROBATCHES, STEPS, WARMUP = _option("--width", 512), 8, 64, 4, 110, 10
ACTIONS = "--actions" in sys.argv[1:]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.body = nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
        self.head = nn.Linear(WIDTH, WIDTH)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.body(self.embed(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepTimer(pl.Callback):
    """Times each Lightning step, then one plain-API step in the same processes right after it, so
    that both series see the same machine (alternating, not one run after the other: on a shared
    machine the speed drifts by more than the difference measured)."""

    def __init__(self) -> None:
        self.times, self.plain_times, self._start, self._plain = [], [], 0.0, None
        self.log_times = []  # per step: stage 0's log replay
        self.skipped = False  # whether the last stage skipped its rerun of `embed`
        # per step, on this rank: seconds in PipeStrategy.training_step and .backward (ours), and in the optimizer's
        # own step and zero_grad, its closure (the user's step, Lightning's closure and ours) excluded (torch's)
        self.ours, self.optimizer = [], []
        self.starts, self.recorders, self.tables = [], None, None  # for --actions

    def on_train_start(self, trainer, pl_module):
        self._plain = PlainSteps(dist.get_rank())
        logs.replay = self._timed(logs.replay, self.log_times)  # the strategy calls it once a step, after the pipeline
        # Lightning looks each up on the instance when it calls it
        strategy, optimizer = trainer.strategy, trainer.optimizers[0]
        for name in ("training_step", "backward"):
            setattr(strategy, name, self._timed(getattr(strategy, name), self.ours))
        optimizer.zero_grad = self._timed(optimizer.zero_grad, self.optimizer)
        step = optimizer.step

        def step_without_closure(closure=None):
            start, inside = time.perf_counter(), [0.0]
            try:
                return step(closure=self._timed(closure, inside) if closure is not None else None)
            finally:
                self.optimizer[-1] += time.perf_counter() - start - inside[0]

        optimizer.step = step_without_closure
        if ACTIONS:
            self.recorders = (trainer.strategy.pipeline.trace_steps(keep=STEPS), self._plain.pipe.trace_steps(keep=STEPS))

    @staticmethod
    def _timed(method, totals):
        """``method``, adding the seconds each call takes to ``totals[-1]``."""

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[-1] += time.perf_counter() - start

        return timed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.log_times.append(0.0)
        self.ours.append(0.0)
        self.optimizer.append(0.0)
        dist.barrier()  # both steps start with the ranks together (see the module's docstring)
        self._start = time.perf_counter()
        self.starts.append(self._start)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)
        self.plain_times.append(self._plain.step(batch_idx))

    def on_train_end(self, trainer, pl_module):
        per_rank = [None] * dist.get_world_size()
        stale = trainer.strategy._stale
        table = action_table(self.recorders, (self.starts, self._plain.starts), (self.times, self.plain_times)) \
            if ACTIONS else None
        dist.all_gather_object(per_rank, (self.log_times, stale is not None and bool(stale._skipped), table))
        self.log_times, self.skipped = per_rank[0][0], per_rank[-1][1]
        self.tables = [rank[2] for rank in per_rank]


def action_table(recorders, starts, times) -> list:
    """Per action of this rank's schedule: the median start and duration in ms, in a Lightning step and in a plain
    one (the steps after WARMUP), then the time from the end of the rank's last action to the step's end."""
    rows = []
    medians = []
    for recorder, begins, spans in zip(recorders, starts, times):
        records = recorder.records[WARMUP:]
        assert len(records) == len(begins) - WARMUP, "one pipeline step per training step"
        per_action: dict = {}
        tails = []
        for record, begin, span in zip(records, begins[WARMUP:], spans[WARMUP:]):
            for action, start, end in record.compute:
                per_action.setdefault(str(action), []).append((1e3 * (start - begin), 1e3 * (end - start)))
            tails.append(1e3 * (begin + span - record.compute[-1][2]))
        medians.append(({name: tuple(statistics.median(v[k] for v in values) for k in (0, 1))
                         for name, values in per_action.items()}, statistics.median(tails)))
    (ours, our_tail), (plain, plain_tail) = medians
    for name in ours:
        rows.append((name, *ours[name], *plain[name]))
    rows.append(("after", our_tail, None, plain_tail, None))
    return rows


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(BATCH * STEPS, WIDTH, generator=g),
                                          torch.randn(BATCH * STEPS, WIDTH, generator=g))


class PlainSteps:
    """The same stages, microbatches and optimizer through the plain API (its own copy of the model)."""

    def __init__(self, rank: int) -> None:
        torch.manual_seed(0)
        whole = Model()
        layers = list(whole.body)
        stage = nn.Sequential(whole.embed, *layers[: DEPTH]) if rank == 0 else nn.Sequential(*layers[DEPTH:], whole.head)
        self.rank = rank
        self.pipe = lightning_pipe.PipeDream(stage, chunks=MICROBATCHES)
        self.optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-4)
        self.x, self.y = data().tensors
        self.starts = []

    def step(self, step: int) -> float:
        xb, yb = (t[step * BATCH:(step + 1) * BATCH] for t in (self.x, self.y))
        dist.barrier()
        start = time.perf_counter()
        self.starts.append(start)
        self.pipe.forward_backward(*((xb,) if self.rank == 0 else ()), labels=(yb,) if self.rank == 1 else (),
                                   criterion=nn.functional.mse_loss if self.rank == 1 else None)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return time.perf_counter() - start


class LoopTimer(pl.Callback):
    """Lightning's own loop on one process: each single-device Trainer step on the whole model, then one step of
    a plain loop (forward, loss, backward, ``optimizer.step()``, ``zero_grad()``) on a copy of it."""

    def __init__(self) -> None:
        self.times, self.plain_times, self._start = [], [], 0.0

    def on_train_start(self, trainer, pl_module):
        torch.manual_seed(0)
        self.model = Model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x, self.y = data().tensors

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)
        xb, yb = (t[batch_idx * BATCH:(batch_idx + 1) * BATCH] for t in (self.x, self.y))
        start = time.perf_counter()
        model = self.model
        nn.functional.mse_loss(model.head(model.body(model.embed(xb))), yb).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.plain_times.append(time.perf_counter() - start)


def lightning_loop_cost() -> float:
    """Median seconds a single-device Trainer step takes beyond a plain loop step (same model, self.log included)."""
    timer = LoopTimer()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=SingleDeviceStrategy("cpu"), max_steps=STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer])
    trainer.fit(Model(), torch.utils.data.DataLoader(data(), batch_size=BATCH))
    return statistics.median(a - b for a, b in zip(timer.times[WARMUP:], timer.plain_times[WARMUP:]))


def main() -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        strategy=lightning_pipe.PipeStrategy(num_microbatches=MICROBATCHES, schedule="1f1b", balance=[DEPTH, DEPTH]),
    )
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH)
    trainer.fit(Model(), loader)
    loop = lightning_loop_cost() if dist.get_rank() == 0 else 0.0  # the other rank waits, idle
    dist.barrier()
    if dist.get_rank() == 0:
        ours, base = statistics.median(timer.times[WARMUP:]), statistics.median(timer.plain_times[WARMUP:])
        print(f"model: embed + {DEPTH} x (Linear({WIDTH}) + ReLU) + head, batch {BATCH} in {MICROBATCHES} "
              f"microbatches, 2 stages, 1F1B, AdamW, 1 thread per rank, gloo; median of {STEPS - WARMUP} steps, "
              "each Lightning step followed by a plain one, each step started by a barrier")
        log = statistics.median(timer.log_times[WARMUP:])
        print(f"lightning PipeStrategy step: {1e3 * ours:.2f} ms")
        print(f"plain PipeDream step:        {1e3 * base:.2f} ms")
        print(f"difference: {1e3 * (ours - base):.2f} ms a step (a cost per step and per microbatch: the same on a "
              "wider model, see --width)")
        print(f"in the difference: Lightning's own self.log {1e3 * log:.2f} ms (stage 0, median of "
              f"{len(timer.times) - WARMUP} steps); the last stage's rerun of embed "
              f"{'skipped' if timer.skipped else 'computed'} after the first step")
        paired = statistics.median(a / b for a, b in zip(timer.times[WARMUP:], timer.plain_times[WARMUP:]))
        print(f"median of the per-pair ratios (each Lightning step over the plain step after it): {paired:.3f}")
        print(f"Lightning's own loop on one process (a single-device Trainer step over a plain loop step, the whole "
              f"model, its self.log included): {1e3 * loop:.2f} ms; without it: glue_own_vs_plain="
              f"{(ours - loop) / base:.3f}")
        # the same split inside the pipelined run, per step on rank 0: Lightning's loop is what is left of the step
        # outside PipeStrategy.training_step and .backward and the optimizer's own step and zero_grad, plus its
        # self.log that the strategy replays; this counts every wait inside the strategy's hooks as ours
        steps = list(zip(timer.times, timer.ours, timer.optimizer, timer.log_times))[WARMUP:]
        in_run = statistics.median(t - o - opt + log_ for t, o, opt, log_ in steps)
        own = statistics.median(o + opt - log_ for _, o, opt, log_ in steps)
        print(f"Lightning's own loop in this run (rank 0: the step outside PipeStrategy's training_step and backward "
              f"and the optimizer's own step and zero_grad, plus its self.log): {1e3 * in_run:.2f} ms; the rest over "
              f"the plain step: glue_own_in_run_vs_plain={own / base:.3f}")
        if ACTIONS:
            print_actions(timer.tables)
        print(f"glue_vs_plain={ours / base:.3f}")


def print_actions(tables) -> None:
    print("per rank, per action (median over the timed steps, ms from the step's start): start and duration in the "
          "Lightning step, then in the plain step; 'after': from the end of the rank's last action to the step's end")
    for rank, rows in enumerate(tables):
        print(f"rank {rank}: action    start  duration | plain start  duration | extra duration")
        for name, start, duration, plain_start, plain_duration in rows:
            if duration is None:
                print(f"  {name:>6} {start:9.2f}           | {plain_start:11.2f}           |")
            else:
                print(f"  {name:>6} {start:9.2f} {duration:9.2f} | {plain_start:11.2f} {plain_duration:9.2f} | "
                      f"{duration - plain_duration:+14.2f}")


if __name__ == "__main__":
    main()
