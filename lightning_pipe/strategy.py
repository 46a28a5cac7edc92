"""PipeStrategy: pipeline parallelism for an unchanged LightningModule.

Glue only. The body is split by :mod:`lightning_pipe.partition`, run by
:class:`lightning_pipe.pipeline.Pipeline`, logged through :mod:`lightning_pipe.lightning.logs`
and saved through :mod:`lightning_pipe.lightning.state`. Process layout: ``world = pp x dp`` on a
DeviceMesh with dims ``("pp", "dp")``, pp outermost, so stage ``s`` holds global ranks
``s*dp ... s*dp+dp-1``.

Inside one automatic-optimization step Lightning runs ``training_step -> zero_grad -> backward``.
The pipeline computes the gradients inside ``training_step``; they are set aside there (so the
``zero_grad`` that follows cannot wipe them) and put back in :meth:`PipeStrategy.backward`, which
still runs the precision plugin's hooks so ``on_before_backward``/``on_after_backward`` fire.
"""

from __future__ import annotations

from collections import OrderedDict
import signal
import time
from datetime import timedelta
from typing import Any, Dict, List, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_pipe.batchnorm import DeferredBatchNorm, commit_deferred_batch_norm
from lightning_pipe.checkpoint import check_checkpoint
from lightning_pipe.errors import ConfigurationError, PartitionError
from lightning_pipe.faults import report_job_error
from lightning_pipe import gradients as grads
from lightning_pipe.lightning import logs, state
from lightning_pipe.lightning.body import PipelinedBody, find_body, set_submodule
from lightning_pipe.lightning.steps import FirstStage, loss_of, merge_outputs
from lightning_pipe.microbatch import scatter
from lightning_pipe.partition import (
    SequentialModel,
    balance_by_parameters,
    check_balance,
    split_points,
)
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.schedule import SCHEDULES


class _BodySwap(Callback):
    """Puts the unsplit body into the module (``whole``) or the local stage back, at fit start."""

    def __init__(self, strategy: "PipeStrategy", whole: bool) -> None:
        self.strategy = strategy
        self.whole = whole

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = self.strategy
        body = strategy._full_body[0] if self.whole else strategy._body
        if body is not None:
            set_submodule(pl_module, strategy._body_path, body)
        if not self.whole:  # the last callback: both swaps are done for this fit
            trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, _BodySwap)]


_GRACE_SECONDS = 5.0  # how long the launcher lets other ranks fail on their own after an exception


