"""PipeStrategy: pipeline parallelism for an unchanged LightningModule.

Glue only: the body is split by :mod:`.split`, the user's step is cut by :mod:`.steps`, the
pipeline is :class:`lightning_pipe.pipeline.Pipeline`, logs go through :mod:`.logs`, hooks see what
:mod:`.hooks` shows them, and checkpoints are :class:`.state.Checkpoints`. Process layout: ``world =
pp x dp`` on a DeviceMesh with dims ``("pp", "dp")``, pp outermost, so stage ``s`` holds global
ranks ``s*dp ... s*dp+dp-1``.

Inside one automatic-optimization step Lightning runs ``training_step -> zero_grad -> backward``.
The pipeline computes the gradients inside ``training_step``; they are set aside there (so the
``zero_grad`` that follows cannot wipe them) and put back in :meth:`PipeStrategy.backward`, which
still runs the precision plugin's hooks so ``on_before_backward``/``on_after_backward`` fire.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import shutil
import warnings
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.autograd import _profiler_enabled  # the C++ profiler's state: ~0.2 µs to ask
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import init_device_mesh

from lightning_pipe import gradients, replicas
from lightning_pipe.batchnorm import commit_deferred_batch_norm
from lightning_pipe.checkpoint import check_checkpoint
from lightning_pipe.errors import BatchMismatchError, ConfigurationError
from lightning_pipe.faults import (
    all_ranks_failed, end_launched_ranks, end_process_groups_at_exit, note_failure, report_job_error,
)
from lightning_pipe.init import building_on_meta
from lightning_pipe.lightning import averaging, batches, hooks, loggers, logs, profile, release, scaling, tracing
from lightning_pipe.lightning.body import present_whole_body
from lightning_pipe.lightning.effects import BufferWatch, StepEffects, optimizer_settings
from lightning_pipe.lightning.layer_list import PipelinedLayerList
from lightning_pipe.lightning.layout import gather_whole_model, plan
from lightning_pipe.lightning.losses import LOSS_REDUCTIONS
from lightning_pipe.lightning.objects import post_share, share_object
from lightning_pipe.lightning.schedules import check_schedule, ideal
from lightning_pipe.lightning.split import SplitModel, trainable_placeholder
from lightning_pipe.lightning.stale import StaleCopies
from lightning_pipe.lightning.state import Checkpoints, HookState
from lightning_pipe.lightning.steps import StepRunner
from lightning_pipe.microbatch import written_since
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.schedule import ALL_SCHEDULES
from lightning_pipe.ties import TiedGradients
from lightning_pipe.trace import Recorder

_log = logging.getLogger(__name__)


class _OneStep(Recorder):
    """The recorder of a step measured for the logger."""

    def __init__(self) -> None:
        super().__init__(keep=1)


def _refuse_meta_tensors(state: Dict[str, Any]) -> None:
    """A checkpoint hook that put other stages' parameters (meta tensors here) into the file would write no values."""
    meta = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_meta]
    if meta:
        raise ConfigurationError(
            f"the checkpoint's state_dict holds tensors without values (on the meta device): {meta[:5]}"
            f"{' ...' if len(meta) > 5 else ''}. An on_save_checkpoint hook put them there from the module (e.g. "
            "{n: p for n, p in self.named_parameters()}): under PipeStrategy each process holds only its stage's "
            "values, and checkpoint['state_dict'] already holds the whole model's (or, sharded, this process's part). "
            "Filter checkpoint['state_dict'] instead: {k: v for k, v in checkpoint['state_dict'].items() if k in keep}"
        )


def _layer_counts(balance: Any) -> List[int]:
    """``balance`` as a list of layer counts: any sequence of integers (a tuple, numpy's, OmegaConf's ListConfig as
    Hydra passes it), refused with a ConfigurationError otherwise."""
    try:
        if isinstance(balance, (str, bytes, dict)) or any(isinstance(n, bool) for n in balance):
            raise TypeError
        return [operator.index(n) for n in balance]
    except TypeError:
        raise ConfigurationError(f"PipeStrategy(balance={balance!r}): give layer counts or one of "
                                 f"{list(profile.BALANCES)}") from None


@contextmanager
def _released_states_set_aside(optimizers: Sequence[Any]) -> Iterator[None]:
    """Lightning moves every optimizer state to a device (at setup, at teardown). An optimizer that builds its
    state when it is constructed (Adagrad's sums) holds some for other stages' parameters too, on the meta device,
    which cannot be copied (nor is it used here, or saved): it is set aside meanwhile."""
    aside = [(o, {p: o.state.pop(p) for p in list(o.state) if getattr(p, "is_meta", False)}) for o in optimizers]
    try:
        yield
    finally:
        for optimizer, states in aside:
            optimizer.state.update(states)


