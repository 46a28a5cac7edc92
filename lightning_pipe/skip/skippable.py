"""Declaring skip connections: ``@skippable(stash=[...], pop=[...])``, ``stash`` and ``pop``."""

from __future__ import annotations

import inspect
from typing import Any, FrozenSet, Iterable, Optional, Type

import torch
from torch import nn

from lightning_pipe.skip.namespace import Namespace
from lightning_pipe.skip.tracker import Key, current_tracker


class stash:  # noqa: N801 - used as ``yield stash(name, tensor)``, like a keyword
    """``yield stash(name, tensor)`` inside a skippable forward hands ``tensor`` on."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name = name
        self.tensor = tensor


class pop:  # noqa: N801
    """``tensor = yield pop(name)`` inside a skippable forward takes the stashed tensor."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """A layer wrapped by :func:`skippable`; holds the original module as ``module``."""

    stashable_names: FrozenSet[str] = frozenset()
    poppable_names: FrozenSet[str] = frozenset()

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.namespaces: dict = {}

    def isolate(self, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> "Skippable":
        """Put this layer's skip names (or ``only`` some) into namespace ``ns``; returns self.

        Example:
            >>> @skippable(stash=["x"])
            ... class Keep(nn.Module):
            ...     def forward(self, x):
            ...         yield stash("x", x)
            ...         return x
            >>> ns = Namespace()
            >>> Keep().isolate(ns).namespaced("x") == (ns.id, "x")
            True
        """
        names = set(only) if only is not None else self.stashable_names | self.poppable_names
        for name in names:
            self.namespaces[name] = ns
        return self

    def namespaced(self, name: str) -> Key:
        ns = self.namespaces.get(name)
        return (ns.id if ns is not None else None, name)

    def stashed_keys(self) -> list:
        return [self.namespaced(n) for n in sorted(self.stashable_names)]

    def popped_keys(self) -> list:
        return [self.namespaced(n) for n in sorted(self.poppable_names)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        result = self.module(*args, **kwargs)
        if not inspect.isgenerator(result):
            return result
        tracker = current_tracker()
        reply = None
        try:
            while True:
                request = result.send(reply)
                reply = self._serve(request, tracker)
        except StopIteration as stop:
            return stop.value

    def _serve(self, request: Any, tracker) -> Optional[torch.Tensor]:
        if isinstance(request, stash):
            if request.name not in self.stashable_names:
                raise RuntimeError(f"{type(self.module).__name__} stashed {request.name!r}, which it did not declare in stash=")
            tracker.save(self.namespaced(request.name), request.tensor)
            return None
        if isinstance(request, pop):
            if request.name not in self.poppable_names:
                raise RuntimeError(f"{type(self.module).__name__} popped {request.name!r}, which it did not declare in pop=")
            return tracker.load(self.namespaced(request.name))
        raise TypeError(f"a skippable forward may yield only stash(...) or pop(...), got {request!r}")


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()):
    """Class decorator declaring the skip names a layer stashes and pops.

    Example:
        >>> from lightning_pipe.skip import stash as stash_, pop as pop_
        >>> @skippable(stash=["skip"])
        ... class Stash(nn.Module):
        ...     def forward(self, x):
        ...         yield stash_("skip", x)
        ...         return x * 2
        >>> @skippable(pop=["skip"])
        ... class Pop(nn.Module):
        ...     def forward(self, x):
        ...         skip = yield pop_("skip")
        ...         return x + skip
        >>> nn.Sequential(Stash(), Pop())(torch.ones(1)).item()
        3.0
    """
    stash_names, pop_names = frozenset(stash), frozenset(pop)

    def decorate(cls: Type[nn.Module]) -> Type[Skippable]:
        class Wrapped(Skippable):
            stashable_names = stash_names
            poppable_names = pop_names

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(cls(*args, **kwargs))

        Wrapped.__name__ = Wrapped.__qualname__ = cls.__name__
        Wrapped.__module__ = cls.__module__
        Wrapped.__doc__ = cls.__doc__
        return Wrapped

    return decorate
