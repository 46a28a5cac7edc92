"""Placement of stages on ranks: the one rule that maps a stage to the rank that runs it.

**The rule.** A stage runs on the rank whose row holds its compute actions (``F``, ``B``, ``I``,
``W``); a table never splits a stage over two rows (:func:`~lightning_pipe.schedule.validate`
rejects that). :func:`stage_ranks` reads this mapping from a table, and ``lower``, ``validate``,
``simulate`` and ``format_table`` all use it. Communication actions keep naming the peer *stage*
(``0SF2@1``); the executor maps it to a rank with this same mapping.

The generators lay stages out in one of two ways (``num_ranks = p``):

* ``"loop"``: stage ``s`` on rank ``s % p`` (GPipe, 1F1B and ZB-H1 with one stage per rank;
  interleaved 1F1B with ``v`` stages per rank, rank ``r`` holding ``r, r + p, ..., r + (v-1)p``,
  as in Megatron-LM).
* ``"v"``: stage ``s`` on rank ``s`` for ``s < p`` and on rank ``2p - 1 - s`` otherwise (ZB-V: rank
  ``r`` holds stages ``r`` and ``2p - 1 - r``, so the last rank holds the two middle stages and
  rank 0 holds the first and the last).

Two consecutive stages on the same rank exchange nothing over the network: lowering adds no send
or receive between them, and the consumer takes the producer's output locally.
"""

from __future__ import annotations

from lightning_pipe.errors import ConfigurationError, ScheduleError
from lightning_pipe.schedule.action import COMPUTE_KINDS

PLACEMENTS = ("loop", "v")


def stage_ranks(tables: tuple) -> tuple:
    """Return the rank of each stage, read from the rows that hold its compute actions.

    Raises:
        ScheduleError: a stage has compute actions on two ranks, or stages do not count from 0.

    Example:
        >>> from lightning_pipe.schedule import zbv
        >>> stage_ranks(zbv(2, 2))
        (0, 1, 1, 0)
    """
    owner: dict = {}
    for r, row in enumerate(tables):
        for a in row:
            if a.kind in COMPUTE_KINDS and owner.setdefault(a.stage_index, r) != r:
                raise ScheduleError(
                    f"stage {a.stage_index} has compute actions on rank {owner[a.stage_index]} and on rank {r}; "
                    "a stage runs on one rank"
                )
    if sorted(owner) != list(range(len(owner))):
        raise ScheduleError(f"stages {sorted(owner)} must count from 0 without gaps")
    return tuple(owner[s] for s in range(len(owner)))


def placement(style: str, num_ranks: int, num_stages: int) -> tuple:
    """Return the rank of each of ``num_stages`` stages laid out on ``num_ranks`` ranks.

    Example:
        >>> placement("loop", 2, 4)
        (0, 1, 0, 1)
        >>> placement("v", 3, 6)
        (0, 1, 2, 2, 1, 0)
    """
    if style not in PLACEMENTS:
        raise ConfigurationError(f"placement style must be one of {PLACEMENTS}, got {style!r}")
    if num_ranks < 1 or num_stages % num_ranks:
        raise ConfigurationError(
            f"{num_stages} stages cannot be spread evenly over {num_ranks} ranks: "
            "num_stages must be a positive multiple of num_ranks"
        )
    if style == "v" and num_stages != 2 * num_ranks:
        raise ConfigurationError(
            f"the 'v' placement puts exactly 2 stages on each rank: num_stages must be {2 * num_ranks} "
            f"for {num_ranks} ranks, got {num_stages}"
        )
    p = num_ranks
    if style == "loop":
        return tuple(s % p for s in range(num_stages))
    return tuple(s if s < p else 2 * p - 1 - s for s in range(num_stages))