class PipeStrategy(DDPStrategy):
    """Pipeline parallelism (GPipe, 1F1B, ZB-H1, interleaved 1F1B, ZB-V) with data parallelism, for Lightning.

    The LightningModule's body (its ``nn.Sequential``, or its ``nn.ModuleList`` of blocks called
    in a loop) is split into ``pipe_size`` stages, one per process (``virtual_stages`` per process
    under interleaved 1F1B, two under ZB-V); the user's steps stay as they are.
    The step runs once per microbatch: up to the body call on the first stage, whole (with the
    body's output put in) on the last. Both runs of a microbatch draw the same random numbers.
    The batch's loss is the microbatch losses' mean weighted by microbatch size, as for a loss that
    averages over samples; a step whose loss averages over other items (tokens under a mask)
    returns ``{"loss": loss, "num_items": count}``, and one whose loss is a sum sets
    ``loss_reduction="sum"``.

    Args:
        pipe_size: number of pipeline stages; the remaining factor of the world size replicates
            the pipeline (data parallelism). Default: all processes form one pipeline.
        num_microbatches: microbatches per batch. Default: ``2 * pipe_size``.
        schedule: ``"1f1b"`` (less activation memory than ``"gpipe"``), ``"gpipe"``, or ``"zb_h1"``
            (zero bubble H1: backward split into input and weight gradients, the weight gradients
            filling the bubble, at 1F1B's activation memory), or ``"zb_h2"`` (ZB-H1 with ``pipe_size - 1``
            more microbatches in flight per process: the same ideal bubble, far less lost to slow
            messages; gloo only for now), or ``"interleaved_1f1b"`` (Megatron-LM's
            interleaved 1F1B: ``virtual_stages`` stages per process, about ``virtual_stages`` times
            less bubble than 1F1B, more messages), or ``"zbv"`` (ZB-V: two stages per process in a V,
            process ``r`` holding stages ``r`` and ``2 * pipe_size - 1 - r``, backwards split as in
            ``"zb_h1"``; the first and the last stage are both on process 0, which computes the loss).
        virtual_stages: stages per process, for ``schedule="interleaved_1f1b"`` only (at least 2):
            the body is cut into ``pipe_size * virtual_stages`` stages and process ``r`` of a pipeline
            holds stages ``r, r + pipe_size, r + 2 * pipe_size, ...``. With several stages per
            process (this, or ZB-V's two) ``balance`` lists a layer count per stage.
        checkpoint: activation checkpointing, ``"always"``, ``"except_last"`` or ``"never"``.
        deferred_batch_norm: turn the module's BatchNorms into :class:`DeferredBatchNorm`, whose
            running statistics are updated once per batch instead of once per microbatch.
        balance: layers per stage, e.g. ``[3, 5]``; or how to choose them: ``"parameters"`` (the
            default: even parameter counts), ``"time"`` or ``"memory"`` (each layer profiled on one
            training batch at setup, on global rank 0, whose device must hold the whole model),
            ``"flops"`` (counted on the meta device: works for a model no device holds). The
            summary printed at fit start shows each stage's estimate.
        body: attribute path of the body; default: the only ``nn.Sequential``/``nn.ModuleList``
            (or the one holding most of the parameters).
        loss_reduction: ``"mean"`` (the step's loss averages over samples, or over ``num_items``)
            or ``"sum"`` (it sums over samples).
        gather_full_model: after ``fit``, put the whole trained model back into the
            LightningModule on every rank (set False to save memory; then the module refuses to run).
        state_dict_type: ``"full"``: checkpoints are ordinary Lightning files of the whole model,
            gathered on global rank 0. ``"sharded"``: a directory written with
            ``torch.distributed.checkpoint``, each rank writing only its own tensors (convert with
            ``python -m lightning.pytorch.utilities.consolidate_checkpoint``). Default: sharded when
            the module was built on the meta device (``configure_model``, ``init_module(empty_init=True)``:
            the big-model path, where no rank may hold the whole model), full otherwise.
        log_pipeline_metrics: every ``log_every_n_steps`` steps, measure one step and log to the
            trainer's logger (global rank 0) ``pipe/bubble_fraction``, ``pipe/busy_fraction/stage_<s>``,
            ``pipe/wait_seconds/stage_<s>``, ``pipe/step_seconds`` and ``pipe/samples_per_second``.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default: the accelerator's. NCCL runs
            ``"gpipe"``, ``"1f1b"`` and ``"zb_h1"``; the other schedules are refused there.
        timeout: how long a rank waits for a message or collective before failing: a ``timedelta`` or
            seconds.
        start_method: only ``"popen"`` (Lightning's default for DDP): the spawn and fork launchers
            copy rank 0's module back into the main process, which would lose the other stages.

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
        schedule: Literal["1f1b", "gpipe", "zb_h1", "zb_h2", "interleaved_1f1b", "zbv"] = "1f1b",
        virtual_stages: Optional[int] = None,
        checkpoint: Union[Literal["always", "except_last", "never"], bool] = "never",
        deferred_batch_norm: bool = False,
        balance: Optional[Union[List[int], Literal["parameters", "time", "memory", "flops"]]] = None,
        body: Optional[str] = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        gather_full_model: bool = True,
        state_dict_type: Optional[Literal["full", "sharded"]] = None,
        log_pipeline_metrics: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[timedelta, float, None] = default_pg_timeout,
        start_method: Literal["popen"] = "popen",
    ) -> None:
        for name, value in (("pipe_size", pipe_size), ("num_microbatches", num_microbatches)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigurationError(f"PipeStrategy({name}={value!r}): give a positive integer or None")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < float("inf"):
            timeout = timedelta(seconds=timeout)  # a number from a LightningCLI yaml or the command line
        elif timeout is not None and not isinstance(timeout, timedelta):
            raise ConfigurationError(f"PipeStrategy(timeout={timeout!r}): give a datetime.timedelta or a positive number "
                                     "of seconds")
        self.stages_per_rank = check_schedule(schedule, virtual_stages)
        for name, value, allowed in (("loss_reduction", loss_reduction, list(LOSS_REDUCTIONS)),
                                     ("start_method", start_method, ["popen"])):
            if value not in allowed:
                raise ConfigurationError(f"PipeStrategy({name}={value!r}): choose one of {allowed}" + (
                    "; the spawn and fork launchers copy rank 0's (split) module back into the main process, which "
                    "would lose the other stages" if name == "start_method" else ""))
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
        )
        self.pipe_size, self.num_microbatches, self.schedule = pipe_size, num_microbatches, schedule
        self.virtual_stages = virtual_stages
        self.checkpoint = check_checkpoint(checkpoint)
        self.deferred_batch_norm, self.balance, self.body = deferred_batch_norm, balance, body
        self.loss_reduction, self.gather_full_model = loss_reduction, gather_full_model
        self.log_pipeline_metrics, self.state_dict_type = log_pipeline_metrics, state_dict_type
        if state_dict_type not in (None, "full", "sharded"):
            raise ConfigurationError(f"PipeStrategy(state_dict_type={state_dict_type!r}): choose 'full' or 'sharded'")
        if balance is not None and not (isinstance(balance, str) and balance in profile.BALANCES):
            self.balance = _layer_counts(balance)
        for name, flag in (("deferred_batch_norm", deferred_batch_norm), ("gather_full_model", gather_full_model),
                           ("log_pipeline_metrics", log_pipeline_metrics)):
            if flag not in (True, False):  # numpy's bools too
                raise ConfigurationError(f"PipeStrategy({name}={flag!r}) takes True or False")
        self.split: Optional[SplitModel] = None
        self._pipeline: Optional[Pipeline] = None
        self._checkpoints: Optional[Checkpoints] = None
        self._ties: Optional[TiedGradients] = None
        self._stale: Optional[StaleCopies] = None
        self._pending_grads: Dict[torch.nn.Parameter, Optional[torch.Tensor]] = {}
        self._runner: Optional[StepRunner] = None
        self._train_ended = True  # False from the setup of a fit to its on_train_end
        self._showing_whole = False  # the checkpoint hooks are being shown the whole body (lightning_module_state_dict)
        self._routed_writers: List[Any] = []  # the prediction writers routed to the first stage (predict)
        self.hidden_example: Optional[tuple] = None  # example_input_array while the summary sees the whole body
        self._failed_together = False  # every rank reached on_exception (hooks.FailTogether): nobody to end
        self._reported = False  # this rank's failure was told to the job (see _report_failure)
        self._buffers_synced_next = False  # the next step starts from replica 0's buffers (see _sync_buffers)
        self._among_writers = False  # a prediction writer runs: barrier and broadcast over the first stage's replicas
        self.pp_group: Optional[dist.ProcessGroup] = None
        self.dp_group: Optional[dist.ProcessGroup] = None
        self._groups_of: Optional[dist.ProcessGroup] = None  # the default group pp_group and dp_group were made in

    # -- topology ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def is_global_zero(self) -> bool:
        loggers.rank_read()  # code for rank 0 only after the body, on the last stage: a warning (see .loggers)
        return super().is_global_zero

    @property
    def pp_size(self) -> int:
        return self.pipe_size if self.pipe_size is not None else self.world_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.pp_size

    @property
    def stage_index(self) -> int:
        """This process's rank in its pipeline: its stage, or with several stages per process the lowest."""
        return self.global_rank // self.dp_size

    @property
    def dp_rank(self) -> int:
        return self.global_rank % self.dp_size

    @property
    def stage_ranks(self) -> tuple:
        """The pipeline rank of each stage: ``(0, 1, 0, 1)`` for 2 processes with 2 stages each."""
        return ALL_SCHEDULES[self.schedule].stage_ranks(self.pp_size, self.stages_per_rank)

    @property
    def is_first_stage(self) -> bool:
        """Whether this process holds the first stage (it runs the user's step up to the body)."""
        return self.stage_index == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this process holds the last stage (it computes the loss and logs; under ZB-V process 0)."""
        return self.stage_index == self.stage_ranks[-1]

    @property
    def pipeline(self) -> Optional[Pipeline]:
        """This rank's :class:`~lightning_pipe.Pipeline` (after setup)."""
        return self._pipeline

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def process_dataloader(self, dataloader: object) -> object:
        """Seed the loader's workers by replica, not by process: every stage of a pipeline loads the same batch.

        With ``seed_everything(seed, workers=True)`` Lightning seeds each worker from the global rank
        (it adds its ``worker_init_fn`` right after this hook, where none is set). A random transform in
        a worker (label noise, a random crop of an image and its mask, masked-token labels) would then
        draw differently on the first stage, which feeds the body, and on the last one, which computes
        the loss. The replica index takes the global rank's place, as under DDP with one process per
        replica.
        """
        if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", 0) is None:
            dataloader.worker_init_fn = partial(pl_worker_init_function, rank=self.dp_rank)
        self._check_lengths(dataloader)
        return dataloader

    def _check_lengths(self, dataloader: object) -> None:
        """Every process of a pipeline runs every step of a loop, so they must load as many batches: refuse on every
        rank, as the loader is set up, where they would not (:mod:`.batches` compares each batch, not whether one
        comes). Under DDP an evaluation loop has no collective, and ranks may run different numbers of steps."""
        if self.pp_size == 1 or self.pp_group is None:
            return
        try:
            length: Any = len(dataloader)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):  # an iterable dataset without a length: not known before it ends
            length = math.inf
        except Exception as error:  # raised on every rank of the pipeline, after the exchange
            length = f"{type(error).__name__}: {error}"
        per_stage: List[Any] = [None] * self.pp_size
        dist.all_gather_object(per_stage, length, group=self.pp_group)
        failed = [theirs for theirs in per_stage if isinstance(theirs, str)]
        if failed:
            raise ConfigurationError(f"len() of a dataloader failed on a process of this pipeline: {failed[0]}")
        if any(theirs != length for theirs in per_stage):
            stage = self.lightning_module.trainer.state.stage
            raise BatchMismatchError(
                f"the processes of this pipeline load {stage.dataloader_prefix if stage else 'their'} dataloaders of "
                f"different lengths: {per_stage} batches (per pipeline rank). Each stage runs every step of the loop, so "
                "the one with more would wait for the others until the timeout. The data is sharded or sized by "
                "process (global rank, dist.get_rank()): shard it by trainer.strategy.dp_rank over "
                "trainer.strategy.dp_size, which the processes of a pipeline share"
            )

    def setup_environment(self) -> None:
        if self.world_size % self.pp_size:
            raise ConfigurationError(
                f"PipeStrategy(pipe_size={self.pipe_size}) must divide the number of processes (devices x num_nodes = "
                f"{self.world_size}); use a pipe_size among {[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}"
            )
        if self.stages_per_rank > 1 and self.pp_size < 2:
            raise ConfigurationError(
                f"PipeStrategy(schedule={self.schedule!r}"
                + (f", virtual_stages={self.virtual_stages}" if self.virtual_stages is not None else "") + ") places "
                f"{self.stages_per_rank} stages on each process of a pipeline of several, but pipe_size is {self.pp_size} "
                f"({self.world_size} processes); use pipe_size >= 2, or schedule='1f1b' without virtual_stages")
        spec = ALL_SCHEDULES[self.schedule]
        if not spec.runs_on_nccl and self._get_process_group_backend() == "nccl":
            raise ConfigurationError(f"PipeStrategy: {spec.nccl_refusal()} (process_group_backend='gloo')")
        super().setup_environment()
        end_process_groups_at_exit(destroy=True)
        if self._groups_of is not dist.group.WORLD:  # once per strategy: Lightning sets up again for each fit,
            # validate, test and predict, and a gloo group's threads live as long as the group
            mesh = init_device_mesh(self.root_device.type, (self.pp_size, self.dp_size), mesh_dim_names=("pp", "dp"))
            self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
            self._groups_of = dist.group.WORLD

    # -- setup ---------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not module.automatic_optimization:
            raise ConfigurationError("PipeStrategy supports automatic optimization only: the pipeline runs forward and "
                                     "backward inside training_step. Remove `self.automatic_optimization = False`")
        if fitting and self.pp_size > 1 and hooks.overrides(module, "backward"):
            raise ConfigurationError(
                f"{type(module).__name__} overrides LightningModule.backward, which PipeStrategy never calls: the "
                "pipeline computes each stage's gradients itself, microbatch by microbatch, from the loss the step "
                "returns (training with the override ignored would differ from DDP). Put what the override does into "
                "the returned loss (a scale, an extra term) or into on_after_backward, and remove the override")
        seconds = getattr(trainer, "_val_check_time_interval", None)
        if fitting and self.pp_size > 1 and seconds is not None:
            raise ConfigurationError(
                f"Trainer(val_check_interval=...) given as a time validates after {seconds} seconds, which each "
                "process measures on its own clock: the processes of a pipeline would start validation after "
                "different batches and wait for each other until the timeout. Give it as a number of batches or a "
                "fraction of the epoch")
        if fitting and self._layer_sync is not None and self.dp_size > 1:
            raise ConfigurationError(
                f"Trainer(sync_batchnorm=True) (a LayerSync plugin: {type(self._layer_sync).__name__}) with "
                f"PipeStrategy over {self.dp_size} replicas: it would turn BatchNorm into SyncBatchNorm over every "
                "process, while the processes of a pipeline hold different stages, and synchronizing over a stage's "
                "replicas only is not supported. Remove sync_batchnorm (each replica normalizes its own microbatches, "
                "as each DDP process does without it; deferred_batch_norm=True keeps running statistics per batch), "
                "or use GroupNorm or LayerNorm")
        if fitting:
            self._refuse_unsupported_callbacks(trainer)
            self._train_ended = False
        hooks.count_replicas_in_throughput(trainer.callbacks, self.dp_size)
        scaling.share_loss_scaler(self.precision_plugin, self.root_device)
        if self.split is None or self.split.module is not module:
            self._split_module(module, trainer)
        self.split.install(whole=False)
        present_whole_body(self.split.stand_in, self.split.body)  # configure_optimizers sees every layer
        self.split.stand_in.begin_step("local")
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        m = self.num_microbatches or 2 * self.pp_size
        stand_in = self.split.stand_in
        modules = [self._runner.first_stage() if s == 0 else stand_in.chunk(k) for k, s in enumerate(stand_in.stages)]
        self._pipeline = Pipeline(
            modules, chunks=m, process_group=self.pp_group, schedule=self.schedule,
            timeout=self._timeout or default_pg_timeout, checkpoint=self.checkpoint, device=self.root_device,
            # a block's extra arguments may be None in one microbatch and a tensor in the next
            variable_messages=isinstance(stand_in, PipelinedLayerList),
            virtual_stages=self.stages_per_rank if self.stages_per_rank > 1 else None,
        )
        for stage in self._pipeline.stages:  # the first stage checkpoints the body's layers itself (see FirstStage),
            if stage.stage_index == 0:        # never the user's step
                stage.checkpoint = "never"
        self._pipeline.errors.watch_job = True  # replicas cannot go on once any rank failed
        self._overlapped: Optional[set] = None  # parameters averaged over replicas inside the step (ids)
        self._overlap_decided = self._synced_in_step = False
        self._defer_fingerprint = True  # until a step is found to write into its batch (see training_step)
        self._batches_agreed: set = set()  # the step hooks whose first batch every rank compared (see batches)
        self._runner.runs_whole_too = self.pp_size > 1 and self.is_first_stage and self.is_last_stage
        # where DDP's global rank 0 would run the code after the body (see .loggers)
        watch = self.pp_size > 1 and self.is_last_stage and self.dp_rank == 0 and self.global_rank != 0
        self._runner.watch_loggers_on = self.global_rank if watch else None
        self._effects.num_microbatches = m
        self._effects.warns = self.is_last_stage and self.dp_rank == 0  # once, where the step runs whole
        for metric in (m for m in module.modules() if isinstance(m, logs.Metric) and m.process_group is None):
            metric.process_group = self.dp_group
        # as DDP at wrap time: replicas start from replica 0's parameters and buffers, and each forward after a
        # training step that synced gradients starts from its buffers (DDP's broadcast_buffers; see _sync_buffers)
        if fitting and self.dp_size > 1:
            replicas.broadcast_from_replica_zero([*module.parameters(), *module.buffers()], self.dp_group)
        self._buffers_synced_next = fitting
        for kind in (hooks.StepState, hooks.FailTogether):  # FailTogether first: before any callback's on_exception
            if not any(isinstance(c, kind) for c in trainer.callbacks):
                trainer.callbacks.insert(0, kind(self))
        if self._checkpoints is None or self._checkpoints.split is not self.split:
            self._checkpoints = Checkpoints(self.split, module, self.pp_group, self.pp_size, self.dp_rank)
        if fitting:
            if self.pp_size > 1 and is_overridden("configure_optimizers", module):
                # first, so that what the user's code keeps (`self.optimizer = ...`) is the real build's
                failed = self._checkpoints.note_whole_orders(lambda: _init_optimizers_and_lr_schedulers(module)[0])
                if failed is not None and self.dp_rank == 0:
                    warnings.warn(
                        f"PipeStrategy could not run configure_optimizers over the whole model (other stages' layers "
                        f"on the meta device) to learn each param group's order ({failed}); checkpoints order a "
                        "group's parameters of different stages by the model's parameter order, so a group that "
                        "lists them in another order is saved in a different order than one process saves it",
                        stacklevel=2)
            with trainable_placeholder(module, self.root_device):
                self.setup_optimizers(trainer)
            self._refuse_unsupported_optimizers()
            if self.pp_size > 1:
                averaging.adopt(trainer.callbacks, module, self.root_device, self._averaged_for_hooks)
            self._checkpoints.record_layouts(self._bare_optimizers())
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
            if self.pp_size > 1:
                hooks.combine_stage_logs(self, module, trainer.callbacks)
                hooks.norms_over_stages(self)  # the user's own clip_grad_norm_ in those hooks: over all stages
                hooks.support_finetuning(self, trainer.callbacks)
            v = self.stages_per_rank
            stages = f"{self.pp_size} stages" if v == 1 else f"{self.pp_size * v} stages ({v} per process)"
            simulated = ideal(self.schedule, self.pp_size, m, v if v > 1 else None)
            rank_zero_info(f"PipeStrategy: {stages} x {self.dp_size} replicas, schedule {self.schedule}, "
                           f"{m} microbatches, checkpoint {self.checkpoint}, body `{self.split.path}`, ideal bubble "
                           f"{simulated.bubble_fraction:.1%}, up to {max(simulated.peak_memory):.3g} microbatches in "
                           "flight per process\n" + "\n".join(self._stage_rows()))
            # on_fit_start: the summary sees the whole model; the learning rate finder (Tuner.lr_find), which trains
            # and restores its checkpoint inside its on_fit_start, first in order, sees the split one
            finders = [i for i, c in enumerate(trainer.callbacks) if isinstance(c, LearningRateFinder)]
            trainer.callbacks.insert(finders[-1] + 1 if finders else 0, hooks.BodySwap(self, whole=True))
            trainer.callbacks.append(hooks.BodySwap(self, whole=False))
        self.setup_precision_plugin()
        if fitting:
            with _released_states_set_aside(self.optimizers):
                _optimizers_to_device(self.optimizers, self.root_device)

    def _refuse_unsupported_callbacks(self, trainer: Any) -> None:
        """Callbacks that cannot run on a split module: refused on every rank, before any collective."""
        from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging

        if self.pp_size == 1:
            return
        reasons = {
            StochasticWeightAveraging: "it copies the whole LightningModule and averages every parameter in one "
                                       "process, while each pipeline stage holds only its own layers (the others are "
                                       "meta tensors). Use Lightning's WeightAveraging callback (its default average "
                                       "is SWA's), which PipeStrategy supports",
            ModelPruning: "it prunes every layer from one process (a global threshold over all parameters, masks that "
                          "rename each pruned parameter to `<name>_orig`), while each pipeline stage holds only its own "
                          "layers (the others are meta tensors). Remove the callback, or prune after fit (the whole "
                          "model is gathered back into the module)",
        }
        for callback in trainer.callbacks:
            for kind, reason in reasons.items():
                if isinstance(callback, kind):
                    raise ConfigurationError(f"PipeStrategy does not support the {type(callback).__name__} callback: "
                                             f"{reason}, or train with pipe_size=1")

    def _refuse_unsupported_optimizers(self) -> None:
        """Optimizers whose step needs the whole model in one process (every rank builds the same ones, and
        refuses them before its first collective)."""
        if self.pp_size == 1:
            return
        from torch.distributed.optim import ZeroRedundancyOptimizer

        for optimizer in self._bare_optimizers():
            if isinstance(optimizer, ZeroRedundancyOptimizer):
                raise ConfigurationError(
                    "PipeStrategy does not support ZeroRedundancyOptimizer: it shards the optimizer's state over its "
                    "process group (every process by default) and each process then broadcasts the parameters it "
                    "updated, while the processes of a pipeline hold different stages: each would overwrite the others' "
                    "layers with stale copies. Each stage's optimizer already updates only that stage's layers; use the "
                    "optimizer ZeroRedundancyOptimizer wraps (its optimizer_class) directly, or train with pipe_size=1")
            if isinstance(optimizer, torch.optim.LBFGS):
                raise ConfigurationError(
                    f"PipeStrategy does not support {type(optimizer).__name__}: its step calls the closure several "
                    "times and computes norms and dot products over all its parameters, which each pipeline stage "
                    "would compute over its own layers only (steps unlike DDP's). Use a first-order optimizer (SGD, "
                    "Adam, AdamW, ...), or train with pipe_size=1")

    def _refresh_layouts(self) -> None:
        """Record the optimizers' param-group layouts again (a collective): groups may have been added since
        setup (``BaseFinetuning.unfreeze_and_add_param_group``). Every stage must hold as many groups."""
        optimizers = self._bare_optimizers()
        counts: List[Any] = [None] * self.pp_size
        dist.all_gather_object(counts, [len(o.param_groups) for o in optimizers], group=self.pp_group)
        if any(c != counts[0] for c in counts):
            raise ConfigurationError(
                f"the optimizers have different numbers of param groups on the pipeline's stages ({counts}): a param "
                "group was added on some stages only (e.g. unfreeze_and_add_param_group of modules that only some "
                "stages hold). Add param groups on every stage, e.g. for modules outside the body or the whole body")
        self._checkpoints.record_layouts(optimizers)

    def _stage_rows(self) -> List[str]:
        rows = self.split.describe(self.dp_size)
        if self._costs is None:
            return rows
        estimates = profile.describe(self.balance, self._costs, self.split.ranges)
        return [f"{row}, {estimate}" for row, estimate in zip(rows, estimates)]

    def _split_module(self, module: torch.nn.Module, trainer: Any) -> None:
        layout = plan(self, module, trainer)
        self.split, self._costs, self._sharded = layout.split, layout.costs, layout.sharded
        self._effects = StepEffects(module, 1)
        self._buffer_watch = BufferWatch(module, checkpoint=self.checkpoint, body=self.split.path)
        self._recorder = logs.LogRecorder(module, self.split.path)
        self._runner = StepRunner(module, self.split.stand_in, self.split.path, self._recorder, self._effects,
                                  self.checkpoint, self.loss_reduction)
        self._ties = None
        if self._stale is not None:
            self._stale.remove()  # an earlier module's
        split = self.split
        self._stale = None if self.pp_size == 1 or split.first_rank == split.last_rank else \
            StaleCopies(module, split.path, watch=split.pp_rank == split.last_rank)
        self._runner.stale = self._stale

    def _bare_optimizers(self) -> List[Any]:
        return [getattr(o, "_optimizer", o) for o in self.optimizers]

    # -- training ------------------------------------------------------------------------------
    def _sync_buffers(self, synced_next: bool) -> None:
        """DDP's ``broadcast_buffers`` during fit: a forward that follows one with gradient sync (a training step that
        is not accumulating) starts from replica 0's buffers (BatchNorm statistics, and buffers a hook reassigned
        between the steps), so a replica's evaluation uses them; ``synced_next`` is what this step leaves for the next
        (DDP's ``require_forward_param_sync``). As under DDP, replicas must run the same number of evaluation steps
        (Lightning's distributed sampler pads them to it)."""
        if self._buffers_synced_next and self.dp_size > 1:
            replicas.broadcast_from_replica_zero(list(self.lightning_module.buffers()), self.dp_group)
        self._buffers_synced_next = synced_next

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._hide_whole()  # a checkpoint that did not reach save_checkpoint (an exception its saver caught)
        module, first, last = self.lightning_module, self.is_first_stage, self.is_last_stage
        self._sync_buffers(not module.trainer.fit_loop.epoch_loop._should_accumulate())
        one_run = self.pp_size == 1 and self.num_microbatches == 1  # the step runs once, as under DDP
        self._runner.begin("training_step", args[1:], self._pipeline,
                           None if one_run else optimizer_settings(module.trainer))
        executor = self._pipeline.executor
        measure = self.log_pipeline_metrics and self.pp_size > 1 and module.trainer._logger_connector.should_update_logs
        if measure and executor.recorder is None:  # a PipelineTrace callback may be recording already
            executor.recorder = _OneStep()
        # averaged inside the step only when this batch is the optimizer step's only one: with a batch set aside
        # before it (accumulate_grad_batches changed since the first step, by GradientAccumulationScheduler), that
        # batch's gradients would be added after the average (see _start_overlap)
        overlap = self._overlapped is not None and module.trainer.accumulate_grad_batches == 1 \
            and not module.trainer.fit_loop.epoch_loop._should_accumulate()
        # the whole pipeline waits for the first stage's start: what need not come first waits for this rank's first
        # wait in the step (the fingerprint's values, the receive of the results: 0.4 ms on benchmarks/glue_cost.py).
        # The values are read before the first step, which may write into its batch (later runs then get copies)
        deferred = self.pp_size > 1 and not last
        loaded = batches.fingerprint(args[0], deferred=deferred and self._defer_fingerprint
                                     and not self._runner.first_training_step) if self.pp_size > 1 else None
        self._agree_on_first_batch(loaded, "training_step")
        posted: list = []
        # a microbatch's slice counts its own writes, not the batch's tensor: the pipeline noted the slices' versions
        idle = (lambda: posted.append(self._post_results()),
                lambda: loaded.compute(written=written_since(self._pipeline.input_versions))) if deferred else ()
        with self.precision_plugin.train_step_context():
            parameters = list(module.parameters())
            earlier = gradients.take_grads(parameters)
            if self._zeroed_after_step(module.trainer):
                # stale: Lightning zeroes the optimizers' after this step; freed now, before new ones exist. A
                # parameter no optimizer holds keeps adding up its gradients, as under DDP
                held = {id(p) for optimizer in module.trainer.optimizers for group in optimizer.param_groups
                        for p in group["params"]}
                earlier = {p: grad for p, grad in earlier.items() if id(p) not in held}
            self._refresh_stale_copies(training=True)
            if self.split.pending_own:
                self.split.hook_unfrozen()
            buffers = self._buffer_watch.before()
            # the modules used are learned from the first step; a global hook or mode would slow every later call
            calls = release.uses_recorded(module, self.split.path) if self._ties is None else nullcontext(set())
            versions = self._effects.versions(parameters)
            with self._recorder.recording(microbatched=True), calls as self._called:
                loss, _ = self._pipeline.forward_backward(
                    *((args[0],) if first else ()), labels=(args[0],) if last else (), loss_reduction="sum",
                    criterion=self._runner.criterion if last and self.pp_size > 1 else None,  # one stage: FirstStage's loss
                    loss_scale=scaling.loss_scale(self.precision_plugin, self.root_device)
                    / module.trainer.accumulate_grad_batches, sync_replicas=overlap, when_idle=idle,
                )
            self._effects.refuse_updated("training_step", versions)
            self._buffer_watch.after(buffers, len(self._pipeline.last_sizes))
            if self.deferred_batch_norm:
                commit_deferred_batch_norm(module)
            if self._ties is None:
                self._learn_usage()
            self._pending_grads = gradients.take_grads(module.parameters())
            account = self._runner.account
            summary = (loss, self._runner.folded_logs(self._pipeline.last_sizes),
                       account.merged_extras(self._runner.shapes["training_step"]),
                       account.normalizer()) if last else None
            loss, extras, normalizer = self._share_results(summary, posted[0] if posted else None, "training_step",
                                                           loaded)
            if loaded is not None and loaded.written:  # a later step wrote into its batch: read it before the step
                self._defer_fingerprint = False
            if normalizer is not None:  # the losses were weighted by num_items: divide by their total now
                if overlap:
                    raise ConfigurationError(
                        "this training_step returned 'num_items' (or cross_entropy's mean itself, which counts its "
                        "targets) after earlier steps that did not; PipeStrategy averaged the gradients over the "
                        "replicas already. Return 'num_items' from every step")
                if normalizer != 1.0:
                    gradients.scale_grads(self._pending_grads, 1.0 / normalizer)
            self._ties.sum_(self._pending_grads)
            gradients.add_grads(earlier)
            self._synced_in_step = overlap
            if not self._overlap_decided:
                self._overlap_decided = True
                self._start_overlap(normalizer)
        if measure:
            self._log_step_metrics()
        return {"loss": loss, **extras} if extras else loss

    def _log_step_metrics(self) -> None:
        """Log the ``pipe/`` metrics of the step that just ran (see :mod:`.tracing`), replica 0's, on every rank.

        Measured on global rank 0 and shared with every rank (one broadcast every ``log_every_n_steps``), so that
        each rank's ``callback_metrics`` hold the same keys and values, as every DDP rank holds every key it logs: a
        callback monitoring one (``EarlyStopping``, ``ModelCheckpoint``) decides alike on every rank.
        """
        executor = self._pipeline.executor
        records = self._pipeline.gather_trace(executor.recorder.records[-1:])
        if isinstance(executor.recorder, _OneStep):
            executor.recorder = None
        shared = [None]
        if records is not None and self.global_rank == 0:
            shared[0] = tracing.step_metrics(records, sum(self._pipeline.last_sizes) * self.dp_size)
        dist.broadcast_object_list(shared, src=0)
        self.lightning_module.log_dict(shared[0], on_step=True, on_epoch=False)

    def _zeroed_after_step(self, trainer: Any) -> bool:
        """Whether the gradients present now are the last optimizer step's, which Lightning zeroes right after
        this training_step (first batch of an accumulation window), and no hook could look at them first."""
        module = self.lightning_module
        looks = type(module).optimizer_zero_grad is not LightningModule.optimizer_zero_grad or \
            any(hooks.overrides(c, "on_before_zero_grad") for c in [module, *trainer.callbacks])
        return not looks and trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0

    def _learn_usage(self) -> None:
        """First step: which stage trains each parameter outside the body (see :class:`SplitModel`)."""
        split, module = self.split, self.lightning_module
        used = [split.canonical(n) for n, p in module.named_parameters() if split.layer_of(n) is None and p.grad is not None]
        noted = sorted(self._stale.noted) if self._stale is not None else []
        if self._stale is not None:  # its parameters are marked aliases there: the reads release.uses_recorded misses
            self._called |= {id(module.get_submodule(path)) for path in self._stale.read}
        per_stage = self._gather_per_stage((used, split.called_names(self._called), noted, split.own_read(self._called)))
        shared = split.learn_usage([u for u, *_ in per_stage], [c for _, c, *_ in per_stage], [o for *_, o in per_stage])
        self._ties = TiedGradients(split.ties + shared, module, self.stage_index, self.pp_group)
        tied = sorted({tie.names[0] for tie in self._ties.ties})
        if tied:
            rank_zero_info(f"PipeStrategy: parameters used on several stages, kept in sync: {tied}")
        if self._stale is not None:
            tied_names = {name for tie in self._ties.ties for name in tie.names}
            _, called_first, _, own_first = per_stage[split.first_rank]
            behind = split.behind_on_first(tied_names, called_first, own_first)
            synced = self._stale.learn(per_stage[split.last_rank][2], split.trained_on_last(tied_names), behind,
                                       split.behind_on_first(tied_names, called_first))
            if synced:
                names = [path or "the LightningModule's own parameters" for path in synced]
                rank_zero_info(f"PipeStrategy: the last stage uses values of {names} beyond the body's input; its "
                               "copies there are refreshed from the first stage every step")
            if behind:
                rank_zero_info(f"PipeStrategy: the first stage reads {behind}, which the last stage trains; its copies "
                               "there are refreshed from the last stage every step")
        trained, called, *_ = per_stage[self.stage_index]  # by any replica of this stage: kept on every replica alike
        split.release_unused(self._called | split.modules_used(trained, called), self._bare_optimizers())
        averaging.follow_releases(module.trainer.callbacks, module)

    def _gather_per_stage(self, names: tuple) -> List[tuple]:
        """``names`` (lists of names) of every pipeline rank, each the union over the replicas of that stage.

        What the first step used is learned from it; where the data decides what runs (a module some samples
        are routed to), the replicas' first steps differ, and each would keep or release other modules.
        """
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (self.stage_index, names))
        merged: List[Any] = [tuple(set() for _ in names) for _ in range(self.pp_size)]
        for stage, theirs in everyone:
            for union, part in zip(merged[stage], theirs):
                union.update(part)
        return [tuple(sorted(union) for union in parts) for parts in merged]

    def _start_overlap(self, normalizer: Optional[float]) -> None:
        """After the first step: average over the replicas inside later steps, overlapped with their
        backward (see :mod:`lightning_pipe.replicas`), where that equals averaging after the step.

        It does when nothing is added to the gradients after the step: one batch per optimizer step
        (with accumulation, batches set aside around Lightning's ``zero_grad`` would miss the
        average) and a loss that needs no division by a count known only at the step's end
        (``num_items``, one count per replica). The parameters averaged are those the first step
        trained on this stage in any replica (the same list on every replica: a module only some
        replicas' data used, an expert, would otherwise put the buckets out of step); any other
        that gets a gradient later is averaged after the step. Several stages per rank also average
        after the step (their parameters' last backwards are not told apart here).
        """
        if self.dp_size == 1 or self.lightning_module.trainer.accumulate_grad_batches != 1 or normalizer is not None \
                or len(self._pipeline.stages) != 1:
            return
        candidates = [p for p in self._pending_grads if p.requires_grad and not p.is_meta]
        used = torch.tensor([self._pending_grads[p] is not None for p in candidates], dtype=torch.int32,
                            device=self.root_device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.dp_group)
        trained = [p for p, anywhere in zip(candidates, used.tolist()) if anywhere]
        self._pipeline.sync_replicas_of(self.dp_group, trained)
        self._overlapped = {id(p) for p in trained}

    def refresh_stale_copies(self) -> None:
        """Before hooks that may read any parameter: every stage's copies of what another stage trains, as before
        evaluation (see :mod:`.stale`)."""
        self._refresh_stale_copies(training=False)

    def _refresh_stale_copies(self, training: bool) -> None:
        if self._stale is not None:
            self._stale.refresh(self._pipeline.transport, self.split.first_rank, self.split.last_rank, training)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._stale is not None:
            self._stale.stepped()  # the first stage's copies changed: the last stage's are refreshed before they are used
        return out

    def _post_results(self) -> Any:
        """Post this rank's receive of the step's results ahead of them (see :func:`post_share`)."""
        return post_share(self._pipeline.transport, self.stage_ranks[-1]) if self.pp_size > 1 else None

    def _agree_on_first_batch(self, loaded: Optional[batches.Fingerprint], hook: str) -> None:
        """Before the first step of ``hook`` since setup: every rank of the pipeline compares its batch with the last
        stage's, and all raise on a difference (after later steps, those that differ raise: see _share_results)."""
        if loaded is None or hook in self._batches_agreed:
            return
        self._batches_agreed.add(hook)
        batches.check_together(loaded, self.pp_group, self.stage_ranks[-1], hook, self.lightning_module.trainer.global_step,
                               self._pipeline.transport.ranks)

    def _share_results(self, summary: Optional[tuple], posted: Any, hook: str,
                       loaded: Optional[batches.Fingerprint]) -> tuple:
        """Send the last stage's loss, logs, metric states and results to the whole pipeline; log them.

        Two more things travel with them. ``trainer.should_stop``: a step that sets it
        (``self.trainer.should_stop = True`` on a NaN loss) ran whole on the last stage only, and a
        stage that went on alone would wait for the next step's messages. The fingerprint of the
        last stage's batch, which every other rank compares with its own (see :mod:`.batches`).
        """
        module, last = self.lightning_module, self.is_last_stage
        trainer = module.trainer
        payload = None
        if last:
            mine = loaded.value() if loaded is not None else None
            payload = (summary, logs.metric_states(module, self.split.path), trainer.should_stop, mine)
        if self.pp_size > 1:
            # not waited for until the next step's sends are: every other rank takes it in this step. Except under a
            # torch profiler: a gloo work that completes after the profiler session it began in was replaced by
            # another (Lightning's profiler="pytorch" starts one per loop) crashed torch (SIGSEGV, review ZZ)
            payload = share_object(payload, self._pipeline.transport, self.stage_ranks[-1], posted,
                                   wait=_profiler_enabled())
        (loss, calls, extras, normalizer), metric_states, should_stop, theirs = payload
        if not last:
            batches.check(loaded, theirs, hook, trainer.global_step, self.global_rank,
                          self._pipeline.transport.ranks[self.stage_ranks[-1]])
            logs.load_metric_states(module, metric_states, self.root_device)
            trainer.should_stop = trainer.should_stop or should_stop
        logs.replay(module, calls, self.root_device)
        loss, extras = move_data_to_device((loss, extras), self.root_device)
        if loss is not None and normalizer is not None:
            loss = loss / normalizer
        return loss, extras, normalizer

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        gradients.add_grads(self._pending_grads)
        self._pending_grads = {}
        if self.dp_size > 1 and not module.trainer.fit_loop.epoch_loop._should_accumulate():
            synced = self._overlapped if self._synced_in_step else set()  # averaged inside the step already
            # not those kept here that only other stages train (the last stage's copy of an embedding): never a
            # gradient here, and all-reduced anyway since every replica averages the same parameters
            skipped = synced | self.split.trained_elsewhere
            gradients.average([p for p in module.parameters() if id(p) not in skipped], self.dp_group, self.dp_size)
        return self.precision_plugin.post_backward(closure_loss, module)

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        """Lightning's own clipping, ``clip_grad_norm_`` over the optimizer's parameters, with the total norm
        taken over all stages (a tied parameter once) in the order one process takes it."""
        with hooks.total_norms_over_stages(hooks.StageNorms(self)):
            torch.nn.utils.clip_grad_norm_(list(self.precision_plugin.main_params(optimizer)), clip_val)

    # -- evaluation ----------------------------------------------------------------------------
    def _eval_step(self, hook: str, context: Any, args: tuple) -> Any:
        self._hide_whole()
        self._sync_buffers(False)
        if self.pp_size == 1:
            with context:
                return getattr(self.lightning_module, hook)(*args)
        self._refresh_stale_copies(training=False)
        loaded = batches.fingerprint(args[0])
        self._agree_on_first_batch(loaded, hook)
        posted = self._post_results()
        versions = self._effects.versions(self.lightning_module.parameters())
        with context:
            outputs, summary = self._runner.evaluate(hook, args[0], args[1:], self._pipeline, self.is_first_stage,
                                                     self.is_last_stage)
        self._effects.refuse_updated(hook, versions)
        _, extras, _ = self._share_results(summary, posted, hook, loaded)
        return extras.get("outputs", outputs)  # the step's merged output on every rank (predictions included)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context(), args)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context(), args)

    def _warn_layer_hooks(self) -> None:
        """At each loop's start, after the user's and the callbacks' ``on_*_start``: hooks on the body's layers."""
        if self.pp_size > 1 and self.split is not None and self.split.installed and self.global_rank == 0:
            self.split.stand_in.warn_layer_hooks()

    def on_train_start(self) -> None:
        super().on_train_start()
        self._warn_layer_hooks()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._warn_layer_hooks()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._warn_layer_hooks()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._warn_layer_hooks()
        if self.pp_size > 1:  # one writer per pipeline: see hooks.route_prediction_writers
            self._routed_writers = hooks.route_prediction_writers(self.lightning_module.trainer.callbacks,
                                                                  self.stage_index == 0, self._writing)

    def on_predict_end(self) -> None:
        hooks.restore_prediction_writers(self._routed_writers)
        self._routed_writers = []
        super().on_predict_end()

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", self.precision_plugin.predict_step_context(), args)

    def share_step_state(self) -> None:
        """Epoch end: the attributes the last stage's steps built, to every stage (see :mod:`.hooks`)."""
        if self.pp_size > 1 and self.split is not None and self.split.installed:
            state = self._effects.shared_state() if self.is_last_stage else None
            state = share_object(state, self._pipeline.transport, self.stage_ranks[-1])
            if not self.is_last_stage:
                self._effects.load_shared_state(move_data_to_device(state, self.root_device))

    # -- collectives from user code run over the replicas of a stage, as DDP's run over its replicas
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        world = group is None or group is dist.group.WORLD
        return super().all_gather(tensor, group=self.dp_group if world else group, sync_grads=sync_grads)

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return super().reduce(tensor, group=self.dp_group if group is None else group, reduce_op=reduce_op)

    def _refuse_in_step(self, what: str) -> None:
        """A collective over every process, called from the user's step, would wait for stages that never run it."""
        runner = self._runner
        if self.pp_size > 1 and runner is not None and runner.in_step:
            raise ConfigurationError(
                f"{runner.hook} called {what}, a collective over every process. Under PipeStrategy the step runs on the "
                "first stage (up to the body) and the last one only, so the other processes would never join it and "
                "this one would wait until the timeout. Call it from a hook that runs on every process (e.g. "
                "on_train_batch_end, on_validation_epoch_end); self.all_gather and self.log(sync_dist=True) are fine "
                "in the step (they run over the replicas of the stage)")

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """A prediction writer runs, on the first stage only: its barrier and broadcast run over that stage's
        replicas, the processes that write (global ranks ``0 .. dp_size - 1``, DDP's ranks for the same shards)."""
        self._among_writers = True
        try:
            yield
        finally:
            self._among_writers = False

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_in_step("trainer.strategy.barrier()")
        if not self._among_writers:
            super().barrier(*args, **kwargs)
        elif self.dp_size > 1:
            nccl = dist.get_backend(self.dp_group) == "nccl"
            dist.barrier(group=self.dp_group, device_ids=self.determine_ddp_device_ids() if nccl else None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._refuse_in_step("trainer.strategy.broadcast()")
        if not self._among_writers:
            return super().broadcast(obj, src)
        if not 0 <= src < self.dp_size:
            raise ConfigurationError(
                f"trainer.strategy.broadcast(src={src}) in a prediction writer: under PipeStrategy the writers run on "
                f"the first stage's {self.dp_size} process(es), global ranks 0 .. {self.dp_size - 1} (DDP's ranks for "
                "the same data); give a src among them")
        if self.dp_size == 1:
            return obj
        objects = [obj]
        dist.broadcast_object_list(objects, src, group=self.dp_group)
        return objects[0]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self._refuse_in_step("trainer.strategy.reduce_boolean_decision()")
        summed = super().reduce(torch.tensor(int(decision), device=self.root_device), group=dist.group.WORLD,
                                reduce_op="sum")
        return bool(summed == self.world_size) if all else bool(summed)

    # -- checkpoints (see .state.Checkpoints) ---------------------------------------------------
    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        """``configure_model()`` builds on the meta device; setup materializes only this stage."""
        with building_on_meta():
            yield

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with building_on_meta(), self.precision_plugin.tensor_init_context():
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # after the split: each rank loads only its own tensors

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        self._refuse_in_step("trainer.save_checkpoint()")  # before any collective: the other stages are in the step
        self._hide_whole()  # a checkpoint started before this one that did not reach save_checkpoint
        if self.split is None or not self.split.installed:
            return super().lightning_module_state_dict()
        state = self._checkpoints.for_hooks(self._module_state())
        if self.pp_size > 1:
            # Lightning's dump_checkpoint reads this first, then runs the checkpoint hooks, and save_checkpoint
            # follows: the hooks see the whole model, as on one process (a "keep the trainable weights" filter
            # over self.named_parameters() listed this stage's only, and dropped the others' from the file)
            self.split.show_whole(self.pp_group)
            self._showing_whole = True
        return state

    def _averaged_for_hooks(self, callback: Any) -> Dict[str, Any]:
        """A weight averaging callback's average as the checkpoint hooks get it (see :func:`averaging.adopt`): the
        whole averaged model's state (this rank's part, sharded), keyed as the model is. Swapping the average in
        zips the callback's copy with this stage's tensors, so the stand-in goes back in meanwhile."""
        self._hide_whole()
        state = averaging.averaged_state(callback, self.lightning_module, self._module_state)
        self.split.show_whole(self.pp_group)
        self._showing_whole = True
        return self._checkpoints.for_hooks(state)

    def _module_state(self) -> Dict[str, Any]:
        return self._checkpoints.module_state(gather=not self._sharded)

    def _hide_whole(self) -> None:
        """The stand-in back after :meth:`lightning_module_state_dict` showed the checkpoint hooks the whole body."""
        if self._showing_whole:
            self.split.install(whole=False)
            self._showing_whole = False

    def optimizer_state(self, optimizer: Any) -> Dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self._checkpoints is None or optimizer not in self._bare_optimizers():
            return super().optimizer_state(optimizer)
        if self.pp_size > 1 and optimizer is self._bare_optimizers()[0]:
            self._refresh_layouts()  # once per checkpoint, on every rank
        return self._checkpoints.optimizer_state(optimizer, self._bare_optimizers().index(optimizer),
                                                 gather=not self._sharded)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self._hide_whole()
        self._refuse_in_step("trainer.save_checkpoint()")
        for key, value in checkpoint.items():  # the state dict, or where a callback moved it: plain again
            if isinstance(value, HookState):
                checkpoint[key] = OrderedDict(value)
        _refuse_meta_tensors(checkpoint.get("state_dict", {}))
        if not self._sharded or self._checkpoints is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self._checkpoints.save_sharded(checkpoint, filepath, self.is_global_zero)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and os.path.isdir(filepath):
            shutil.rmtree(filepath)
        elif not os.path.isdir(filepath):
            super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        if self._checkpoints is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return self._checkpoints.load(checkpoint_path, self._bare_optimizers() if fitting else [],
                                      strict=self.lightning_module.strict_loading, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Dict[str, Any], strict: bool = True) -> None:
        if self.split is None or not self.split.installed:
            return super().load_model_state_dict(checkpoint, strict=strict)
        module = self.lightning_module
        load = self._checkpoints.weights_loader(checkpoint, strict)
        if not averaging.restore(module.trainer.callbacks, module, checkpoint, load):
            load(checkpoint["state_dict"])

    def load_optimizer_state_dict(self, checkpoint: Dict[str, Any]) -> None:
        if self._checkpoints is None:
            return super().load_optimizer_state_dict(checkpoint)
        if self.pp_size > 1:  # Lightning's BaseFinetuning.on_fit_start ran before its state was loaded: its groups now
            trainer = self.lightning_module.trainer
            if hooks.restore_finetuning_groups(self, trainer.callbacks, self._bare_optimizers()):
                self._refresh_layouts()
        self._checkpoints.load_optimizer_states(self._bare_optimizers(), checkpoint["optimizer_states"])

    # -- the end -------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """Make the whole job stop: say why on this rank, tell every pipeline, and on the launcher end
        stuck ranks.

        The reason is logged at once: the traceback prints only after teardown, and by then
        Lightning's child-process observer may have killed this rank because another one exited.
        """
        _log.error(rank_prefixed_message(f"stopped: {type(exception).__name__}: {exception}", self.global_rank))
        self._hide_whole()  # a checkpoint hook failed, say
        hooks.restore_prediction_writers(self._routed_writers)
        self._routed_writers = []
        super().on_exception(exception)
        self._failed = True  # no gathering in teardown: peers may be gone
        if not self._reported:
            self._report_failure(exception)
        if not self._failed_together:  # where every rank failed, none is stuck: a script catching it goes on
            end_launched_ranks(self.launcher)
        self._failed_together = self._reported = False

    def _report_failure(self, exception: BaseException) -> None:
        """Tell every pipeline of the job (their waits watch it: a replica waiting for this one stops)."""
        note_failure()
        where = f"global rank {self.global_rank}"
        if self.world_size % self.pp_size == 0:  # else the topology is what failed, and has no stages
            where += f" (stage {self.stage_index}, replica {self.dp_rank})"
        report_job_error(f"{where} failed: {type(exception).__name__}: {exception}")
        self._reported = True

    def stop_if_failed_alone(self, exception: BaseException) -> None:
        """Before the callbacks' ``on_exception``: where the other ranks did not all fail too within a few seconds
        (they are inside a step, or in Lightning's per-batch broadcast), a callback's collective
        (``OnExceptionCheckpoint`` gathering the model) would wait for them for good. Stop the job instead, skipping
        those callbacks, with the user's exception. The failure is told first, so ranks waiting in a step for this
        one stop and come too (another replica, whose pipeline did not fail)."""
        self._report_failure(exception)
        self._failed_together = all_ranks_failed(self.world_size, self.global_rank)
        if self._failed_together:
            return
        _log.error(rank_prefixed_message(
            "failed, and the other ranks did not all stop within seconds: the callbacks' on_exception "
            "(OnExceptionCheckpoint, ModelCheckpoint(save_on_exception=True)) are skipped, as saving needs every rank",
            self.global_rank))
        self.on_exception(exception)
        raise exception

    def on_train_end(self) -> None:
        """Put the whole trained model back into the LightningModule (a collective, on every rank)."""
        self._train_ended = True
        if self.split is None or not self.split.installed:
            return
        if self.pp_size > 1:  # their averages are in the module now (their on_train_end ran), and theirs were per stage
            averaging.drop(self.lightning_module.trainer.callbacks)
        if not self.gather_full_model:
            self.split.stand_in.mode = "released"  # fail loudly rather than run stage s alone
            return
        gather_whole_model(self, self._checkpoints)

    def model_to_device(self) -> None:
        self._move_materialized(self.root_device)

    def _move_materialized(self, device: torch.device) -> None:
        """``module.to(device)`` for the tensors this rank holds; released (meta) ones stay meta."""
        self.model._apply(lambda t: t if t.is_meta else t.to(device))

    def teardown(self) -> None:
        if self._pipeline is not None and self._pipeline.replicas is not None:
            self._pipeline.replicas.close()  # its hooks on the parameters
        module = self.lightning_module
        fitting = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        if self._pipeline is not None and not getattr(self, "_failed", False):
            self._pipeline.transport.finish()  # the last step's results: gloo sends them once a receiver asks
        if self.split is not None and self.split.installed and not getattr(self, "_failed", False):
            if fitting and not self._train_ended:  # Lightning skips on_train_end when the fit trains no step
                self.on_train_end()  # (max_steps=0, limit_train_batches=0), which left each rank its stage only
            elif not fitting and self.gather_full_model:
                gather_whole_model(self, self._checkpoints)  # evaluation left the weights as they were
        if module is None:
            with _released_states_set_aside(self.optimizers):
                return super().teardown()
        self._move_materialized(torch.device("cpu"))  # Lightning's teardown calls module.cpu(), which meta refuses
        self._lightning_module = None
        try:
            with _released_states_set_aside(self.optimizers):
                super().teardown()
        finally:
            self._lightning_module = module

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, schedule in (("pipe", "1f1b"), ("pipe_1f1b", "1f1b"), ("pipe_gpipe", "gpipe"), ("pipe_zb_h1", "zb_h1"),
                               ("pipe_zb_h2", "zb_h2")):
            strategy_registry.register(
                name, cls, description=f"Pipeline parallelism with the {schedule} schedule", schedule=schedule
            )
        strategy_registry.register(
            "pipe_interleaved_1f1b", cls, description="Pipeline parallelism with interleaved 1F1B, 2 stages per process",
            schedule="interleaved_1f1b", virtual_stages=2,
        )
        strategy_registry.register("pipe_zbv", cls, description="Pipeline parallelism with the zbv schedule", schedule="zbv")


PipeStrategy.register_strategies(StrategyRegistry)