class PipeStrategy(DDPStrategy):
    """Pipeline parallelism (GPipe or 1F1B) composed with data parallelism, for Lightning.

    Args:
        pipe_size: number of pipeline stages; the remaining factor of the world size replicates
            the pipeline (data parallelism). Default: all processes form one pipeline.
        num_microbatches: microbatches per batch. Default: ``2 * pipe_size``.
        schedule: ``"1f1b"`` (less activation memory) or ``"gpipe"``.
        checkpoint: activation checkpointing, ``"always"``, ``"except_last"`` or ``"never"``.
        deferred_batch_norm: turn the module's BatchNorms into :class:`DeferredBatchNorm`, whose
            running statistics are updated once per batch instead of once per microbatch.
        balance: layers per stage; default balanced by parameter count.
        body: attribute path of the ``nn.Sequential`` to pipeline; default: the only one.
        gather_full_model: after ``fit``, put the whole trained model back into the
            LightningModule on every rank (set False to save memory; then the module refuses to run).
        timeout: how long a rank waits for a message or collective before failing.

    Example:
        >>> strategy = PipeStrategy(pipe_size=2, num_microbatches=4, schedule="gpipe")
        >>> strategy.schedule
        'gpipe'
    """

    strategy_name = "pipe"

    def __init__(
        self,
        pipe_size: Optional[int] = None,
        num_microbatches: Optional[int] = None,
        schedule: Literal["1f1b", "gpipe"] = "1f1b",
        checkpoint: Union[Literal["always", "except_last", "never"], bool] = "never",
        deferred_batch_norm: bool = False,
        balance: Optional[List[int]] = None,
        body: Optional[str] = None,
        gather_full_model: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        for name, value in (("pipe_size", pipe_size), ("num_microbatches", num_microbatches)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigurationError(f"PipeStrategy({name}={value!r}): give a positive integer or None")
        if schedule not in SCHEDULES:
            raise ConfigurationError(f"PipeStrategy(schedule={schedule!r}): choose one of {sorted(SCHEDULES)}")
        if start_method != "popen":
            raise ConfigurationError(
                f"PipeStrategy(start_method={start_method!r}): only 'popen' is supported; the spawn and fork "
                "launchers copy rank 0's (partitioned) module back into the main process, which would lose the other stages"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.pipe_size = pipe_size
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.checkpoint = check_checkpoint(checkpoint)
        self.deferred_batch_norm = deferred_batch_norm
        self.balance = list(balance) if balance is not None else None
        self.body = body
        self.gather_full_model = gather_full_model
        self._pipeline: Optional[Pipeline] = None
        self._body: Optional[PipelinedBody] = None
        self._full_body: List[nn.Sequential] = []  # a list, so the module is not registered anywhere
        self._body_path = ""
        self._hook = "training_step"
        self._hook_args: tuple = ()
        self._first_stage_calls = 0
        self._pending_grads: Dict[nn.Parameter, torch.Tensor] = {}
        self._owner: Dict[str, int] = {}
        self._tied: List[str] = []
        self._probed = False
        self._layouts: List[List[List[str]]] = []

    # -- topology ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def pp_size(self) -> int:
        return self.pipe_size if self.pipe_size is not None else self.world_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.pp_size

    @property
    def stage_index(self) -> int:
        return self.global_rank // self.dp_size

    @property
    def dp_rank(self) -> int:
        return self.global_rank % self.dp_size

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def _check_topology(self) -> None:
        if self.world_size % self.pp_size:
            raise ConfigurationError(
                f"PipeStrategy(pipe_size={self.pipe_size}) must divide the number of processes "
                f"(devices x num_nodes = {self.world_size}); use a pipe_size among "
                f"{[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}"
            )

    def setup_environment(self) -> None:
        self._check_topology()
        super().setup_environment()
        self._mesh = init_device_mesh(
            self.root_device.type, (self.pp_size, self.dp_size), mesh_dim_names=("pp", "dp")
        )
        self.pp_group = self._mesh.get_group("pp")
        self.dp_group = self._mesh.get_group("dp")
        self._pp_ranks = dist.get_process_group_ranks(self.pp_group)

    # -- setup ---------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not module.automatic_optimization:
            raise ConfigurationError(
                "PipeStrategy supports automatic optimization only: the pipeline runs forward and backward "
                "inside training_step. Remove `self.automatic_optimization = False`"
            )
        if str(getattr(self.precision_plugin, "precision", "")) in ("16-mixed", "16"):
            raise ConfigurationError(
                "PipeStrategy does not support precision='16-mixed' yet (per-microbatch loss scaling); "
                "use precision='bf16-mixed' or '32-true'"
            )
        if self._body is not None:
            self._body.mode = "local"
        else:
            if self.deferred_batch_norm:
                DeferredBatchNorm.convert_deferred_batch_norm(module)
            self._partition(module)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._pipeline = Pipeline(
            self._body if self.stage_index > 0 else FirstStage(self, module),
            chunks=self.num_microbatches or 2 * self.pp_size,
            process_group=self.pp_group,
            schedule=self.schedule,
            # the first stage checkpoints the body's layers itself (see FirstStage), not the user's step
            checkpoint=self.checkpoint if self.stage_index > 0 else "never",
            timeout=self._timeout or default_pg_timeout,
            device=self.root_device,
        )
        self._pipeline.errors.watch_job = True  # replicas cannot go on once any rank failed
        self._recorder = logs.LogRecorder(module, self._body_path)
        for metric in (m for m in module.modules() if isinstance(m, logs.Metric)):
            if metric.process_group is None:
                metric.process_group = self.dp_group
        if fitting:
            self.setup_optimizers(trainer)
            self._record_layouts()
            self._use_global_clipping()
            self._print_summary()
            self._show_whole_model_at_fit_start(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _partition(self, module: nn.Module) -> None:
        path, body = find_body(module, self.body)
        names = list(body._modules)
        if self.pp_size > len(names):
            raise PartitionError(
                f"PipeStrategy(pipe_size={self.pp_size}) needs at least {self.pp_size} layers, but the body "
                f"`{path}` has {len(names)}; use pipe_size <= {len(names)} or split the body into more layers"
            )
        balance = self.balance
        balance = check_balance(balance, len(names), self.pp_size) if balance is not None else balance_by_parameters(body, self.pp_size)
        self._balance = balance
        grads.broadcast_module(module, self.root_device)  # every stage and replica starts from rank 0's weights
        self._param_order = [n for n, _ in module.named_parameters()]
        self._key_order = list(module.state_dict())
        first_key: Dict[int, str] = {}
        self._aliases = {}  # state_dict keys of a tensor registered twice (tied weights) -> its first key
        for key, tensor in module.state_dict(keep_vars=True).items():
            self._aliases[key] = first_key.setdefault(id(tensor), key)
        self._aliases = {k: v for k, v in self._aliases.items() if k != v}
        start, stop = split_points(balance)[self.stage_index]
        layers = OrderedDict((n, body._modules[n]) for n in names[start:stop])
        self._body = PipelinedBody(layers, isinstance(body, SequentialModel), self.stage_index, self.pp_size)
        self._full_body = [body]
        self._body_path = path
        set_submodule(module, path, self._body)

    def _show_whole_model_at_fit_start(self, trainer: Any) -> None:
        """Let ``on_fit_start`` callbacks (the model summary) see the whole body, as under DDP.

        The unsplit body is put back into the module by a callback that runs first and the local
        stage by one that runs last; nothing trains in between. Its layers of other stages still
        hold the initial weights, which is all a summary reads.
        """
        trainer.callbacks.insert(0, _BodySwap(self, whole=True))
        trainer.callbacks.append(_BodySwap(self, whole=False))

    def _restore_body(self) -> None:
        if self._body is None:
            return
        set_submodule(self.lightning_module, self._body_path, self._full_body[0])
        self._body = None
        self._pipeline = None

    def _print_summary(self) -> None:
        body = self._full_body[0]
        rows = []
        for s, (start, stop) in enumerate(split_points(self._balance)):
            layer_names = list(body._modules)[start:stop]
            params = sum(p.numel() for n in layer_names for p in body._modules[n].parameters())
            ranks = list(range(s * self.dp_size, (s + 1) * self.dp_size))
            rows.append(f"  stage {s}: layers {layer_names[0]}..{layer_names[-1]} ({stop - start}), "
                        f"{params:,} parameters, ranks {ranks}")
        m = self._pipeline.chunks
        p = self.pp_size
        rank_zero_info(
            f"PipeStrategy: {p} stages x {self.dp_size} replicas, schedule {self.schedule}, "
            f"{m} microbatches, checkpoint {self.checkpoint}, body `{self._body_path}`, "
            f"ideal bubble {(p - 1) / (m + p - 1):.1%}\n" + "\n".join(rows)
        )

    # -- training ------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, self._hook_args, self._hook = args[0], args[1:], "training_step"
        self._first_stage_calls = 0
        first, last = self.stage_index == 0, self.stage_index == self.pp_size - 1
        trainer = self.lightning_module.trainer
        with self.precision_plugin.train_step_context():
            earlier = grads.take_grads(self.lightning_module.parameters())
            with self._recorder.recording():
                loss, _ = self._pipeline.forward_backward(
                    *((batch,) if first else ()),
                    # one stage: the step already returned the loss, which the pipeline takes as is
                    criterion=self._last_stage_loss if last and not first else None,
                    labels=(batch,) if last else (),
                    loss_scale=1.0 / trainer.accumulate_grad_batches,
                )
            if self.deferred_batch_norm:
                commit_deferred_batch_norm(self.lightning_module)
            if not self._probed:
                self._probe_usage()
            self._pending_grads = grads.take_grads(self.lightning_module.parameters())
            grads.add_grads(earlier)
        return self._share_results(loss, self._recorder.fold(self._pipeline.last_sizes) if last else None)

    def _last_stage_loss(self, *outputs_and_batch: Any) -> torch.Tensor:
        *outputs, batch = outputs_and_batch
        return loss_of(self._run_replaced(tuple(outputs), batch), "training_step")

    def _run_replaced(self, outputs: tuple, batch: Any) -> Any:
        """Run the user's hook on the last stage with the body's output taken from the pipeline."""
        self._recorder.start_microbatch()
        self._body.mode, self._body.replacement = "replace", outputs
        try:
            return getattr(self.lightning_module, self._hook)(batch, *self._hook_args)
        finally:
            self._body.mode, self._body.replacement = "local", None

    def _share_results(self, loss: Optional[torch.Tensor], calls: Optional[list], outputs: Any = None) -> Any:
        """Send the last stage's loss, logs, metric states and outputs to the whole pipeline; log them."""
        module = self.lightning_module
        last = self.stage_index == self.pp_size - 1
        payload = [(loss, calls, logs.metric_states(module, self._body_path), outputs) if last else None]
        if self.pp_size > 1:
            dist.broadcast_object_list(payload, src=self._pp_ranks[-1], group=self.pp_group, device=self._object_device())
        loss, calls, metric_states, outputs = payload[0]
        if not last:
            logs.load_metric_states(module, metric_states, self.root_device)
        logs.replay(module, calls, self.root_device)
        if loss is not None:
            loss = loss.to(self.root_device)
        return loss if outputs is None else outputs

    def _object_device(self) -> Optional[torch.device]:
        return self.root_device if dist.get_backend(self.pp_group) == "nccl" else None

    def _probe_usage(self) -> None:
        """Learn which stages use each parameter outside the body: its owner, and tied weights."""
        module = self.lightning_module
        prefix = self._body_path + "."
        used = [n for n, p in module.named_parameters() if not n.startswith(prefix) and p.grad is not None]
        per_stage: List[Any] = [None] * self.pp_size
        dist.all_gather_object(per_stage, used, group=self.pp_group)
        stages: Dict[str, List[int]] = {}
        for s, names in enumerate(per_stage):
            for n in names:
                stages.setdefault(n, []).append(s)
        self._owner = {n: min(s) for n, s in stages.items()}
        self._tied = sorted(n for n, s in stages.items() if len(s) > 1)
        if self._tied:
            rank_zero_info(f"PipeStrategy: parameters used on several stages, kept in sync: {self._tied}")
        self._probed = True

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        grads.add_grads(self._pending_grads)
        self._pending_grads = {}
        if self._tied:
            params = dict(module.named_parameters())
            grads.sum_tied([params[n] for n in self._tied], self.pp_group)
        if self.dp_size > 1 and not module.trainer.fit_loop.epoch_loop._should_accumulate():
            grads.average(module.parameters(), self.dp_group, self.dp_size)
        return self.precision_plugin.post_backward(closure_loss, module)

    def _owned(self) -> set:
        """State-dict keys whose authoritative value lives on this rank."""
        module = self.lightning_module
        prefix = self._body_path + "."
        return {
            k for k in module.state_dict()
            if k.startswith(prefix) or state.owner_of_key(k, self._owner) == self.stage_index
        }

    def _use_global_clipping(self) -> None:
        """Clip by the norm over all stages: the precision plugin's own clipping is local."""

        def clip_grad_by_norm(optimizer: Any, clip_val: Union[int, float]) -> None:
            grads.clip_by_global_norm(optimizer, clip_val, self._owned_parameters(), self.pp_group, self.root_device)

        self.precision_plugin.clip_grad_by_norm = clip_grad_by_norm

    def _owned_parameters(self) -> set:
        """Ids of the parameters whose gradient this rank counts in the global norm."""
        prefix = self._body_path + "."
        return {
            id(p) for n, p in self.lightning_module.named_parameters()
            if n.startswith(prefix) or self._owner.get(n, 0) == self.stage_index
        }

    # -- evaluation ----------------------------------------------------------------------------
    def _eval_step(self, hook: str, context: Any, args: tuple) -> Any:
        if self.pp_size == 1:
            with context:
                return getattr(self.lightning_module, hook)(*args)
        batch, self._hook_args, self._hook = args[0], args[1:], hook
        self._first_stage_calls = 0
        first, last = self.stage_index == 0, self.stage_index == self.pp_size - 1
        with context, self._recorder.recording():
            per_microbatch = self._pipeline.forward_microbatches(*((batch,) if first else ()))
            outputs = None
            if last:
                parts = scatter((batch,), len(per_microbatch), self._pipeline.batch_dim)
                results = [self._run_replaced(out, part[0]) for out, part in zip(per_microbatch, parts)]
                outputs = merge_outputs(results)
        calls = self._recorder.fold(self._pipeline.last_sizes) if last else None
        if hook == "predict_step":  # every rank returns the predictions, so rank 0 can hand them back
            return self._share_results(None, calls, outputs)
        self._share_results(None, calls)
        return outputs  # the step's merged output on the last stage (for on_*_batch_end), else None

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context(), args)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context(), args)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", self.precision_plugin.predict_step_context(), args)

    # -- checkpoints ---------------------------------------------------------------------------
    def _record_layouts(self) -> None:
        names = state.parameter_names(self.lightning_module)
        self._layouts = []
        for optimizer in self.optimizers:
            per_stage: List[Any] = [None] * self.pp_size
            dist.all_gather_object(per_stage, state.group_names(optimizer, names), group=self.pp_group)
            self._layouts.append(state.full_layout(per_stage, self._param_order))

    def _gather_to_zero(self, contribution: Any) -> Optional[list]:
        gathered = [None] * dist.get_world_size() if self.is_global_zero else None
        dist.gather_object(contribution if self.dp_rank == 0 else None, gathered, dst=0)
        return [c for c in gathered if c is not None] if gathered is not None else None

    def _full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        parts = self._gather_to_zero(state.module_contribution(self.lightning_module, self._owned()))
        if parts is None:
            return None
        merged = {}
        for part in parts:
            merged.update(part)
        for alias, key in self._aliases.items():  # one tensor under both names: saved once, as a plain run would
            if key in merged:
                merged[alias] = merged[key]
        return OrderedDict((k, merged[k]) for k in self._key_order if k in merged)

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        if self._body is None:
            return super().lightning_module_state_dict()
        full = self._full_state_dict()
        return full if full is not None else {}

    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        if self._body is None:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        index = [getattr(o, "_optimizer", o) for o in self.optimizers].index(optimizer)
        names = state.parameter_names(self.lightning_module)
        owned = self._owned()
        parts = self._gather_to_zero(state.optimizer_contribution(optimizer, names, owned))
        return state.assemble_optimizer(parts, self._layouts[index]) if parts is not None else {}

    def load_model_state_dict(self, checkpoint: Dict[str, Any], strict: bool = True) -> None:
        if self._body is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        module = self.lightning_module
        local = set(module.state_dict())
        module.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if k in local}, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Dict[str, Any]) -> None:
        if self._body is None:
            return super().load_optimizer_state_dict(checkpoint)
        names = state.parameter_names(self.lightning_module)
        for optimizer, layout, saved in zip(self.optimizers, self._layouts, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            optimizer.load_state_dict(state.localize_optimizer(saved, layout, optimizer, names))

    # -- the end -------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """Make the whole job stop: tell every pipeline, and on the launcher end stuck ranks.

        Lightning kills the other ranks only on KeyboardInterrupt. A rank of another replica can
        be blocked in a collective that this failure left unmatched, so the launching process
        gives the other ranks a few seconds to fail on their own, then kills what is left.
        """
        super().on_exception(exception)
        report_job_error(f"global rank {self.global_rank} (stage {self.stage_index}, replica {self.dp_rank}) "
                         f"failed: {type(exception).__name__}: {exception}")
        launcher = self.launcher
        procs = getattr(launcher, "procs", None)
        if procs:
            deadline = time.monotonic() + _GRACE_SECONDS
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.1)
            if any(p.poll() is None for p in procs):
                launcher.kill(signal.SIGKILL)

    def on_train_end(self) -> None:
        """Put the whole trained model back into the LightningModule (a collective, on every rank)."""
        if self._body is None:
            return
        if not self.gather_full_model:
            self._body.mode = "released"  # fail loudly rather than run stage s alone
            return
        full = self._full_state_dict()
        box = [full]
        dist.broadcast_object_list(box, src=0, device=self._object_device())
        module = self.lightning_module
        self._restore_body()
        module.load_state_dict(box[0])

    def teardown(self) -> None:
        if self._body is not None and self.gather_full_model:
            # evaluation left the weights as they were: the full body still holds them
            fitting = self.lightning_module is not None and self.lightning_module._trainer is not None and \
                self.lightning_module.trainer.state.fn == TrainerFn.FITTING
            if not fitting:
                self._restore_body()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, schedule in (("pipe", "1f1b"), ("pipe_1f1b", "1f1b"), ("pipe_gpipe", "gpipe")):
            strategy_registry.register(
                name, cls, description=f"Pipeline parallelism with the {schedule} schedule", schedule=schedule
            )


PipeStrategy.register_strategies(StrategyRegistry)
