"""The helper threads that wait for gloo works: they keep no completed work, and end at exit.

A helper thread still holding a gloo ``Work`` when the interpreter finalizes frees it there; the
receive buffer it frees then needs the GIL, and the process aborts ("terminate called without an
active exception"; seen in a loop of 2-process fits). These tests use stand-in works (any object
with ``wait()``), so they need no process group.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from datetime import timedelta

import pytest

from lightning_pipe import arrivals as arrivals_module
from lightning_pipe import faults
from lightning_pipe.arrivals import Arrivals
from lightning_pipe.faults import ErrorChannel, end_helper_threads

# Idle threads here wait a minute, not a second, before ending on their own, and the tests allow SLOW seconds:
# a thread that ended on its idle timeout could not show whether it kept a work or ended when asked, and a busy
# machine can stall a test for a second.
SLOW = 5.0


@pytest.fixture(autouse=True)
def idle_for_a_minute(monkeypatch):
    monkeypatch.setattr(arrivals_module, "_IDLE_SECONDS", 60.0)
    monkeypatch.setattr(faults._Waiter, "_IDLE_SECONDS", 60.0)
    yield
    end_helper_threads(timeout=SLOW)  # none left to the next test, idle for a minute


class _Work:
    """A stand-in for a gloo ``Work`` (what the helper threads call: ``wait()``)."""

    def wait(self) -> bool:
        return True


def _helpers_alive() -> list:
    return [t.name for t in threading.enumerate() if t.name.startswith("lightning_pipe-")]


def _freed(ref: weakref.ref, within: float = SLOW) -> bool:
    deadline = time.monotonic() + within
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return ref() is None


def test_a_receive_link_keeps_no_work_it_completed():
    errors = ErrorChannel(None, "test/", timedelta(seconds=5))
    arrivals = Arrivals(errors)
    work = _Work()
    ref = weakref.ref(work)
    arrival = arrivals.watch(("peer", 0), [work])
    arrivals.take(arrival, "a stand-in message")
    del work, arrival
    assert _helpers_alive(), "the link's thread should still be idle-waiting for more receives"
    assert _freed(ref), "the link's thread still holds the work it completed"
    end_helper_threads()


def test_the_waiter_keeps_no_work_it_completed():
    errors = ErrorChannel(None, "test/", timedelta(seconds=5))
    work = _Work()
    ref = weakref.ref(work)
    errors.wait(work, "a stand-in work")
    del work
    assert _helpers_alive(), "the waiter's thread should still be idle-waiting for more works"
    assert _freed(ref), "the waiter's thread still holds the work it completed"
    end_helper_threads()


def test_end_helper_threads_ends_idle_threads_at_once_and_they_start_again_on_demand():
    errors = ErrorChannel(None, "test/", timedelta(seconds=5))
    arrivals = Arrivals(errors)
    arrivals.take(arrivals.watch(("peer", 1), [_Work()]), "a stand-in message")
    errors.wait(_Work(), "a stand-in work")
    assert len(_helpers_alive()) >= 2
    end_helper_threads(timeout=SLOW)
    assert not _helpers_alive(), f"{_helpers_alive()} still idle-waiting: not ended when asked"
    arrivals.take(arrivals.watch(("peer", 1), [_Work()]), "a stand-in message")  # a stopped link serves again
    errors.wait(_Work(), "a stand-in work")
    end_helper_threads(timeout=SLOW)
    assert not _helpers_alive()
