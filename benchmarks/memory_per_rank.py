"""Memory each rank holds under PipeStrategy, against what its stage needs.

A body of 16 x Linear(2048, 2048) (256 MiB of float32 parameters), AdamW, trained for a few steps
on CPU with PipeStrategy over 1, 2 and 4 processes, the body built either in ``__init__`` (every
rank builds the whole model, then releases the other stages' layers) or in ``configure_model()``
(on the meta device: each rank materializes only its stage). Every rank measures its peak resident
memory (``ru_maxrss``) above its resident memory just before the model was created, and compares
it with the ideal: its stage's parameters, gradients and AdamW's two states (4 x the stage's
parameter bytes) plus the modules outside the body it runs. ``gather_full_model=False``: after
``fit`` a rank would otherwise hold the whole trained model on purpose.

    python benchmarks/memory_per_rank.py           # p = 1, 2, 4, both ways of building; about 3 minutes
    python benchmarks/memory_per_rank.py --soak    # 1000 steps at p = 4: resident memory at steps 100 and 1000
    python benchmarks/memory_per_rank.py --glibc-default

The ranks run with ``MALLOC_MMAP_THRESHOLD_=131072`` (unless ``--glibc-default``): glibc raises its
mmap threshold as large blocks are freed (up to 32 MiB), after which freed 16 MiB tensors stay in
its heap instead of going back to the system, and the resident size measures what glibc keeps
rather than what the process holds. The optimizer is AdamW with its default (per-parameter) loop
on CPU; its one-parameter temporary counts as overhead here.

The last line is ``per_rank_vs_ideal=<x>``: the worst rank's peak over its ideal, at p = 4 with
the body built in configure_model() (goal: at most 1.15).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

WIDTH, DEPTH = 2048, 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, ROOT)
    import torch
    from torch import nn

    import lightning.pytorch as pl
    import lightning_pipe

    torch.set_num_threads(1)
    baseline = rss_bytes()

    class Body(pl.LightningModule):
        def __init__(self, meta: bool) -> None:
            super().__init__()
            self.meta = meta
            self.inp = nn.Linear(8, WIDTH)
            self.body = None if meta else self._body()

        @staticmethod
        def _body() -> nn.Sequential:
            return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

        def configure_model(self) -> None:
            if self.body is None:
                self.body = self._body()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.body(self.inp(x)).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=False)

    class Measure(pl.Callback):
        def __init__(self) -> None:
            self.at = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in (100, 1000):
                self.at[trainer.global_step] = rss_bytes()

        def on_train_end(self, trainer, pl_module):
            strategy = trainer.strategy
            local = [p for p in pl_module.parameters() if not p.is_meta]
            stage = sum(p.numel() * p.element_size() for n, p in pl_module.named_parameters()
                        if n.startswith("body.") and not p.is_meta)
            outside = sum(p.numel() * p.element_size() for n, p in pl_module.named_parameters()
                          if not n.startswith("body.") and not p.is_meta)
            with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
                json.dump({"rank": trainer.global_rank, "stage": getattr(strategy, "stage_index", 0),
                           "peak": peak_bytes() - baseline, "now": rss_bytes() - baseline, "stage_bytes": stage,
                           "outside_bytes": outside, "materialized": len(local), "soak": self.at}, f)

    pl.seed_everything(0)
    model = Body(args.meta)
    strategy = lightning_pipe.PipeStrategy(pipe_size=args.stages, num_microbatches=4, gather_full_model=False,
                                           log_pipeline_metrics=False, state_dict_type="full")
    data = torch.utils.data.TensorDataset(torch.randn(8 * args.steps, 8))
    trainer = pl.Trainer(accelerator="cpu", devices=args.stages, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Measure()])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))


def run(stages: int, meta: bool, steps: int, glibc_default: bool = False) -> list:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--stages", str(stages), "--steps", str(steps),
               "--out", out] + (["--meta"] if meta else [])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        if not glibc_default:
            env["MALLOC_MMAP_THRESHOLD_"] = "131072"
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        ranks = []
        for name in sorted(os.listdir(out)):
            with open(os.path.join(out, name)) as f:
                ranks.append(json.load(f))
        return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--meta", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=4, help="training steps per run")
    parser.add_argument("--soak", action="store_true", help="1000 steps at p = 4: resident memory at steps 100 and 1000")
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold")
    args = parser.parse_args()
    if args.child:
        return child(args)
    mib = 2 ** 20
    if args.soak:
        ranks = run(4, True, 1000, args.glibc_default)
        for r in ranks:
            at = {int(k): v for k, v in r["soak"].items()}
            print(f"rank {r['rank']}: resident {at[100] / mib:.0f} MiB at step 100, {at[1000] / mib:.0f} MiB at step 1000 "
                  f"({(at[1000] - at[100]) / at[100]:+.1%})")
        return
    print(f"{'built in':<16} {'p':>2} {'rank':>4} {'peak MiB':>9} {'ideal MiB':>10} {'ratio':>6}")
    worst = {}
    for meta in (False, True):
        for stages in (1, 2, 4):
            for r in run(stages, meta, args.steps, args.glibc_default):
                ideal = 4 * r["stage_bytes"] + 4 * r["outside_bytes"]
                ratio = r["peak"] / ideal
                worst[(meta, stages)] = max(worst.get((meta, stages), 0.0), ratio)
                print(f"{'configure_model' if meta else '__init__':<16} {stages:>2} {r['rank']:>4} {r['peak'] / mib:>9.0f} "
                      f"{ideal / mib:>10.0f} {ratio:>6.2f}")
    print(f"per_rank_vs_ideal={worst[(True, 4)]:.2f}")


if __name__ == "__main__":
    main()
