"""The user's step, cut where the body is called: the first stage's part and the last stage's rerun.

The first stage runs the user's step on each microbatch until the body is called, then runs its
own layers and stops (:class:`FirstStage`). The last stage runs the whole step again with the body
call answered by the pipeline's output, and its result becomes the microbatch's loss. Both runs of
microbatch ``i`` start from the same random state (``rng.derive(step seed, i, rng.USER_STEP)``),
so whatever the step draws before the body (noise, masks, mixing weights) is drawn alike.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from contextlib import nullcontext
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_pipe import rng
from lightning_pipe.checkpoint import autocast_state, is_recomputing, saved_tensors_pack, should_checkpoint
from lightning_pipe.errors import BodyCallError, ConfigurationError, SideEffectError
from lightning_pipe.lightning import loggers, release
from lightning_pipe.lightning.body import BodyReached, StandIn
from lightning_pipe.lightning.effects import StepEffects, refuse_changed_settings
from lightning_pipe.lightning.logs import LogRecorder, metric_paths
from lightning_pipe.lightning.losses import LossAccount, MeanTargets, Shapes, loss_of, merge
from lightning_pipe.lightning.stale import StaleCopies, unmark
from lightning_pipe.microbatch import copy_tensors, scatter, tensor_versions, written_since


def _moves_only(pack: Callable) -> bool:
    """Whether a saved-tensors pack function is torch's own that keeps the values: ``save_on_cpu``'s, or one of
    activation checkpointing's (a step checkpointing its whole loop)."""
    module, name = getattr(pack, "__module__", ""), getattr(pack, "__qualname__", "")
    return module == "torch.autograd.graph" and name.startswith("save_on_cpu.") or module == "torch.utils.checkpoint"


def _described(autocast: tuple) -> str:
    """An autocast state (:func:`~lightning_pipe.checkpoint.autocast_state`) for a message: ``cpu bfloat16`` or ``off``."""
    return ", ".join(f"{device} {str(dtype).replace('torch.', '')}" for device, dtype in autocast) or "off"


