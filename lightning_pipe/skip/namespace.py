"""Namespaces keep equal skip names of different layer instances apart."""

from __future__ import annotations

import itertools

_counter = itertools.count(1)


class Namespace:
    """A scope for skip names; see :meth:`Skippable.isolate`.

    Namespaces are numbered in creation order, so ranks that build the same model the same way
    agree on them (they are compared across processes).

    Example:
        >>> Namespace() == Namespace()
        False
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = next(_counter)

    def __repr__(self) -> str:
        return f"Namespace({self.id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("Namespace", self.id))


DEFAULT = None  # names declared without a namespace live here
