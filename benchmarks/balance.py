"""Balance by measurement against balance by parameters, on a deliberately unbalanced body.

Model (generated here, nothing downloaded): 6 x Linear(64, 64), then 4 parameter-free token-mixing
blocks (``softmax(x x^T / sqrt(d)) x`` over a sequence of 512 tokens), each costing many Linear
layers of work while holding no parameters (at 256 tokens a block sits near the cost where the best
split flips, and measured times picked [7, 3] or [8, 2] from run to run). Counting parameters puts the cut after the third
Linear; measuring puts nearly all the Linears on the first stage. For each balance the script
prints the per-layer cost it used, the 1F1B makespan those measured layer times imply and the
measured step time of the plain API on 2 ranks (gloo, one thread per rank, FileStore rendezvous),
every variant timed in the same two processes in rotated rounds, the median per variant.

The last line is ``time_vs_parameters=<x> flops_vs_parameters=<y>``: the parameter balance's step
time divided by the measured-time balance's, and by the FLOP balance's (above 1: faster).

    python benchmarks/balance.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lightning_pipe import PipeDream, partition  # noqa: E402
from lightning_pipe.partition import (  # noqa: E402
    balance_by_cost, balance_by_parameters, layer_flops, layer_times, stage_costs,
)

NUM_STAGES, WIDTH, TOKENS, BATCH, CHUNKS = 2, 64, 512, 32, 8


class TokenMix(nn.Module):
    """Parameter-free mixing over the sequence: softmax(x x^T / sqrt(d)) x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ x.transpose(-1, -2) / x.shape[-1] ** 0.5, dim=-1) @ x


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(6)], *[TokenMix() for _ in range(4)])


def simulated_makespan(costs, balance) -> float:
    """1F1B makespan of one step with messages free: every stage's forward + backward of each
    microbatch, plus ``m - 1`` more of the slowest stage (the pipeline runs at its pace).

    ``costs`` are each layer's forward + backward cost of one microbatch.
    """
    per_stage = stage_costs(costs, balance)
    return sum(per_stage) + (CHUNKS - 1) * max(per_stage)


def _worker(rank: int, store_path: str, balances: dict, rounds: int, steps: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, NUM_STAGES), rank=rank, world_size=NUM_STAGES)
    model = build_model()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, TOKENS, WIDTH, generator=g)
    y = torch.randn(BATCH, TOKENS, WIDTH, generator=g)
    pipes = {name: PipeDream(partition(model, rank, NUM_STAGES, balance=balance), chunks=CHUNKS)
             for name, balance in balances.items()}
    times = {name: [] for name in pipes}
    names = list(pipes)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            pipe = pipes[name]
            pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))  # warm-up
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
                times[name].append(elapsed.item())
    if rank == 0:
        results.put({name: statistics.median(t) for name, t in times.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model()
    sample = torch.randn(BATCH // CHUNKS, TOKENS, WIDTH)
    costs = {"time": layer_times(model, sample, repeat=5), "flops": [float(f) for f in layer_flops(model, sample)]}
    balances = {"parameters": balance_by_parameters(model, NUM_STAGES)}
    for kind, layer_costs in costs.items():
        balances[kind] = balance_by_cost(layer_costs, NUM_STAGES)
    print(f"model: 6 x Linear({WIDTH}, {WIDTH}) + 4 x TokenMix over {TOKENS} tokens; batch {BATCH} in {CHUNKS} "
          f"microbatches, {NUM_STAGES} stages, 1F1B, float32, 1 thread per rank, gloo")
    print("per-layer forward+backward time (ms): " + " ".join(f"{1e3 * c:.2f}" for c in costs["time"]))
    print("per-layer forward+backward GFLOP:     " + " ".join(f"{1e-9 * c:.3f}" for c in costs["flops"]))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, store, balances, args.rounds, args.steps, results))
                 for r in range(NUM_STAGES)]
        for p in procs:
            p.start()
        measured = results.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
    print(f"\n{'balance by':<12} {'split':<10} {'simulated makespan (ms)':>24} {'measured step (ms)':>19}")
    for name, balance in balances.items():
        print(f"{name:<12} {str(balance):<10} {1e3 * simulated_makespan(costs['time'], balance):>24.1f} "
              f"{1e3 * measured[name]:>19.1f}")
    print(f"time_vs_parameters={measured['parameters'] / measured['time']:.2f} "
          f"flops_vs_parameters={measured['parameters'] / measured['flops']:.2f}")


if __name__ == "__main__":
    main()
