"""Random draws that do not depend on the stage: one seed per step, one stream per microbatch.

Stage 0 draws a seed at the start of every step and sends it down the pipeline in the step
header. Every piece of a step that may draw random numbers then starts from a state derived from
that seed and from *what* it is, never from how much the rank drew before: stage ``s``'s forward
of microbatch ``i`` starts from ``derive(seed, i, s)``, and each run of a Lightning user's step
for microbatch ``i`` (on the first stage, and again on the last one) from
``derive(seed, i, USER_STEP)``, so both runs draw the same numbers. When the step ends, every rank
of the pipeline is left in the state ``derive(seed, END)``: what runs between steps (data
augmentation, the next seed) draws alike on every stage.

torch's CPU generator and the current accelerator's generator are reseeded for every forward;
Python's :mod:`random` and NumPy's global generator are reseeded too where user code runs (the
user's step, and between steps), because steps draw from them as well. ``torch.manual_seed``
costs ~0.2 ms (it visits every backend); seeding the generators directly costs ~1 us.
"""

from __future__ import annotations

import random

import torch

try:
    import numpy
except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
    numpy = None

USER_STEP = -1  # the stream of a user's step (stage streams are the stage indices, >= 0)
END = -2  # the state every rank is left in after a step

_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finalizer: neighbouring inputs give unrelated outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def derive(seed: int, *keys: int) -> int:
    """A 63-bit seed for the stream named by ``keys`` within the step seeded ``seed``.

    Example:
        >>> derive(7, 0, 1) == derive(7, 0, 1) != derive(7, 1, 0)
        True
    """
    value = _mix(seed & _MASK)
    for key in keys:
        value = _mix(value ^ (key & _MASK))
    return value & ((1 << 63) - 1)


def draw_step_seed() -> int:
    """A fresh step seed from torch's default CPU generator (stage 0 calls this)."""
    return int(torch.randint(0, 1 << 62, (), dtype=torch.int64).item())


def seed_torch(seed: int, device: torch.device) -> None:
    """Seed torch's CPU generator and, on an accelerator, that device's generator."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()].manual_seed(seed)


def seed_all(seed: int, device: torch.device) -> None:
    """Seed torch (CPU and ``device``), Python's ``random`` and NumPy's global generator."""
    seed_torch(seed, device)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed & 0xFFFFFFFF)
