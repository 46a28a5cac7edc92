"""Deferred BatchNorm: running statistics per minibatch, not per microbatch.

A pipeline runs BatchNorm once per microbatch, so plain BatchNorm would update its running
statistics ``num_microbatches`` times per step, each from a fraction of the batch, with the
momentum applied each time. :class:`DeferredBatchNorm` still normalises each microbatch with that
microbatch's statistics (this is not changed), but only *accumulates* per-channel sums; the
pipeline commits them once per step, so the running mean, running variance and
``num_batches_tracked`` end exactly as after ONE forward of the whole minibatch. A forward that
is a checkpoint recomputation is not counted again. In eval mode the running statistics are used
as usual.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_pipe.checkpoint import is_recomputing


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose running statistics are committed once per minibatch.

    Example:
        >>> bn = DeferredBatchNorm(3)
        >>> batch = torch.randn(8, 3)
        >>> for microbatch in batch.chunk(4):
        ...     _ = bn(microbatch)
        >>> bn.commit()
        >>> reference = nn.BatchNorm1d(3)
        >>> _ = reference(batch)
        >>> torch.testing.assert_close(bn.running_mean, reference.running_mean)
        >>> torch.testing.assert_close(bn.running_var, reference.running_var)
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True, device=device, dtype=dtype)
        if not track_running_stats:
            raise ValueError("DeferredBatchNorm exists to defer running statistics; track_running_stats must be True")
        self._sum: Optional[torch.Tensor] = None
        self._sum_squares: Optional[torch.Tensor] = None
        self._count = 0

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _track(self, input: torch.Tensor) -> None:
        dims = [d for d in range(input.dim()) if d != 1]
        x = input.detach().to(torch.float64)
        total, squares = x.sum(dims), (x * x).sum(dims)
        self._sum = total if self._sum is None else self._sum + total
        self._sum_squares = squares if self._sum_squares is None else self._sum_squares + squares
        self._count += input.numel() // input.shape[1]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        if not is_recomputing():
            self._track(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def commit(self) -> None:
        """Fold the statistics tracked since the last commit into the running statistics."""
        if self._count == 0:
            return
        n = self._count
        mean = self._sum / n
        var = (self._sum_squares / n - mean * mean).clamp_min(0)
        unbiased = var * (n / (n - 1)) if n > 1 else var
        self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        with torch.no_grad():
            self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
        self._sum = self._sum_squares = None
        self._count = 0

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module) -> nn.Module:
        """Replace every BatchNorm (1d/2d/3d) in ``module`` with a DeferredBatchNorm; return the module.

        Parameters and buffers are moved over; a BatchNorm that is the root is returned replaced.
        """
        if isinstance(module, _BatchNorm) and not isinstance(module, DeferredBatchNorm) and module.track_running_stats:
            if isinstance(module, nn.SyncBatchNorm):
                raise ValueError("SyncBatchNorm cannot be deferred; convert it back to BatchNorm first")
            deferred = cls(module.num_features, module.eps, module.momentum, module.affine,
                           device=module.running_mean.device, dtype=module.running_mean.dtype)
            deferred.load_state_dict(module.state_dict())
            deferred.train(module.training)
            return deferred
        for name, child in list(module.named_children()):
            converted = cls.convert_deferred_batch_norm(child)
            if converted is not child:
                setattr(module, name, converted)
        return module


def commit_deferred_batch_norm(module: nn.Module) -> None:
    """Commit every DeferredBatchNorm in ``module`` (the pipeline calls this after each training step)."""
    for child in module.modules():
        if isinstance(child, DeferredBatchNorm):
            child.commit()
