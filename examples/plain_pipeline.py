"""Pipeline parallelism with the plain PyTorch API (no Lightning): 1F1B on two CPU processes.

    python examples/plain_pipeline.py --steps 100

The script starts itself on two processes (``torch.multiprocessing.spawn``, gloo, a FileStore
rendezvous in a temporary directory: no ports). Each process builds the same small byte-level
transformer, keeps its half with :func:`lightning_pipe.partition` and trains it with
:class:`lightning_pipe.PipeDream` on the Python standard library's own sources (read at run time,
see :mod:`examples.stdlib_lm.data`). Stage 0 feeds the inputs, the last stage computes the loss
and prints it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_pipe  # noqa: E402
from examples.stdlib_lm.data import read_stdlib_bytes  # noqa: E402
from examples.stdlib_lm.model import Block, Embedding, Head  # noqa: E402
from lightning_pipe.schedule import format_table, one_f_one_b  # noqa: E402

NUM_STAGES = 2


def build_model(args: argparse.Namespace) -> nn.Sequential:
    """embedding, transformer blocks, head: one nn.Sequential of layers that take and return one tensor."""
    torch.manual_seed(args.seed)  # the same initial weights on every process
    blocks = [Block(args.d_model, n_heads=4) for _ in range(args.layers)]
    return nn.Sequential(Embedding(args.d_model, args.seq_len), *blocks, Head(args.d_model))


def batches(args: argparse.Namespace):
    """Random windows of stdlib source bytes; every process draws the same ones."""
    data = read_stdlib_bytes(args.max_bytes).long()
    generator = torch.Generator().manual_seed(args.seed)
    while True:
        starts = torch.randint(data.numel() - args.seq_len - 1, (args.batch_size,), generator=generator)
        windows = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()])
        yield windows[:, :-1], windows[:, 1:]


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(rank: int, args: argparse.Namespace, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, NUM_STAGES)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=NUM_STAGES)
    try:
        stage = lightning_pipe.partition(build_model(args), rank, NUM_STAGES)
        pipe = lightning_pipe.PipeDream(stage, chunks=args.microbatches)
        optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr)
        last = pipe.stage_index() == pipe.num_stages() - 1
        print(f"[stage {rank}] layers {list(stage._modules)}, "
              f"{sum(p.numel() for p in stage.parameters()):,} parameters", flush=True)
        losses = []
        start = time.perf_counter()
        for step, (x, y) in zip(range(args.steps), batches(args)):
            optimizer.zero_grad()
            # Only the first stage needs inputs and only the last stage needs labels.
            loss, _ = pipe.forward_backward(
                *((x,) if rank == 0 else ()), criterion=next_byte_loss, labels=(y,) if last else ()
            )
            optimizer.step()
            if last:
                losses.append(loss.item())
                if step % args.print_every == 0 or step == args.steps - 1:
                    print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
        if last:
            window = max(1, min(5, len(losses) // 4))
            first, final = sum(losses[:window]) / window, sum(losses[-window:]) / window
            print(f"first loss {first:.4f}, last loss {final:.4f} "
                  f"(means of {window} steps; {time.perf_counter() - start:.1f}s for {args.steps} steps)", flush=True)
    finally:
        dist.destroy_process_group()


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per batch")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-bytes", type=int, default=500_000, help="bytes of stdlib sources to read")
    parser.add_argument("--print-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    print(f"1F1B schedule, {NUM_STAGES} stages x {args.microbatches} microbatches (F forward, B backward, .. idle):")
    print(format_table(one_f_one_b(NUM_STAGES, args.microbatches)), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(train, args=(args, os.path.join(tmp, "store")), nprocs=NUM_STAGES, join=True)


if __name__ == "__main__":
    main()
