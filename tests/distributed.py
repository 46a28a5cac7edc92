"""Run a function on several CPU processes joined by gloo, with a hard timeout.

Each process gets its own FileStore rendezvous (no ports), runs ``fn(rank, world_size, *args)``,
destroys its process group and sends back its result or its formatted exception. A process that
hangs is killed when the timeout passes and the run fails with every rank's state.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, List


def _worker(fn, rank, world_size, store_path, args, results, threads):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
    except BaseException as exc:  # report everything, including errors the test expects
        results.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class DistributedFailure(AssertionError):
    def __init__(self, errors: dict) -> None:
        self.errors = errors
        super().__init__("\n\n".join(f"rank {r}: {e[2]}" for r, e in sorted(errors.items())))


def _context():
    """A fork server that imported torch and lightning_pipe once: each rank starts in milliseconds
    instead of importing them again (seconds each), and starts without the test process's threads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "lightning_pipe", "tests.distributed"])
    return ctx


def run(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, threads: int = 1,
        expect_errors: bool = False) -> List[Any]:
    """Run ``fn`` on ``world_size`` processes and return their results by rank.

    With ``expect_errors`` the per-rank outcomes are returned as ``("ok", value)`` or
    ``("error", (type_name, message, traceback))`` instead of raising.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store_path, args, results, threads), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outcomes = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcomes) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"distributed run of {fn.__name__} timed out after {timeout}s; "
                        f"finished ranks: {sorted(outcomes)}"
                    )
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                    outcomes[rank] = (status, value)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes]
                    if dead:
                        raise RuntimeError(f"ranks {dead} died without reporting (exit codes {[procs[r].exitcode for r in dead]})")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if expect_errors:
        return [outcomes[r] for r in range(world_size)]
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    if errors:
        raise DistributedFailure(errors)
    return [outcomes[r][1] for r in range(world_size)]
