"""precision="16-mixed" under PipeStrategy: loss scaling per microbatch, one scale for the whole job."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def share_loss_scaler(precision_plugin: Any, device: torch.device) -> None:
    """``precision="16-mixed"``: one loss scale for the whole job, and a step skipped on every rank
    when any rank found an inf or NaN gradient.

    Lightning's mixed-precision plugin unscales, checks and steps each rank's optimizer with a
    ``GradScaler``, which sees only this rank's gradients: one stage would skip a step the others
    take, and the scales would drift apart. torch's ``ShardedGradScaler`` (written for FSDP, whose
    ranks also hold different parameters) all-reduces the found-inf flags over a process group in
    ``unscale_``; over the world, every stage and replica skips the same steps and updates the
    scale alike. The plugin's scaler is replaced by one in the same state.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return
    shared = ShardedGradScaler(device=device.type, enabled=scaler.is_enabled(), process_group=dist.group.WORLD)
    if scaler.is_enabled():
        shared.load_state_dict(scaler.state_dict())
    precision_plugin.scaler = shared


def loss_scale(precision_plugin: Any, device: torch.device) -> float:
    """The factor the step's losses are multiplied by before backward: the loss scaler's scale, or 1."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.scale(torch.ones((), device=device)))  # also starts the scaler's state lazily