class StepRunner:
    """Runs the user's step for one microbatch, wherever the step runs.

    Args:
        module: the LightningModule.
        stand_in: the body's stand-in in ``module``.
        body_path: the body's attribute path (for messages).
        recorder: catches the step's ``self.log`` calls.
        effects: watches what the step changes.
        checkpoint: the activation checkpoint mode (the first stage applies it to its layers).
        loss_reduction: ``"mean"`` or ``"sum"`` (see :class:`LossAccount`).
    """

    def __init__(self, module: nn.Module, stand_in: StandIn, body_path: str, recorder: LogRecorder,
                 effects: StepEffects, checkpoint: str, loss_reduction: str) -> None:
        self.module = module
        self.stand_in = stand_in
        self.body_path = body_path
        self.recorder = recorder
        self.effects = effects
        self.checkpoint = checkpoint
        self.loss_reduction = loss_reduction
        self.hook = "training_step"
        self.hook_args: tuple = ()
        self.pipeline: Any = None
        self.account: Optional[LossAccount] = None
        self.runs_whole_too = False  # this process holds the first and the last stage of a pipeline (ZB-V)
        self.stale: Optional[StaleCopies] = None  # the last stage's copies of what the first stage trains
        self.watch_loggers_on: Optional[int] = None  # global rank of the last stage of replica 0, where not 0
        self.in_step = False  # the user's step is running (on a stage: the world's collectives are refused)
        self.targets = MeanTargets()  # what a cross_entropy loss averaged over, in the run that returns the loss
        self.shapes: Dict[str, Shapes] = defaultdict(Shapes)  # per hook: what its results showed (see merge)
        self.copies_batch = False  # the training step writes into its batch: each run gets a copy (see run)
        self.settings: Optional[list] = None  # the optimizers' settings before this training step (see begin)
        self._training_steps = 0
        recorder.count_of = self.targets.count_of  # a logged one folds by it too
        self._warned_targets = False

    def begin(self, hook: str, hook_args: tuple, pipeline: Any, settings: Optional[list] = None) -> None:
        """Prepare for one step of ``hook`` (the account opens once the microbatch sizes are known); ``settings``:
        the optimizers' settings before a training step, which no run of it may change."""
        self.hook, self.hook_args, self.pipeline, self.account, self.settings = hook, hook_args, pipeline, None, settings
        self._training_steps += hook == "training_step"
        # integers a result may return as they are (not the epoch: small, it would often equal a count)
        indices = {a for a in hook_args if type(a) is int}
        trainer = getattr(self.module, "_trainer", None)  # `.trainer` raises where none is attached (unit tests)
        if trainer is not None:
            indices.add(trainer.global_step)
        self.shapes[hook].indices = indices

    @property
    def first_training_step(self) -> bool:
        """Whether the step begun is this process's first training step (whose runs are watched for writes into
        their batch, see :meth:`run`)."""
        return self._training_steps == 1 and self.hook == "training_step"

    def _account(self, reduction: Optional[str] = None) -> LossAccount:
        if self.account is None:
            self.account = LossAccount(self.pipeline.last_sizes, reduction or self.loss_reduction)
        return self.account

    def run(self, i: int, batch: Any, mode: str, replacement: Optional[tuple] = None,
            checkpoint_layers: bool = False) -> Any:
        """Run the user's step on microbatch ``i`` with the body in ``mode``; BodyReached passes through.

        A step may write into its batch (``x.mul_(0.5)``). Each microbatch's slice of a tensor is mostly
        its own (with its own version counter, see :func:`~lightning_pipe.microbatch.scatter`), but a
        ``NoChunk`` tensor is the same object in every microbatch, so each run would write into it
        again; slices of tensors that share memory share a counter; and where one process runs a
        microbatch twice (under ZB-V) the whole run would read what the run up to the body wrote. So
        the first training step's runs each get a copy of their microbatch, watched for writes; after
        one, every later run gets a copy too. The run up to the body under ZB-V always gets one.
        """
        watch_writes = self.first_training_step and not self.copies_batch
        # the run up to the body on the process that then runs the step whole (ZB-V) gets a copy: its writes into
        # the batch would reach the whole run, which reads the same memory
        if watch_writes or self.copies_batch and self.hook == "training_step" or self.runs_whole_too and mode == "stop":
            batch = copy_tensors(batch)
        versions = tensor_versions(batch) if watch_writes else None
        self.pipeline.reseed(i, rng.USER_STEP)
        self.recorder.start_microbatch()
        snapshot = self.effects.before(self.hook, whole=mode != "stop" or self.runs_whole_too)
        counts = metric_counts(self.module, self.body_path) if self.runs_whole_too and mode == "stop" else None
        self.stand_in.begin_step(mode, replacement, checkpoint_layers)
        if mode == "replace" and i == 0:  # this process's layers ran before the step: see refuse_reverted_attributes
            self.stand_in.watch_attributes()
        watch = self.stale.watching() if self.stale is not None and mode == "replace" and self.hook == "training_step" \
            else nullcontext()  # evaluation steps get every copy refreshed instead (see .stale)
        logging = loggers.watched(self.module.trainer, self.hook, self.watch_loggers_on, self.stand_in.reached) \
            if self.watch_loggers_on is not None and mode == "replace" else nullcontext()
        targets = self.targets.watching() if mode != "stop" and self.hook != "predict_step" else nullcontext()
        grad_on = torch.is_grad_enabled() and self.hook == "training_step"
        # the strategy's autocast (Lightning's precision plugin's) and saved-tensors hooks, under which every stage runs
        outside = (autocast_state(), saved_tensors_pack() if grad_on else None)
        try:
            with watch, logging, targets:
                with release.reads_recorded():
                    self.in_step = True
                    try:
                        output = getattr(self.module, self.hook)(batch, *self.hook_args)
                    except (RuntimeError, NotImplementedError) as error:  # torch raises the second copying meta data
                        release.explain_meta_error(error, self.module, self.body_path, self.hook)
                        if mode == "replace" and (self.stand_in.input_asks_grad or self.hook != "training_step"
                                                  and self.stand_in.grad_at_call and self.stand_in.num_stages > 1):
                            _explain_unused_input(error, self.hook)
                        raise
                    finally:
                        self.in_step = False
                        if versions is not None and written_since(versions):
                            self.copies_batch = True  # from this step's next run on
                if grad_on:
                    self._refuse_body_without_grad()
                self._refuse_call_context(*outside)
                self.stand_in.refuse_reverted_attributes(self.hook)
                output = unmark(output, f"returned by {self.hook}")
                if self.stale is not None and self.stale.active():  # kept for later (shared at the epoch's end)
                    for name, value in self.effects.new_values(snapshot):
                        unmark(value, f"kept in `self.{name}`")
        except BodyReached:
            if grad_on:
                self._refuse_body_without_grad()
            self._refuse_call_context(*outside)
            self.stand_in.begin_step("local")
            self.recorder.discard_microbatch()  # the last stage logs; under ZB-V it is on this process too
            self.effects.after(self.hook, snapshot, last_stage=False)
            if counts is not None:
                self._refuse_updates_before_body(snapshot, counts)
            self._refuse_changed_settings(i)
            raise
        except BaseException:
            self.stand_in.begin_step("local")
            raise
        self.stand_in.end_step(self.hook, self.body_path)
        self.effects.after(self.hook, snapshot, last_stage=True)
        self._refuse_changed_settings(i)
        return output

    def _refuse_changed_settings(self, i: int) -> None:
        """After the step's run on the last microbatch ``i``, inside the pipeline's action, so that the error reaches
        every stage (see :func:`.effects.refuse_changed_settings`); a change in any run is still there."""
        if self.settings is not None and i == len(self.pipeline.last_sizes) - 1 and not is_recomputing():
            refuse_changed_settings(self.hook, self.settings, self.module.trainer)

    def _refuse_body_without_grad(self) -> None:
        """A training step that calls the body under ``torch.no_grad()`` (a frozen feature extractor): the pipeline
        runs the body's stages with gradients all the same, so their layers would train; refuse it."""
        if self.stand_in.grad_at_call is False:
            self.stand_in.begin_step("local")
            raise ConfigurationError(
                f"{self.hook} called the body `self.{self.body_path}` with gradients disabled (torch.no_grad() or "
                "set_grad_enabled(False)). Under PipeStrategy the body's stages run in the pipeline, which computes "
                "their gradients whatever the step's grad mode, so its layers would be trained where one process "
                "leaves them alone. To keep them fixed, freeze them instead (`self.body.requires_grad_(False)`) and "
                "`.detach()` the body's input if nothing before it should train through it"
            )

    def _refuse_call_context(self, outside: tuple, pack: Optional[Callable]) -> None:
        """A step that calls the body with parameters of its own (``functional_call``), or under an autocast of its
        own (``with torch.autocast(...)`` around the body call, in the step or in ``forward``) or with Lightning's
        switched off, or, in training, under saved-tensors hooks of its own: only this process's stage would follow
        it; the others run in the pipeline, outside the step, with their parameters, under the strategy's autocast
        ``outside`` and its hooks (``pack``), computing something else than one process (or failing on a dtype
        mismatch). Refuse it."""
        inside = self.stand_in.autocast_at_call
        hooks = self.stand_in.pack_at_call
        if self.stand_in.swapped_at_call:
            message = (
                f"{self.hook} called the body `self.{self.body_path}` with parameters of its own in place of the "
                "layers' (torch.func.functional_call, torch.nn.utils.stateless: perturbed weights as in SAM, "
                "averaged weights evaluated). Under PipeStrategy the body's other stages run in the pipeline, outside "
                "your step, with their own parameters, so only one stage would use the ones given. Not supported: "
                "change the parameters themselves (and put them back) in a hook every process runs, such as "
                "on_validation_start, not in the step"
            )
        elif inside is not None and inside != outside:
            message = (
                f"{self.hook} called the body `self.{self.body_path}` under autocast {_described(inside)}, where the "
                f"step itself runs under autocast {_described(outside)}. Under PipeStrategy the body's stages run in "
                "the pipeline, outside your step, under the step's own state, so only one stage would follow your "
                "autocast and the others would compute in another precision than one process does. Set the precision "
                "on the Trainer (precision='bf16-mixed' or '16-mixed': Lightning's autocast, which every stage runs "
                "under), or enter torch.autocast inside the body's layers (in a block's forward)"
            )
        elif self.hook == "training_step" and hooks is not pack and hooks is not None and not _moves_only(hooks):
            message = (
                f"{self.hook} called the body `self.{self.body_path}` under torch.autograd.graph.saved_tensors_hooks of "
                f"its own (packing with `{getattr(hooks, '__qualname__', hooks)}`). Under PipeStrategy the body's "
                "other stages run in the pipeline, outside your step, so only one stage would save its activations "
                "your way, and hooks that change what is saved (quantized activations) would give the stages "
                "different gradients than one process computes. Not supported: use torch.autograd.graph.save_on_cpu "
                "(which only moves them and is allowed) or PipeStrategy(checkpoint=...) to save memory, or enter the "
                "hooks inside the body's layers (in a block's forward)"
            )
        else:
            return
        self.stand_in.begin_step("local")
        raise ConfigurationError(message)

    def _refuse_updates_before_body(self, snapshot: Any, counts: Dict[str, int]) -> None:
        """On a process that runs the step up to the body and again whole, state grown before the body would
        grow twice per microbatch: refuse it (assigning a new value is harmless, the whole run assigns again)."""
        grown = self.effects.grown(snapshot)
        grown += [path for path, count in metric_counts(self.module, self.body_path).items() if counts.get(path) != count]
        if grown:
            raise SideEffectError(
                f"{self.hook} changed {grown} before calling the body `self.{self.body_path}`. This process holds the "
                "first and the last stage of the pipeline (schedule='zbv'), so the code before the body call runs twice "
                "per microbatch here (once to feed the body, once whole for the loss) and the update would happen twice; "
                "move it after the body call, or use another schedule (e.g. schedule='interleaved_1f1b', virtual_stages=2)"
            )

    def loss(self, i: int, output: Any) -> torch.Tensor:
        """What to backpropagate for microbatch ``i``'s training-step result, and note it."""
        loss = loss_of(output, self.hook)
        if loss.is_meta:  # a term from another stage's layer (`self.body[0].weight`): meta plus a number is meta
            release.refuse_other_stages_values(self.module, self.body_path, f"{self.hook}'s loss is on the meta device")
        self._refuse_other_reduction(loss)
        self.recorder.mark_loss(loss)
        return self._account().add(i, loss, output, self._counted(loss, output))

    def _refuse_other_reduction(self, loss: torch.Tensor) -> None:
        """A cross_entropy/nll_loss output returned as it is, reduced otherwise than ``loss_reduction`` says,
        would be scaled by about the number of microbatches: refuse it (see :meth:`MeanTargets.reduction_of`)."""
        reduction = self.targets.reduction_of(loss)
        if reduction is None or reduction == self.loss_reduction:
            return
        effect = ("weighs each microbatch's loss by its share of the batch, which would divide your summed loss by "
                  "about the number of microbatches" if self.loss_reduction == "mean" else
                  "adds the microbatches' losses, which would multiply your mean loss by about the number of "
                  "microbatches")
        raise ConfigurationError(
            f"{self.hook} returned the output of a cross_entropy/nll_loss call with reduction='{reduction}' as its "
            f"loss, but PipeStrategy(loss_reduction='{self.loss_reduction}') {effect}. Pass "
            f"PipeStrategy(loss_reduction='{reduction}'), which gives what one step over the whole batch gives"
        )

    def _counted(self, loss: torch.Tensor, output: Any) -> Optional[torch.Tensor]:
        """The targets ``loss`` averaged over, if it is a cross_entropy/nll_loss output itself (see .losses)."""
        counted = self.targets.count_of(loss)
        given = isinstance(output, dict) and "num_items" in output
        if counted is None and not given and self.loss_reduction == "mean" and not self._warned_targets \
                and self.targets.ignored_some():
            self._warned_targets = True
            warnings.warn(
                f"{self.hook}'s loss is computed from a cross_entropy/nll_loss whose targets include ignored ones "
                "(ignore_index), but is not that call's output itself, so PipeStrategy weights each microbatch's "
                "loss by its number of samples, while one step over the whole batch (DDP) averages over its "
                "targets: the microbatches' counts differ. Return {'loss': loss, 'num_items': count} with the count "
                "of targets the loss averages over", stacklevel=2)
        return counted

    def note(self, i: int, output: Any) -> Any:
        """Note an evaluation step's result (its loss, if any, tells how its logged loss folds)."""
        loss = loss_of(output, self.hook, required=False) if self.hook != "predict_step" else None
        loss = loss if loss is not None and loss.numel() == 1 else None
        self.recorder.mark_loss(loss)
        if loss is not None:
            # no backward here: a cross_entropy/nll_loss output folds as it was reduced, whatever loss_reduction says
            self._account(self.targets.reduction_of(loss)).add(i, loss, output, self.targets.count_of(loss))
        return output

    def criterion(self, *outputs_and_batch: Any) -> torch.Tensor:
        """The last stage's criterion: the user's step with the body's output put in."""
        *outputs, batch = outputs_and_batch
        i = self.pipeline.stage.microbatch_index
        return self.loss(i, self.run(i, batch, "replace", tuple(outputs)))

    def folded_logs(self, sizes: Sequence[int]) -> list:
        account = self.account
        return self.recorder.fold(sizes, account.log_weights() if account is not None else list(sizes),
                                  on_step_by_default=self.hook == "training_step")  # Lightning's defaults

    def evaluate(self, hook: str, batch: Any, hook_args: tuple, pipeline: Any, first: bool,
                 last: bool) -> Tuple[Any, Optional[tuple]]:
        """One pipelined evaluation step: forward only, then the user's step on each output (last stage).

        Returns the step's result merged over microbatches and what the last stage shares with
        the pipeline (its folded logs and the merged result, which ``on_*_batch_end`` hooks receive
        on every rank as under DDP); None elsewhere.
        """
        self.begin(hook, hook_args, pipeline)
        outputs = summary = None
        with self.recorder.recording(microbatched=True):
            per_microbatch = pipeline.forward_microbatches(*((batch,) if first else ()))
            if last:
                parts = scatter((batch,), len(per_microbatch), pipeline.batch_dim)
                results = [self.note(i, self.run(i, part[0], "replace", out))
                           for i, (out, part) in enumerate(zip(per_microbatch, parts))]
                outputs = outputs_of(results, self.account, pipeline.last_sizes, hook, self.shapes[hook])
                shared = {"outputs": outputs}  # what on_*_batch_end gets on every rank, as under DDP
                summary = (None, self.folded_logs(pipeline.last_sizes), shared, None)
            pipeline.reseed(rng.END)
        return outputs, summary

    def first_stage(self) -> "FirstStage":
        return FirstStage(self)


