"""The static skip layout of a sequential model: who stashes, who pops, and what crosses stages."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from torch import nn

from lightning_pipe.skip.skippable import Skippable
from lightning_pipe.skip.tracker import Key


def declarations(layers: Sequence[Tuple[str, nn.Module]]) -> List[Tuple[str, Key, str]]:
    """``(layer name, key, "stash" | "pop")`` for every skippable module among ``layers``, in order."""
    out = []
    for name, layer in layers:
        for module in layer.modules():
            if isinstance(module, Skippable):
                out.extend((name, key, "pop") for key in module.popped_keys())
                out.extend((name, key, "stash") for key in module.stashed_keys())
    return out


def _label(key: Key) -> str:
    return repr(key[1]) if key[0] is None else f"{key[1]!r} (namespace {key[0]})"


def check(decls: Sequence[Tuple[str, Key, str]]) -> List[str]:
    """Every problem with a model's stashes and pops, in model order."""
    problems = []
    stashed: Dict[Key, str] = {}
    popped: Dict[Key, str] = {}
    for layer, key, kind in decls:
        if kind == "stash":
            if key in stashed:
                problems.append(f"layer {layer!r} stashes {_label(key)} again (layer {stashed[key]!r} stashes it "
                                "first); isolate one of them in its own Namespace")
            stashed.setdefault(key, layer)
        else:
            if key in popped:
                problems.append(f"layer {layer!r} pops {_label(key)} again (layer {popped[key]!r} pops it first); "
                                "isolate one of them in its own Namespace")
            elif key not in stashed:
                problems.append(f"layer {layer!r} pops {_label(key)}, which no earlier layer stashes")
            popped.setdefault(key, layer)
    for key, layer in stashed.items():
        if key not in popped:
            problems.append(f"layer {layer!r} stashes {_label(key)}, which no later layer pops")
    return problems


def verify_skippables(module: nn.Sequential) -> None:
    """Check that every stash is popped exactly once by a later layer, and vice versa.

    Raises:
        TypeError: listing every mismatch at once.

    Example:
        >>> from lightning_pipe.skip import skippable, stash
        >>> @skippable(stash=["x"])
        ... class Keep(nn.Module):
        ...     def forward(self, x):
        ...         yield stash("x", x)
        ...         return x
        >>> verify_skippables(nn.Sequential(Keep()))
        Traceback (most recent call last):
        ...
        TypeError: the model's skip connections do not match:
          - layer '0' stashes 'x', which no later layer pops
    """
    problems = check(declarations(list(module.named_children())))
    if problems:
        raise TypeError("the model's skip connections do not match:\n" + "\n".join(f"  - {p}" for p in problems))


class SkipLayout:
    """Which stage stashes and which pops each skip, from every stage's declarations.

    Args:
        per_stage: for each stage, its :func:`declarations` (gathered from every rank).
    """

    def __init__(self, per_stage: Sequence[Sequence[Tuple[str, Key, str]]]) -> None:
        problems = check([d for stage in per_stage for d in stage])
        if problems:
            raise TypeError("the model's skip connections do not match:\n" + "\n".join(f"  - {p}" for p in problems))
        stash_stage = {key: s for s, decls in enumerate(per_stage) for _, key, kind in decls if kind == "stash"}
        pop_stage = {key: s for s, decls in enumerate(per_stage) for _, key, kind in decls if kind == "pop"}
        # keys crossing from stage a to stage b, in a fixed order so both ends agree
        self.crossing: Dict[Tuple[int, int], List[Key]] = {}
        for key in sorted(stash_stage, key=lambda k: (k[0] or 0, k[1])):
            a, b = stash_stage[key], pop_stage[key]
            if a != b:
                self.crossing.setdefault((a, b), []).append(key)

    @property
    def routes(self) -> Tuple[Tuple[int, int], ...]:
        """The (stash stage, pop stage) pairs that carry skip tensors."""
        return tuple(sorted(self.crossing))

    def outgoing(self, stage: int) -> Dict[int, List[Key]]:
        return {b: keys for (a, b), keys in self.crossing.items() if a == stage}

    def incoming(self, stage: int) -> Dict[int, List[Key]]:
        return {a: keys for (a, b), keys in self.crossing.items() if b == stage}
