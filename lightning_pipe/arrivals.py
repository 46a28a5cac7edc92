"""Receives waited for as soon as they are posted: one helper thread per link, none on the critical path.

A gloo ``Work`` only completes inside ``wait()``, and a rank must not block in ``wait()`` on the
main thread (a failed peer would leave it blocked; see :mod:`lightning_pipe.faults`). Handing
each wait to a helper thread when the data is needed costs four thread switches per message,
about 10 % of a step of an overhead-bound pipeline. Here each link (peer rank and tag) has a
helper thread that waits for the link's receives in the order they were posted, which is the
order the link delivers them, and marks each one arrived; the main thread then finds most
messages arrived already and takes them without a thread switch. When one has not arrived, the
main thread sleeps on a condition, looking at the error channel every 50 ms as
:meth:`~lightning_pipe.faults.ErrorChannel.wait` does, and fails the same way.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Dict, Optional

from lightning_pipe.errors import PipelineAbortedError
from lightning_pipe.faults import ErrorChannel, _helpers

_POLL_STORE_EVERY = 0.05  # seconds between looks at the store while a message is late
_IDLE_SECONDS = 1.0  # a link's thread ends after this long without receives


class Arrival:
    """One posted receive: its works, and whether (and how) they completed."""

    __slots__ = ("works", "done", "error")

    def __init__(self, works: list) -> None:
        self.works = works
        self.done = False
        self.error: Optional[BaseException] = None


class _Link:
    """The helper thread of one link: waits for its arrivals in order.

    Like :class:`~lightning_pipe.faults._Waiter`'s, the thread keeps no arrival it completed, and
    :func:`~lightning_pipe.faults.end_helper_threads` ends it at exit (see there for why).
    """

    def __init__(self, condition: threading.Condition, name: str, peer: int) -> None:
        self.peer = peer  # the global rank whose messages it waits for (see end_helper_threads)
        self.queue: deque = deque()
        self.condition = condition
        self.name = name
        self.thread: Optional[threading.Thread] = None
        self.stopping = False
        self.wake = threading.Condition(threading.Lock())
        _helpers.add(self)

    def add(self, arrival: Arrival) -> None:
        with self.wake:
            self.queue.append(arrival)
            self.stopping = False
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self.thread.start()
            else:
                self.wake.notify()

    def stop(self) -> Optional[threading.Thread]:
        """Ask the thread to end once its queue is empty; return it (None when there is none)."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
            return self.thread

    def _loop(self) -> None:
        while True:
            with self.wake:
                if not self.queue and (self.stopping or not self.wake.wait(_IDLE_SECONDS)) and not self.queue:
                    self.thread = None
                    return
                if not self.queue:
                    continue
                arrival = self.queue.popleft()
            try:
                for work in arrival.works:
                    work.wait()
            except BaseException as exc:  # raised by the main thread when it takes this arrival
                arrival.error = exc
            work = None
            with self.condition:
                arrival.done = True
                self.condition.notify_all()
            arrival = None  # the main thread may have taken it and dropped it: the last reference may be this one


class Arrivals:
    """Waits for posted receives ahead of need, per link.

    Args:
        errors: the pipeline's error channel (how failures elsewhere are learnt, and reported).
    """

    def __init__(self, errors: ErrorChannel) -> None:
        self.errors = errors
        self._condition = threading.Condition(threading.Lock())
        self._links: Dict[tuple, _Link] = {}

    def watch(self, link: tuple, works: list) -> Arrival:
        """Start waiting for ``works`` (one message's) on ``link`` (the sender's global rank, the tag) behind the
        link's earlier ones."""
        arrival = Arrival(works)
        if link not in self._links:
            self._links[link] = _Link(self._condition, f"lightning_pipe-recv-{link}", link[0])
        self._links[link].add(arrival)
        return arrival

    def take(self, arrival: Arrival, what: str) -> None:
        """Return once ``arrival`` completed; raise as the error channel would if it cannot."""
        if not arrival.done:
            self._sleep_until_done(arrival, what)
        if arrival.error is not None:
            error = arrival.error
            arrival.error = None
            self.errors.wait(_Failed(error), what)  # the channel finds the cause and raises

    def _sleep_until_done(self, arrival: Arrival, what: str) -> None:
        start = time.monotonic()
        with self._condition:
            while not arrival.done:
                if self._condition.wait(_POLL_STORE_EVERY) or arrival.done:
                    continue
                cause = self.errors.first_error()
                if cause is not None:
                    raise PipelineAbortedError(f"stopped while waiting for {what}, because another rank failed: {cause}")
                if time.monotonic() - start > self.errors.timeout:
                    raise PipelineAbortedError(
                        f"timed out after {self.errors.timeout:.0f} s waiting for {what}; no rank reported an error. "
                        "Raise `timeout` if a stage is legitimately this slow"
                    )


class _Failed:
    """A work that already failed: waiting for it raises its error."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def wait(self) -> bool:
        raise self.error

    def is_completed(self) -> bool:
        return True