def _explain_unused_input(error: RuntimeError, hook: str) -> None:
    """Raise a named error for autograd's about a differentiated tensor not used in the graph, in a step whose body
    input asked for a gradient (:func:`.body.asks_for_gradient`), or an evaluation step that called the body with
    gradients enabled on a process holding part of it: on the last stage the body's output is the pipeline's,
    computed on other processes (without a graph in evaluation), so a gradient with respect to the body's input (a
    gradient penalty, a saliency map) or to other stages' weights is not in its graph. The input asking is not
    refused as such: Hugging Face's ``enable_input_require_grads`` (LoRA, gradient checkpointing) makes the
    embeddings' output ask for a gradient that nothing reads; nor is ``torch.enable_grad()`` in an evaluation step,
    where a gradient with respect to the head's weights is computed as under DDP. Returns for any other error."""
    if "not have been used in the graph" not in str(error) and "does not require grad" not in str(error):
        return  # the second: a loss computed from the body's output alone, which has no graph in evaluation
    raise BodyCallError(
        f"{hook} asked autograd for a gradient through the body ({error}). Under PipeStrategy the body's input and "
        "its first layers are on the first stage and the step after the body runs on the last, whose body output "
        "is computed on other processes (without a graph in evaluation steps), so a gradient of the body's output "
        "with respect to its input (`torch.autograd.grad(out, x)` for a gradient penalty or a saliency map) or to "
        "its layers' weights cannot be computed in the step. Compute it outside the pipelined step (e.g. on an "
        "unpipelined copy of the model in a callback)"
    ) from error


