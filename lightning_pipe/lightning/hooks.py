"""What Lightning's hooks see under PipeStrategy: the whole model, the step's state, combined logs.

- :class:`BodySwap`: ``on_fit_start`` callbacks (the model summary) see the unsplit body.
- :class:`StepState`: before epoch-end hooks, the attributes the last stage's steps built are
  handed to the other stages, so ``on_validation_epoch_end`` computes the same on every rank.
- :func:`combine_optimizer_step_logs`: what ``on_before_optimizer_step`` hooks log on each stage
  is gathered over the pipeline and combined per name (Lightning's ``grad_norm`` made whole-model),
  then logged on every rank.
"""

from __future__ import annotations

from typing import Any, List

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_pipe.lightning.logs import LogRecorder, combine_stages, replay


class BodySwap(Callback):
    """Puts the unsplit body into the module (``whole``) or the local stage back, at fit start."""

    def __init__(self, strategy: Any, whole: bool) -> None:
        self.strategy = strategy
        self.whole = whole

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        split = self.strategy.split
        split.install(whole=self.whole)
        if not self.whole:  # the last callback: both swaps are done for this fit
            trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, BodySwap)]


class StepState(Callback):
    """Hands the state built by the last stage's steps to the other stages before epoch-end hooks."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.share_step_state()

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.share_step_state()

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.share_step_state()

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.share_step_state()


def overrides(obj: Any, hook: str) -> bool:
    """Whether a LightningModule or a Callback defines its own ``hook``."""
    base = LightningModule if isinstance(obj, LightningModule) else Callback
    return getattr(type(obj), hook) is not getattr(base, hook)


def overrides_optimizer_step_hook(module: LightningModule, callbacks: List[Callback]) -> bool:
    return any(overrides(obj, "on_before_optimizer_step") for obj in [module, *callbacks])


def combine_optimizer_step_logs(strategy: Any) -> None:
    """Gather and combine the logs of ``on_before_optimizer_step`` hooks over the pipeline.

    Lightning calls these hooks (and then clips gradients) from the precision plugin's
    ``_after_closure``; that call is wrapped: the hooks' ``self.log`` calls are recorded on every
    stage, gathered over the pipeline, combined by :func:`~lightning_pipe.lightning.logs.combine_stages`
    and logged on every rank. One collective per optimizer step, installed only when a hook exists.
    """
    plugin = strategy.precision_plugin
    original = plugin._after_closure
    warned: set = set()

    def after_closure(model: LightningModule, optimizer: Any) -> None:
        recorder = LogRecorder(model, strategy.split.path)
        with recorder.recording():
            recorder.start_microbatch()
            original(model, optimizer)
            recorder.mark_loss(None)
        per_stage: List[Any] = [None] * strategy.pp_size
        dist.all_gather_object(per_stage, recorder.calls[0], group=strategy.pp_group)
        calls, disagree = combine_stages(per_stage, strategy.split.aliases, strategy.split.parameter_order)
        new = sorted(set(disagree) - warned)
        if new:
            warned.update(new)
            rank_zero_warn(
                f"on_before_optimizer_step logged {new} with different values on different pipeline stages; the last "
                "stage's value is logged. Each stage sees only its own layers' gradients: log a whole-model value "
                "with lightning.pytorch.utilities.grad_norm, or log from one stage (trainer.strategy.is_last_stage)"
            )
        previous = model._current_fx_name
        model._current_fx_name = "on_before_optimizer_step"
        try:
            replay(model, calls, strategy.root_device)
        finally:
            model._current_fx_name = previous

    plugin._after_closure = after_closure
