"""Whether a table can run when each block of sends and receives goes out as one group, as on NCCL.

The NCCL transport issues the communication between two compute actions of a row as one
``batch_isend_irecv`` group; a rank's groups run one after another on one stream, in row order.
The model here is strict rendezvous: every operation of a group is posted when its rank reaches
the group (every earlier group of that rank done), an operation completes once its partner is
posted too, and a group completes once all its operations have. A send and a receive match when
they name the same message (kind, stages, microbatch), as in :func:`simulate`; on a table that
:func:`validate` passes that is also the FIFO order of each link, which the transport follows.
NCCL completes a send whose data fits its buffers
before the receive is posted, so a table this model passes never depends on that buffering, while
one it refuses may run with small messages and hang once they outgrow the buffers.
:attr:`ScheduleSpec.runs_on_nccl` follows this model.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from lightning_pipe.schedule.action import COMPUTE_KINDS
from lightning_pipe.schedule.lower import is_lowered, lower
from lightning_pipe.schedule.simulate import MESSAGE_OF, SENDS

Operation = Tuple[str, tuple]  # ("S" or "R", the message: kind, source stage, target stage, microbatch)


def _groups(tables: tuple) -> List[List[List[Operation]]]:
    """Per rank, its groups: the operations of each maximal run of sends and receives in its row."""
    per_rank = []
    for row in tables:
        groups: List[List[Operation]] = []
        block: List[Operation] = []
        for action in row:
            kind, stage, microbatch, peer = action
            if kind in COMPUTE_KINDS:
                if block:
                    groups.append(block)
                    block = []
            elif kind in SENDS:
                block.append(("S", (MESSAGE_OF[kind], stage, peer, microbatch)))
            else:
                block.append(("R", (MESSAGE_OF[kind], peer, stage, microbatch)))
        if block:
            groups.append(block)
        per_rank.append(groups)
    return per_rank


def grouped_deadlock(tables: tuple) -> Optional[str]:
    """Run the table's groups under strict rendezvous; None if every group completes, else who waits.

    Example:
        >>> from lightning_pipe.schedule import make_table
        >>> grouped_deadlock(make_table("zb_h1", 2, 4)) is None
        True
        >>> print(grouped_deadlock(make_table("zb_h2", 2, 4)))
        rank 0's group 3 waits for rank 1's group 4, behind its group 3; rank 1's group 3 waits for rank 0's group 4, behind its group 3
    """
    groups = _groups(tables if is_lowered(tables) else lower(tables))
    where: Dict[Operation, Tuple[int, int]] = {op: (r, g) for r, rank_groups in enumerate(groups)
                                              for g, group in enumerate(rank_groups) for op in group}
    current = [0] * len(groups)  # each rank's group under way: it and every group before it are posted
    while True:
        moved = False
        for r, rank_groups in enumerate(groups):
            while current[r] < len(rank_groups) and all(
                    current[peer] >= g for peer, g in (where[("R" if side == "S" else "S", message)]
                                                       for side, message in rank_groups[current[r]])):
                current[r] += 1
                moved = True
        if all(current[r] == len(rank_groups) for r, rank_groups in enumerate(groups)):
            return None
        if not moved:
            break
    waits = []
    for r, rank_groups in enumerate(groups):
        if current[r] < len(rank_groups):
            for side, message in rank_groups[current[r]]:
                peer, g = where[("R" if side == "S" else "S", message)]
                if current[peer] < g:
                    waits.append(f"rank {r}'s group {current[r]} waits for rank {peer}'s group {g}, "
                                 f"behind its group {current[peer]}")
                    break
    return "; ".join(waits)
