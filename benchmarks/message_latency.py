"""What a message costs between two ranks on this machine, by how the receiver waits for it.

An overhead-bound 1F1B step (``pipeline_efficiency.py --tiny``) is a ping-pong: in its steady
state each action waits for the other rank's last message, so a step costs about ``m`` round
trips on top of its compute. This script measures one round trip over gloo (2 processes, one
thread each, FileStore rendezvous in a temporary directory, a 4 x 4 float32 tensor each way),
rank 1 echoing what rank 0 sends, with the receiver waiting in three ways:

* ``blocking``: post the receive when the message is needed and block in ``Work.wait()`` on the
  main thread, as torch.distributed.pipelining's schedules do;
* ``posted``: the receive posted before the peer sends (as our executor posts ahead of need),
  then the same blocking ``wait()``;
* ``ours``: posted ahead, and waited for by :class:`lightning_pipe.arrivals.Arrivals` (a helper
  thread per link marks it arrived; the main thread sleeps on a condition until then), as our
  pipelines do. A blocked ``wait()`` on the main thread returns only when the peer's process exits
  or sends, so a peer that fails but stays alive would keep the rank waiting until the process
  group's timeout; the helper thread is what lets a rank stop within a second then.

``--work-us N`` makes rank 1 compute (spin) N µs between receiving and echoing, as a stage
computes between a message in and a message out. Each variant runs ``--trips`` round trips per
round, rounds rotated, the median per variant printed; the last line is
``ours_vs_blocking=<t_ours / t_blocking> extra_us_per_message=<(t_ours - t_blocking) / 2>``.

    python benchmarks/message_latency.py                 # about 20 s on 2 cores
    python benchmarks/message_latency.py --work-us 90    # with a tiny stage's compute per message
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_pipe.arrivals import Arrivals  # noqa: E402

VARIANTS = ("blocking", "posted", "ours")
PING, PONG = 0, 1  # tags: rank 0 to rank 1, and back


class _NoErrors:
    """The error channel Arrivals asks while a message is late: here nothing ever fails."""

    timeout = 60.0

    def first_error(self) -> None:
        return None


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _round_trips(variant: str, rank: int, trips: int, work: float, arrivals: Arrivals) -> float:
    """Seconds for ``trips`` round trips of ``variant``, measured on rank 0."""
    group = dist.group.WORLD
    inbox, outbox = torch.zeros(4, 4), torch.ones(4, 4)
    peer, tag_in, tag_out = (1, PONG, PING) if rank == 0 else (0, PING, PONG)
    receive: Callable[[], Callable[[], None]]
    if variant == "ours":
        def receive():
            arrival = arrivals.watch((peer, tag_in), [group.recv([inbox], peer, tag_in)])
            return lambda: arrivals.take(arrival, "the echo")
    else:
        def receive():
            work = group.recv([inbox], peer, tag_in)
            return work.wait
    dist.barrier()
    start = time.perf_counter()
    pending = receive() if variant != "blocking" else None
    for _ in range(trips):
        if rank == 0:
            sent = group.send([outbox], peer, tag_out)
            (pending or receive())()
            sent.wait()
        else:
            (pending or receive())()
            _spin(work)
            sent = group.send([outbox], peer, tag_out)
            sent.wait()
        if variant != "blocking":
            pending = receive()  # the next message's receive, posted before the peer sends it
    elapsed = time.perf_counter() - start
    if pending is not None:  # each rank posted one receive more than it needed: both are filled before the next variant
        sent = group.send([outbox], peer, tag_out)
        pending()
        sent.wait()
    return elapsed


def _rank_main(rank: int, workdir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(workdir, "store"), 2), rank=rank, world_size=2)
    try:
        arrivals = Arrivals(_NoErrors())
        times: Dict[str, List[float]] = {v: [] for v in VARIANTS}
        for round_index in range(args.rounds):
            order = VARIANTS[round_index % 3:] + VARIANTS[: round_index % 3]
            for variant in order:
                times[variant].append(_round_trips(variant, rank, args.trips, args.work_us * 1e-6, arrivals) / args.trips)
        if rank == 0:
            with open(os.path.join(workdir, "times.pkl"), "wb") as file:
                pickle.dump(times, file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=1000, help="round trips per variant and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--work-us", type=float, default=0.0, help="rank 1's compute between receiving and echoing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_rank_main, args=(workdir, args), nprocs=2, join=True)
        with open(os.path.join(workdir, "times.pkl"), "rb") as file:
            times = pickle.load(file)
    median = {v: statistics.median(times[v]) * 1e6 for v in VARIANTS}
    print(f"2 ranks over gloo, a 4 x 4 float32 tensor each way, rank 1 computing {args.work_us:g} µs before it echoes; "
          f"median of {args.rounds} rounds of {args.trips} round trips")
    for variant in VARIANTS:
        spread = ", ".join(f"{t * 1e6:.1f}" for t in sorted(times[variant]))
        print(f"{variant:10s} {median[variant]:8.1f} µs per round trip   (rounds: {spread})")
    print(f"ours_vs_blocking={median['ours'] / median['blocking']:.3f} "
          f"extra_us_per_message={(median['ours'] - median['blocking']) / 2:.1f}")


if __name__ == "__main__":
    main()
