"""Pause Python's cyclic garbage collector while big tables are built and checked.

A table for 64 ranks and 1024 microbatches holds up to a million actions, each a small tuple that
can never be part of a reference cycle. Python still tracks every one and re-scans them in its
generational collections while they are being created, which more than doubles the time to
generate, lower and validate such a table. Nothing here creates cycles, so pausing the collector
for the length of one call frees nothing later than it would have been freed.
"""

from __future__ import annotations

import functools
import gc
from typing import Callable, TypeVar

T = TypeVar("T", bound=Callable)


def gc_paused(function: T) -> T:
    """Run ``function`` with the garbage collector paused (and restored after, if it was on)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not gc.isenabled():
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper  # type: ignore[return-value]
