"""Failing together: a failed rank tells the others, and nobody waits forever.

When an action raises, its rank writes a message to the process group's key-value store. Every
rank waits for its messages without blocking its main thread in C++, and checks the store while
it waits, so a failure anywhere stops every rank of the pipeline within a fraction of a second
instead of the 30-minute collective timeout. torch offers no way to do this for gloo, which is why
it is written here: a gloo ``Work`` has no future, ``is_completed()`` only turns true inside
``wait()``, ``wait(timeout)`` closes the connection for good, and ``abort()``/``shutdown()`` leave
a blocked ``wait()`` blocked. So gloo works are waited on by one helper thread while the main
thread waits on an event; NCCL works are polled with ``is_completed()``. A rank that dies
(SIGKILL) closes its sockets; its peers' receives then fail, and they report the dead peer.
"""

from __future__ import annotations

import atexit
import queue
import signal
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from lightning_pipe.errors import ConfigurationError, PipelineAbortedError

_POLL_STORE_EVERY = 0.05  # seconds between looks at the store while a message is late
_GRACE = 3.0  # seconds to wait for a failed peer's message after its connection broke


JOB_PREFIX = "lightning_pipe/job/"  # errors any rank of the job reports, for channels that watch the job


class ErrorChannel:
    """The first error reported by any rank of one pipeline (or of the job), through the store.

    Args:
        store: a ``torch.distributed.Store`` shared by the pipeline's ranks.
        prefix: keys are written under it; the same on every rank of the pipeline.
        timeout: how long a single message may be awaited before giving up.
        threaded: wait for works on a helper thread (gloo) instead of polling them (NCCL).

    With ``watch_job`` set (PipeStrategy sets it: a job with replicas cannot go on once one of
    them failed), errors reported anywhere in the job through :func:`report_job_error` stop the
    waits too. A store that stops answering counts as an error: it lives in global rank 0.
    """

    def __init__(self, store: Optional[dist.Store], prefix: str, timeout: timedelta, threaded: bool = True) -> None:
        self.store = dist.PrefixStore(prefix, store) if store is not None else None
        self.job = dist.PrefixStore(JOB_PREFIX, store) if store is not None else None
        self.timeout = timeout.total_seconds()
        self.watch_job = False
        self._waiter = _Waiter() if threaded else None

    def report(self, message: str) -> None:
        """Publish this rank's error (only the first one per pipeline is kept as the cause)."""
        note_failure()
        _publish(self.store, message)
        if self.watch_job:
            _publish(self.job, message)

    def first_error(self) -> Optional[str]:
        if self.store is None:
            return None
        try:
            for store in (self.store, self.job) if self.watch_job else (self.store,):
                if store.check(["error/1"]):
                    return store.get("error/1").decode()
        except Exception as exc:
            return (f"lost the connection to the job's store, which global rank 0 hosts ({type(exc).__name__}); "
                    "global rank 0 probably exited or died")
        return None

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` to complete, failing fast when another rank failed.

        Raises:
            PipelineAbortedError: another rank reported an error, a peer died, or ``timeout`` passed.
        """
        try:
            if self._waiter is not None:
                self._wait_threaded(work, what)
            else:
                if not work.is_completed():
                    self._poll(work, what)
                work.wait()
        except PipelineAbortedError:
            raise
        except Exception as exc:
            deadline = time.monotonic() + _GRACE
            cause = self.first_error()
            while cause is None and time.monotonic() < deadline:
                time.sleep(0.05)
                cause = self.first_error()
            if cause is None:
                raise PipelineAbortedError(
                    f"lost the connection while waiting for {what}: {exc}. A peer rank probably died "
                    "(killed, out of memory); check its log"
                ) from exc
            raise PipelineAbortedError(f"stopped while waiting for {what}, because another rank failed: {cause}") from exc

    def _check(self, start: float, what: str) -> None:
        cause = self.first_error()
        if cause is not None:
            raise PipelineAbortedError(f"stopped while waiting for {what}, because another rank failed: {cause}")
        if time.monotonic() - start > self.timeout:
            raise PipelineAbortedError(
                f"timed out after {self.timeout:.0f} s waiting for {what}; no rank reported an error. "
                "Raise `timeout` if a stage is legitimately this slow"
            )

    def _wait_threaded(self, work: dist.Work, what: str) -> None:
        slot = self._waiter.submit(work)
        start = time.monotonic()
        while not slot.done.wait(_POLL_STORE_EVERY):
            self._check(start, what)
        if slot.error is not None:
            raise slot.error

    def _poll(self, work: dist.Work, what: str) -> None:
        start = time.monotonic()
        next_check = start + _POLL_STORE_EVERY
        pause = 0.0
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_check:
                self._check(start, what)
                next_check = now + _POLL_STORE_EVERY
            # Yield first (the message is usually moments away), then back off to 200 us so a
            # long wait does not steal a core from the ranks that compute.
            time.sleep(pause)
            pause = min(pause * 2 + 1e-5, 2e-4)


def _publish(store: Optional[dist.Store], message: str) -> None:
    if store is None:
        return
    try:
        number = store.add("count", 1)
        store.set(f"error/{number}", message)
    except Exception:  # the store may be gone too; the raise on this rank still happens
        pass


def report_job_error(message: str) -> None:
    """Tell every pipeline of the job that watches it that this rank failed."""
    if dist.is_initialized():
        _publish(dist.PrefixStore(JOB_PREFIX, _store()), message)


_MEET_SECONDS = 5.0  # how long a failed rank waits for the others to fail too before its on_exception callbacks
_MEETINGS = {"count": 0}


def all_ranks_failed(world_size: int, rank: int, seconds: float = _MEET_SECONDS) -> bool:
    """Whether every rank of the job reached this point (its ``on_exception``) within ``seconds`` of the first one.

    Callbacks' ``on_exception`` may run collectives (``OnExceptionCheckpoint`` gathers the model to save it): where
    every rank failed together (a step error stops every stage) they all run them; where one rank failed alone, the
    others are inside a step or in Lightning's per-batch broadcast, and the collectives would wait for good. Each
    rank writes its arrival to the job's store; the first rank to see every arrival, or its deadline pass, decides
    for all of them in one atomic write (``compare_set``), so no two ranks decide differently. A store that stops
    answering (its host, global rank 0, is gone) counts as not all.

    Example:
        >>> all_ranks_failed(world_size=1, rank=0)
        True
    """
    if world_size == 1 or not dist.is_initialized():
        return True
    _MEETINGS["count"] += 1
    prefix = f"lightning_pipe/failed_together/{_MEETINGS['count']}/"
    decision = prefix + "decision"
    deadline = time.monotonic() + seconds
    try:
        store = _store()
        store.set(prefix + str(rank), "1")
        keys = [prefix + str(r) for r in range(world_size)]
        while not store.check([decision]):
            if store.check(keys) or time.monotonic() > deadline:
                store.compare_set(decision, "", "all" if store.check(keys) else "not all")
                break
            time.sleep(_POLL_STORE_EVERY)
        return store.get(decision) == b"all"
    except Exception:  # noqa: BLE001 (the store's host is gone: so is a rank)
        return False


class _Slot:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


class _Waiter:
    """A daemon thread that calls ``Work.wait()`` for the main thread, one work at a time.

    The thread ends after a second without work, or when :func:`end_helper_threads` stops it, and
    is started again on demand. After a failure it may stay blocked on a message that never comes;
    it holds no lock the main thread needs. It keeps no work once that work completed: see
    :func:`end_helper_threads` for why.
    """

    _IDLE_SECONDS = 1.0

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        _helpers.add(self)

    def submit(self, work: dist.Work) -> _Slot:
        slot = _Slot()
        with self._lock:
            self._queue.put((work, slot))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="lightning_pipe-waiter", daemon=True)
                self._thread.start()
        return slot

    def stop(self) -> Optional[threading.Thread]:
        """Ask the thread to end once its queue is empty; return it (None when there is none)."""
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
            return self._thread

    def _loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._IDLE_SECONDS)
            except queue.Empty:
                item = None
            if item is None:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            work, slot = item
            item = None
            try:
                work.wait()
            except BaseException as exc:  # handed to the main thread, which raises it
                slot.error = exc
            work = None  # before the slot is set: the main thread may then drop the last other reference
            slot.done.set()
            slot = None


# Objects whose helper threads end_helper_threads stops: this module's waiters and the receive
# links of lightning_pipe.arrivals (each has ``stop()``, returning its thread or None; a link also
# ``peer``, the global rank it receives from).
_helpers: "weakref.WeakSet" = weakref.WeakSet()
_PEER_EXIT_SECONDS = 15.0  # at exit after a failure: how long a thread blocked on a higher rank may take to end


def end_helper_threads(timeout: float = 1.0, after_failure: bool = False) -> None:
    """Stop this package's helper threads and wait up to ``timeout`` seconds for them to end.

    A helper thread is a daemon thread; one still running when the interpreter finalizes is
    ended as soon as it takes the GIL. If it takes the GIL inside torch's C++ code, as it does when
    it frees a gloo ``Work`` whose receive buffer Python holds (the ``Work`` is freed without the
    GIL, then the buffer needs it), the process aborts: "terminate called without an active
    exception" (seen in a loop of 2-process fits: a link thread leaving on its idle timeout just as
    the interpreter finalized). So the threads drop each work as soon as it completed, and at exit
    they are ended here, while the interpreter still runs them normally.

    ``after_failure``: on a rank that failed, a receive thread may be blocked on a message of a
    peer that failed too; its wait returns (with an error) when that peer's process exits and its
    connection closes, and the same abort follows if this interpreter is finalizing by then (seen
    in 2 of 3 two-process fits where one rank raised). So such threads are waited for too: a rank
    whose peer exits soon finds them ended. Where two ranks wait for each other, the higher global
    rank exits first: its threads blocked on a lower rank are not waited for (that rank stays alive,
    waiting, so they stay blocked until this process has gone), those blocked on a higher rank get
    up to :data:`_PEER_EXIT_SECONDS` to end (a peer's exit takes its own wait, then some 2 s of
    finalizing Lightning and torch), the others (on a message whose sender is not recorded)
    ``timeout``. A bound of 4 s, as before 2026-12-03, left 0.2 s to spare in a two-process fit,
    whose rank 0 aborted at exit in 1 of 4 runs, and more often on a busy machine.
    """
    start = time.monotonic()
    rank = dist.get_rank() if after_failure and dist.is_available() and dist.is_initialized() else None
    waits = []
    for helper in list(_helpers):
        thread = helper.stop()
        if thread is not None:
            peer = getattr(helper, "peer", None)
            if rank is None or peer is None:
                waits.append((thread, timeout))
            elif peer > rank:
                waits.append((thread, _PEER_EXIT_SECONDS))
    for thread, seconds in waits:
        thread.join(max(start + seconds - time.monotonic(), 0.0))


def end_launched_ranks(launcher: Any, grace_seconds: float = 5.0) -> None:
    """On the process that launched the others (Lightning's subprocess launcher): give them
    ``grace_seconds`` to fail on their own, then kill what is left.

    Lightning kills the other ranks only on KeyboardInterrupt; a rank of another replica can be
    blocked in a collective that a failure left unmatched, where no message of ours reaches it.
    """
    procs = getattr(launcher, "procs", None)
    if not procs:
        return
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    if any(p.poll() is None for p in procs):
        launcher.kill(signal.SIGKILL)


_exit = {"registered": False, "destroy": False, "failed": False}
_SETTLE_SECONDS = 0.05  # at exit, time given to gloo's worker threads to drop the works they finished


def end_process_groups_at_exit(destroy: bool) -> None:
    """Run :func:`end_process_groups` at exit, registered once per process.

    PipeStrategy passes ``destroy=True``: Lightning does not destroy the groups it creates. A plain
    :class:`~lightning_pipe.Pipeline` passes False: the groups are the user's, so at exit only the
    threads are given their moment (a user who destroyed the groups may still hold subgroups).
    """
    _exit["destroy"] = _exit["destroy"] or destroy
    if not _exit["registered"]:
        _exit["registered"] = True
        atexit.register(lambda: end_process_groups(destroy=_exit["destroy"]))


_FAILED_GROUP = "lightning_pipe/failed_group/"  # + a process group's name: a pipeline step failed on it


def _failed_key(group: Any) -> str:
    return _FAILED_GROUP + getattr(group, "group_name", "")


def note_failed_group(group: Any) -> None:
    """A pipeline step on ``group`` failed here: its messages may still be posted or in flight. Written to the job's
    store by every rank that saw the failure (the one that failed, those that stopped because of it), before its
    error reaches the caller. Best effort: where the store went with a failed rank 0, its error is the one to keep."""
    try:
        _store().set(_failed_key(group), "1")
    except Exception:  # noqa: BLE001 (the store's host may be gone: the step's own error is what the caller needs)
        pass


def refuse_failed_group(group: Any) -> None:
    """Refuse a new pipeline on a group a step failed on: a receive the failed step posted, or a message it sent,
    would pair with the new pipeline's (gloo matches by peer and tag), which then waits for good. Every rank reads
    the same store, so all of them refuse, before any message."""
    if _store().check([_failed_key(group)]):
        raise ConfigurationError(
            "a pipeline step on this process group failed in this process, and its messages may still be posted or "
            "in flight there: a new pipeline on it would take them for its own and wait for good. Build it on a new "
            "group (`torch.distributed.new_group(ranks)`), or restart the processes"
        )


def _store() -> Any:
    # Private API: the default store is the one every rank already shares (see pipeline.py).
    return dist.distributed_c10d._get_default_store()


def note_failure() -> None:
    """This rank failed: leave its process groups alone at exit (see :func:`end_process_groups`)."""
    _exit["failed"] = True


def end_process_groups(destroy: bool = True) -> None:
    """Let gloo's worker threads settle, then destroy the process groups, unless this rank failed.

    A gloo worker thread that drops the last reference to a tensor Python already let go of takes
    the GIL to free it. If the interpreter is finalizing by then, the thread cannot take it and the
    process aborts (SIGABRT, "terminate called without an active exception"; pytorch#190489). A
    pause that releases the GIL lets those threads finish first: in a loop of 2-process gloo runs
    ending right after an all-reduce, 4 of 25 aborted without it and none of 40 with it. Destroying
    the groups then joins the threads of every group nothing else holds. A rank that failed (it
    reported an error, or the script ends on an uncaught exception) keeps its groups: destroying
    one waits for its pending works, which may wait on a peer that is gone. NCCL groups are left
    to torch.

    This package's helper threads are ended first (:func:`end_helper_threads`); on a rank that
    failed, where one may be blocked on a message that never comes, the wait is bounded by rank order
    (see there).

    Args:
        destroy: False to only let the threads settle (the groups are someone else's to destroy).
    """
    failed = _exit["failed"] or hasattr(sys, "last_value")
    end_helper_threads(timeout=2.0 if failed else 1.0, after_failure=failed)
    time.sleep(_SETTLE_SECONDS)
    if not destroy or failed or not (dist.is_available() and dist.is_initialized()):
        return
    if "nccl" in str(dist.get_backend()):
        return
    dist.destroy_process_group()
