"""Process layout for data x pipeline parallelism: which ranks form each pipeline and replica group.

``world = pp x dp`` with pp outermost (as Megatron and torchtitan lay it out): stage ``s`` holds
the ranks ``s*dp ... s*dp+dp-1`` of the group, so a pipeline's point-to-point traffic crosses
nodes while each stage's gradient all-reduce stays among neighbouring ranks.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist

from lightning_pipe.errors import ConfigurationError


def layout(index: int, pp_size: int, dp_size: int) -> Tuple[int, int]:
    """``(stage, replica)`` of the rank at position ``index`` of the group.

    Example:
        >>> [layout(i, 2, 3) for i in range(6)]
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    """
    return index // dp_size, index % dp_size


def make_subgroups(
    pp_size: int, dp_size: Optional[int] = None, group: Optional[dist.ProcessGroup] = None
) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Split ``group`` (default: the world) into data-parallel and pipeline groups.

    Args:
        pp_size: ranks per pipeline (the number of stages).
        dp_size: pipelines (replicas); default ``group size // pp_size``.
        group: the ranks to split; every one of them must call this with the same arguments.

    Returns:
        ``(dp_group, pp_group)`` of the calling rank: the replicas of its stage, and its pipeline.
        Pass ``pp_group`` to ``GPipe``/``PipeDream`` as ``process_group`` and average gradients
        over ``dp_group`` after each step.

    Raises:
        ConfigurationError: ``pp_size * dp_size`` is not the group's size.
    """
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if dp_size is None:
        dp_size = len(ranks) // pp_size if pp_size > 0 else 0
    if pp_size < 1 or dp_size < 1 or pp_size * dp_size != len(ranks):
        raise ConfigurationError(
            f"make_subgroups(pp_size={pp_size}, dp_size={dp_size}) needs pp_size * dp_size == the group's "
            f"{len(ranks)} ranks; choose a pp_size that divides {len(ranks)}"
        )
    if group is None:
        from torch.distributed.device_mesh import init_device_mesh

        backend = dist.get_backend()
        device_type = "cuda" if backend == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (pp_size, dp_size), mesh_dim_names=("pp", "dp"))
        return mesh.get_group("dp"), mesh.get_group("pp")
    # A sub-group: only its members take part, so create the groups with local synchronization.
    me = ranks.index(dist.get_rank())
    stage, replica = layout(me, pp_size, dp_size)
    dp_group = dist.new_group(ranks[stage * dp_size:(stage + 1) * dp_size], use_local_synchronization=True)
    pp_group = dist.new_group(ranks[replica::dp_size], use_local_synchronization=True)
    return dp_group, pp_group
