"""Skip connections across pipeline stages.

A layer declares what it stashes and pops with :func:`skippable`; its ``forward`` is a generator
that ``yield stash(name, tensor)`` to hand a tensor on and ``tensor = yield pop(name)`` to take one.
The pipeline reads these declarations, and each skip tensor travels straight from the stage that
stashes it to the stage that pops it (its gradient straight back), never relayed through the
stages in between. Without a pipeline, a skippable model runs like any other module.
"""

from lightning_pipe.skip.layout import SkipLayout, verify_skippables
from lightning_pipe.skip.namespace import Namespace
from lightning_pipe.skip.skippable import Skippable, pop, skippable, stash

__all__ = ["Namespace", "SkipLayout", "Skippable", "pop", "skippable", "stash", "verify_skippables"]
