"""What PipeStrategy's Lightning glue costs per training step, against the plain API on the same stages.

Model (generated here): ``embed`` Linear(512, 512), a body of 8 x (Linear(512, 512) + ReLU),
``head`` Linear(512, 512), MSE loss against random targets; batch 64 in 4 microbatches, 2 stages,
1F1B, AdamW, float32, 2 CPU processes over gloo, one thread each. The stages are the same in both
runs: stage 0 holds ``embed`` and body layers 0-3, stage 1 body layers 4-7 and ``head``.

* ``lightning``: ``Trainer(strategy=PipeStrategy(...))`` with a LightningModule whose step logs its
  loss every step (Lightning's defaults otherwise: ``log_every_n_steps=50``, so the ``pipe/``
  metrics are measured every 50 steps). A step is timed from ``on_train_batch_start`` to
  ``on_train_batch_end`` on global rank 0: the pipelined forward and backward with the user's
  step run per microbatch, log recording and replay, the per-step broadcast of the last stage's
  results, gradient hand-off, ``optimizer.step`` and ``zero_grad``.
* ``plain``: then, in the same two processes, :class:`lightning_pipe.PipeDream` on the same stage
  modules: ``forward_backward``, ``optimizer.step()``, ``zero_grad()``.

The last line is ``glue_vs_plain=<x>``: the median Lightning step over the median plain step
(goal: at most 1.05).

    python benchmarks/glue_cost.py      # about a minute on 2 cores; Lightning starts rank 1 itself
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import lightning_pipe  # noqa: E402

WIDTH, DEPTH, BATCH, MICROBATCHES, STEPS, WARMUP = 512, 8, 64, 4, 60, 10


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

    def on_train_start(self, trainer, pl_module):
        self._plain = PlainSteps(dist.get_rank())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._start)
        self.plain_times.append(self._plain.step(batch_idx))


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

    def step(self, step: int) -> float:
        xb, yb = (t[step * BATCH:(step + 1) * BATCH] for t in (self.x, self.y))
        start = time.perf_counter()
        self.pipe.forward_backward(*((xb,) if self.rank == 0 else ()), labels=(yb,) if self.rank == 1 else (),
                                   criterion=nn.functional.mse_loss if self.rank == 1 else None)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return time.perf_counter() - start


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
    if dist.get_rank() == 0:
        ours, base = statistics.median(timer.times[WARMUP:]), statistics.median(timer.plain_times[WARMUP:])
        print(f"model: embed + {DEPTH} x (Linear({WIDTH}) + ReLU) + head, batch {BATCH} in {MICROBATCHES} "
              f"microbatches, 2 stages, 1F1B, AdamW, 1 thread per rank, gloo; median of {STEPS - WARMUP} steps, "
              "each Lightning step followed by a plain one")
        print(f"lightning PipeStrategy step: {1e3 * ours:.2f} ms")
        print(f"plain PipeDream step:        {1e3 * base:.2f} ms")
        print(f"glue_vs_plain={ours / base:.3f}")


if __name__ == "__main__":
    main()
