"""The named pipelines of the plain API: one class per schedule, as in haiscale.

Each is :class:`~lightning_pipe.pipeline.Pipeline` with its schedule fixed. ``GPipe``,
``PipeDream`` (1F1B), ``ZeroBubbleH1`` and ``ZeroBubbleH2`` take this rank's stage;
``Interleaved1F1B`` and ``ZeroBubbleV`` take the list of this rank's stages that
:func:`~lightning_pipe.partition` returns with ``num_model_chunks``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional, Sequence, Union

import torch.distributed as dist
from torch import nn

from lightning_pipe.pipeline import Pipeline


class GPipe(Pipeline):
    """GPipe: all forwards, then all backwards (the seed's ``haiscale.pipeline.GPipe``).

    Example (one process; more stages need one process each):
        >>> import os, torch, torch.distributed as dist
        >>> store = dist.HashStore()
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> model = GPipe(torch.nn.Sequential(torch.nn.Linear(3, 1)), chunks=2)
        >>> loss, _ = model.forward_backward(torch.ones(4, 3), criterion=torch.nn.functional.mse_loss,
        ...                                  labels=(torch.zeros(4, 1),))
        >>> loss.shape
        torch.Size([])
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        module: nn.Module,
        chunks: int,
        process_group: Optional[dist.ProcessGroup] = None,
        batch_dim: int = 0,
        checkpoint: Union[str, bool] = "never",
        broadcast_outputs: bool = True,
        timeout: timedelta = timedelta(minutes=30),
        deferred_batch_norm: bool = False,
        dp_group: Optional[dist.ProcessGroup] = None,
        count_activations: bool = False,
    ) -> None:
        super().__init__(
            module, chunks, process_group, batch_dim, checkpoint, "gpipe", broadcast_outputs, timeout,
            deferred_batch_norm=deferred_batch_norm, dp_group=dp_group,
            count_activations=count_activations,
        )


class PipeDream(Pipeline):
    """1F1B (PipeDream-flush): the same result as GPipe with at most ``num_stages`` microbatches in flight."""

    def __init__(
        self,
        module: nn.Module,
        chunks: int,
        process_group: Optional[dist.ProcessGroup] = None,
        batch_dim: int = 0,
        checkpoint: Union[str, bool] = False,
        timeout: timedelta = timedelta(minutes=30),
        deferred_batch_norm: bool = False,
        dp_group: Optional[dist.ProcessGroup] = None,
        count_activations: bool = False,
    ) -> None:
        super().__init__(
            module, chunks, process_group, batch_dim, checkpoint, "1f1b", False, timeout,
            deferred_batch_norm=deferred_batch_norm, dp_group=dp_group,
            count_activations=count_activations,
        )


class Interleaved1F1B(Pipeline):
    """Interleaved 1F1B (Megatron-LM): ``v`` stages per rank, ``v`` times less bubble than 1F1B.

    ``modules`` are this rank's stages in stage order, as
    ``partition(model, rank, nranks, num_model_chunks=v)`` returns them (rank ``r`` holds stages
    ``r, r + p, ...``); ``v = len(modules)``, at least 2. Any number of microbatches works (see
    :mod:`lightning_pipe.schedule.interleaved`).
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        chunks: int,
        process_group: Optional[dist.ProcessGroup] = None,
        batch_dim: int = 0,
        checkpoint: Union[str, bool] = "never",
        broadcast_outputs: bool = False,
        timeout: timedelta = timedelta(minutes=30),
        deferred_batch_norm: bool = False,
        dp_group: Optional[dist.ProcessGroup] = None,
        count_activations: bool = False,
    ) -> None:
        super().__init__(
            list(modules), chunks, process_group, batch_dim, checkpoint, "interleaved_1f1b", broadcast_outputs,
            timeout, deferred_batch_norm=deferred_batch_norm, virtual_stages=len(modules), dp_group=dp_group,
            count_activations=count_activations,
        )


class _SplitOneStagePerRank(Pipeline):
    """A zero-bubble schedule with one stage per rank; subclasses name it in ``_schedule``."""

    _schedule = ""

    def __init__(
        self,
        module: nn.Module,
        chunks: int,
        process_group: Optional[dist.ProcessGroup] = None,
        batch_dim: int = 0,
        checkpoint: Union[str, bool] = "never",
        broadcast_outputs: bool = False,
        timeout: timedelta = timedelta(minutes=30),
        deferred_batch_norm: bool = False,
        dp_group: Optional[dist.ProcessGroup] = None,
        count_activations: bool = False,
    ) -> None:
        super().__init__(
            module, chunks, process_group, batch_dim, checkpoint, self._schedule, broadcast_outputs, timeout,
            deferred_batch_norm=deferred_batch_norm, dp_group=dp_group,
            count_activations=count_activations,
        )


class ZeroBubbleH1(_SplitOneStagePerRank):
    """ZB-H1 (Qi et al., 2023): 1F1B with each backward split into input and weight gradients.

    The weight gradients fill the cool-down bubble: a third of 1F1B's idle time, at 1F1B's peak
    activation memory on the busiest rank (rank 0; every rank holds up to ``p`` microbatches).
    """

    _schedule = "zb_h1"


class ZeroBubbleH2(_SplitOneStagePerRank):
    """ZB-H2 (Qi et al., 2023): ZB-H1 with ``p - 1`` more forwards in flight on every rank.

    The same makespan as ZB-H1 under free messages, for up to ``2p - 1`` microbatches' activations
    per rank instead of ``p``; in return each message has time to arrive before it is needed, so a
    slow link costs far less (see :mod:`lightning_pipe.schedule.zero_bubble`). Gloo only for now.
    """

    _schedule = "zb_h2"


class ZeroBubbleV(Pipeline):
    """ZB-V (Qi et al., 2023): two stages per rank in a V, backwards split; nearly no bubble.

    ``modules`` are this rank's two stages, as ``partition(model, rank, nranks,
    num_model_chunks=2, placement="v")`` returns them (rank ``r`` holds stages ``r`` and
    ``2p - 1 - r``). The last stage is on rank 0, beside the first: rank 0 passes both the inputs
    and the labels, and gets the loss.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        chunks: int,
        process_group: Optional[dist.ProcessGroup] = None,
        batch_dim: int = 0,
        checkpoint: Union[str, bool] = "never",
        broadcast_outputs: bool = False,
        timeout: timedelta = timedelta(minutes=30),
        deferred_batch_norm: bool = False,
        dp_group: Optional[dist.ProcessGroup] = None,
        count_activations: bool = False,
    ) -> None:
        super().__init__(
            list(modules), chunks, process_group, batch_dim, checkpoint, "zbv", broadcast_outputs, timeout,
            deferred_batch_norm=deferred_batch_norm, dp_group=dp_group,
            count_activations=count_activations,
        )