class FirstStage(nn.Module):
    """The first stage's module: the user's step up to (and through) the local part of the body."""

    def __init__(self, runner: StepRunner) -> None:
        super().__init__()
        self.module = runner.module  # registered so its parameters are not counted as activations
        self.__dict__["runner"] = runner  # not a submodule

    def forward(self, batch: Any):
        runner = self.runner
        pipeline = runner.pipeline
        i = pipeline.stage.microbatch_index
        alone = runner.stand_in.num_stages == 1
        checkpoint_layers = torch.is_grad_enabled() and should_checkpoint(runner.checkpoint, i, len(pipeline.last_sizes))
        try:
            output = runner.run(i, batch, "local" if alone else "stop", checkpoint_layers=checkpoint_layers)
        except BodyReached as reached:
            return reached.outputs
        if not alone:
            raise ConfigurationError(
                f"{runner.hook} returned without calling the body `self.{runner.body_path}`; "
                "under PipeStrategy every step must call it once"
            )
        return runner.loss(i, output) if runner.hook == "training_step" else (runner.note(i, output),)


def outputs_of(results: Sequence[Any], account: Optional[LossAccount], sizes: Sequence[int], hook: str,
               shapes: Shapes) -> Any:
    """An evaluation step's merged result over the microbatches (what ``on_*_batch_end`` receives)."""
    return merge(list(results), account.log_weights() if account is not None else list(sizes), sizes,
                 predictions=hook == "predict_step", shapes=shapes)


def metric_counts(module: nn.Module, body_path: str) -> Dict[str, int]:
    """How many times each torchmetrics Metric outside the body was updated."""
    return {path: module.get_submodule(path)._update_count for path in metric_paths(module, body_path).values()}
