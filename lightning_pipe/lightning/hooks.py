"""What Lightning's hooks see under PipeStrategy: the whole model, the step's state, combined logs.

- :class:`BodySwap`: ``on_fit_start`` callbacks (the model summary) see the unsplit body.
- :class:`StepState`: before epoch-end hooks, the attributes the last stage's steps built are
  handed to the other stages, so ``on_validation_epoch_end`` computes the same on every rank.
- :func:`combine_stage_logs`: what ``on_before_optimizer_step`` and ``on_after_backward`` hooks
  log on each stage is gathered over the pipeline and combined per name (Lightning's
  ``grad_norm`` made whole-model), then logged on every rank.
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


def combine_stage_logs(strategy: Any, module: LightningModule, callbacks: List[Callback]) -> None:
    """Gather and combine, over the pipeline, what the gradient hooks log on each stage.

    ``on_before_optimizer_step`` (Lightning calls it, then clips gradients, from the precision
    plugin's ``_after_closure``) and ``on_after_backward`` (from its ``post_backward``) see only
    the stage's own gradients. Where the module or a callback defines one of them, that plugin
    method is wrapped: the hooks' ``self.log`` calls are recorded on every stage, gathered over
    the pipeline, combined by :func:`~lightning_pipe.lightning.logs.combine_stages` (Lightning's
    ``grad_norm`` made whole-model) and logged on every rank. One collective per call.
    """
    for hook, method in (("on_before_optimizer_step", "_after_closure"), ("on_after_backward", "post_backward")):
        if any(overrides(obj, hook) for obj in [module, *callbacks]):
            _combine_logs_of(strategy, hook, method)


def _combine_logs_of(strategy: Any, hook: str, method: str) -> None:
    plugin = strategy.precision_plugin
    original = getattr(plugin, method)
    warned: set = set()

    def combined(*args: Any, **kwargs: Any) -> Any:
        model = strategy.lightning_module
        recorder = LogRecorder(model, strategy.split.path)
        with recorder.recording():
            recorder.start_microbatch()
            result = original(*args, **kwargs)
            recorder.mark_loss(None)
        per_stage: List[Any] = [None] * strategy.pp_size
        dist.all_gather_object(per_stage, recorder.calls[0], group=strategy.pp_group)
        calls, disagree = combine_stages(per_stage, strategy.split.aliases, strategy.split.parameter_order)
        new = sorted(set(disagree) - warned)
        if new:
            warned.update(new)
            rank_zero_warn(
                f"{hook} logged {new} with different values on different pipeline stages; the last stage's value "
                "is logged. Each stage sees only its own layers' gradients: log a whole-model value with "
                "lightning.pytorch.utilities.grad_norm, or log from one stage (trainer.strategy.is_last_stage)"
            )
        previous = model._current_fx_name
        model._current_fx_name = hook
        try:
            replay(model, calls, strategy.root_device)
        finally:
            model._current_fx_name = previous
        return result

    setattr(plugin, method, combined)
