"""The user's step, cut where the body is called: what the first stage runs, and its results."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from lightning_pipe.checkpoint import should_checkpoint
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.lightning.body import BodyReached
from lightning_pipe.microbatch import gather

if TYPE_CHECKING:
    from lightning_pipe.strategy import PipeStrategy


def loss_of(output: Any, hook: str) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise ConfigurationError(
            f"under PipeStrategy, {hook} must return the loss (a tensor, or a dict with 'loss') for every "
            f"microbatch, got {type(output).__name__}; skipping a batch by returning None is not supported"
        )
    return loss


class FirstStage(nn.Module):
    """The first stage's module: the user's step up to (and through) the local part of the body."""

    def __init__(self, strategy: "PipeStrategy", module: nn.Module) -> None:
        super().__init__()
        self.module = module  # registered so its parameters are not counted as activations
        self.__dict__["strategy"] = strategy  # not a submodule

    def forward(self, batch: Any):
        strategy = self.strategy
        body = strategy._body
        last = body.num_stages == 1
        index = strategy._first_stage_calls
        strategy._first_stage_calls += 1
        strategy._recorder.start_microbatch()
        body.mode = "local" if last else "stop"
        body.checkpoint_layers = torch.is_grad_enabled() and should_checkpoint(
            strategy.checkpoint, index, len(strategy._pipeline.last_sizes)
        )
        try:
            output = getattr(self.module, strategy._hook)(batch, *strategy._hook_args)
        except BodyReached as reached:
            return reached.outputs
        finally:
            body.mode = "local"
            body.checkpoint_layers = False
        if not last:
            raise ConfigurationError(
                f"{strategy._hook} returned without calling the body `self.{strategy._body_path}`; "
                "under PipeStrategy every step must call it once"
            )
        return loss_of(output, strategy._hook) if strategy._hook == "training_step" else (output,)


def merge_outputs(results: Sequence[Any]) -> Any:
    if all(r is None for r in results):
        return None
    try:
        return gather(list(results))
    except Exception:  # outputs that do not concatenate (strings, ragged lists) stay per microbatch
        return list(results)
