"""Activation memory per stage for each checkpoint mode under GPipe and 1F1B.

Counts, exactly and deterministically, the bytes that each stage keeps for backward at its peak
during one training step (``lightning_pipe.memory.ActivationMeter``: the tensors autograd saves,
each counted once, parameters excluded). Model: 8 x (Linear(256, 256) + ReLU) in float32, batch
64, 8 microbatches, 4 stages on the CPU with gloo; the processes are started by this script.

    python benchmarks/activation_memory.py
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe import GPipe, PipeDream, partition

SCHEDULES = {"gpipe": GPipe, "1f1b": PipeDream}
MODES = ("never", "except_last", "always")


def _measure(rank: int, world: int, store_path: str, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(args.width, args.width), nn.ReLU())])
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    for schedule, cls in SCHEDULES.items():
        for mode in MODES:
            pipe = cls(partition(model, rank, world), chunks=args.chunks, checkpoint=mode, count_activations=True)
            pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
            results.put((schedule, mode, rank, pipe.stage.meter.peak_bytes))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_measure, args=(r, args.stages, store, args, results)) for r in range(args.stages)]
        for p in procs:
            p.start()
        rows = [results.get(timeout=300) for _ in range(args.stages * len(SCHEDULES) * len(MODES))]
        for p in procs:
            p.join(timeout=60)
    peak = {(s, m, r): b for s, m, r, b in rows}
    print(f"peak activation memory per stage (KiB), {args.stages} stages, {args.chunks} microbatches, "
          f"batch {args.batch}, width {args.width}")
    print(f"{'schedule':9} {'checkpoint':12} " + " ".join(f"stage {r:<4}" for r in range(args.stages)) + "  total")
    for schedule in SCHEDULES:
        for mode in MODES:
            values = [peak[(schedule, mode, r)] / 1024 for r in range(args.stages)]
            print(f"{schedule:9} {mode:12} " + " ".join(f"{v:10.0f}" for v in values) + f"  {sum(values):6.0f}")


if __name__ == "__main__":
    main()
