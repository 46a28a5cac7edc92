"""The GPipe schedule: all forwards, then all backwards (Huang et al., 2019).

Backwards run in reverse microbatch order, as autograd runs them in torchgpipe: the last
microbatch's backward can start right after its forward, which is why ``checkpoint="except_last"``
leaves exactly that microbatch un-checkpointed.
"""

from __future__ import annotations

from lightning_pipe.schedule._checks import check_grid
from lightning_pipe.schedule._gc import gc_paused
from lightning_pipe.schedule.action import B, F, Action


@gc_paused
def gpipe(num_stages: int, num_microbatches: int) -> tuple:
    """Return GPipe's compute actions, one tuple per rank (rank ``s`` runs stage ``s``).

    Example:
        >>> gpipe(2, 2)
        ((0F0, 0F1, 0B1, 0B0), (1F0, 1F1, 1B1, 1B0))
    """
    check_grid(num_stages, num_microbatches)
    m = num_microbatches
    return tuple(
        tuple(Action(F, s, i) for i in range(m)) + tuple(Action(B, s, i) for i in reversed(range(m)))
        for s in range(num_stages)
    )


@gc_paused
def gpipe_forward(num_stages: int, num_microbatches: int) -> tuple:
    """Return the forward-only actions (evaluation, prediction) for every rank.

    Example:
        >>> gpipe_forward(2, 2)
        ((0F0, 0F1), (1F0, 1F1))
    """
    check_grid(num_stages, num_microbatches)
    return tuple(tuple(Action(F, s, i) for i in range(num_microbatches)) for s in range(num_stages))
