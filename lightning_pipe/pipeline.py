"""The plain-PyTorch pipeline API: ``GPipe`` and ``PipeDream`` (1F1B) without Lightning.

Each process holds one stage (see :func:`lightning_pipe.partition`) and calls the same method
with the same arguments shape-wise; only the first stage needs real inputs and only the last
stage needs labels. The surface follows haiscale's pipeline API.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_pipe import rng
from lightning_pipe.batchnorm import DeferredBatchNorm, commit_deferred_batch_norm
from lightning_pipe.checkpoint import check_checkpoint
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.executor import Executor, StepResult
from lightning_pipe.faults import ErrorChannel
from lightning_pipe.microbatch import batch_size_of, gather, microbatch_sizes, scatter
from lightning_pipe.schedule import SCHEDULES, gpipe_forward, validate
from lightning_pipe.skip.layout import SkipLayout, declarations
from lightning_pipe.partition import TIES_ATTRIBUTE
from lightning_pipe.stage import Stage
from lightning_pipe.ties import TiedGradients, sum_step_gradients
from lightning_pipe.trace import Recorder, StepRecord, gather_records
from lightning_pipe.transport import Transport

_instances = itertools.count()


def _meta_signature(microbatches) -> tuple:
    signature = []
    for mb in microbatches:
        leaves, spec = tree_flatten(mb)
        signature.append((str(spec), tuple((l.dtype, tuple(l.shape), l.requires_grad) if isinstance(l, torch.Tensor) else type(l) for l in leaves)))
    return tuple(signature)


def _device_of(module: nn.Module, group) -> torch.device:
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Pipeline:
    """One stage of a pipeline run over ``process_group`` with a given schedule.

    Args:
        module: this process's stage (e.g. from :func:`lightning_pipe.partition`).
        chunks: the number of microbatches a batch is split into (``num_microbatches``).
        process_group: the pipeline's group; its rank ``s`` runs stage ``s``. Default: WORLD.
        batch_dim: the dimension along which inputs and labels are split.
        checkpoint: ``"always"``, ``"except_last"``, ``"never"`` (or a bool).
        schedule: ``"gpipe"`` or ``"1f1b"``.
        broadcast_outputs: whether :meth:`forward` returns the outputs on every stage.
        timeout: how long to wait for one message before failing.
        device: where received tensors go; default: the module's device (NCCL: the current GPU).
        deferred_batch_norm: replace the stage's BatchNorms with :class:`DeferredBatchNorm`, whose
            running statistics are updated once per step as if the whole batch ran at once.
        variable_messages: what stages send each other may change structure with the data (an
            optional mask that is None in some microbatches); their shapes then travel with every
            message instead of once, costing a small message each.
    """

    def __init__(
        self,
        module: nn.Module,
        chunks: int,
        process_group: Optional[dist.ProcessGroup] = None,
        batch_dim: int = 0,
        checkpoint: Union[str, bool] = "never",
        schedule: str = "gpipe",
        broadcast_outputs: bool = False,
        timeout: timedelta = timedelta(minutes=30),
        device: Optional[torch.device] = None,
        deferred_batch_norm: bool = False,
        variable_messages: bool = False,
    ) -> None:
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ConfigurationError(f"chunks (the number of microbatches) must be a positive integer, got {chunks!r}")
        if schedule not in SCHEDULES:
            raise ConfigurationError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if not dist.is_initialized():
            raise ConfigurationError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert_deferred_batch_norm(module)
        self.deferred_batch_norm = deferred_batch_norm
        self.variable_messages = variable_messages
        self.module = module
        self.chunks = chunks
        self.batch_dim = batch_dim
        self.schedule = schedule
        self.broadcast_outputs = broadcast_outputs
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(self.group)
        self._stage_index = dist.get_rank(self.group)
        self._num_stages = len(self.ranks)
        checkpoint = check_checkpoint(checkpoint)
        self.skip_layout = self._skip_layout(module)
        device = device if device is not None else _device_of(module, self.group)
        self.stage = Stage(module, self._stage_index, self._num_stages, checkpoint, device)
        self.ties = TiedGradients(getattr(module, TIES_ATTRIBUTE, ()), module, self._stage_index, self.group)
        # Private API: the default store is the one place every rank already shares without a new
        # rendezvous; the error channel needs exactly that.
        store = dist.distributed_c10d._get_default_store()
        prefix = f"lightning_pipe/{next(_instances)}/{'-'.join(map(str, self.ranks))}/"
        self.errors = ErrorChannel(store, prefix, timeout, threaded=dist.get_backend(self.group) != "nccl")
        self.transport = Transport(self.group, self._stage_index, self._num_stages, device, self.errors)
        self.executor = Executor(self.stage, self.transport, self._stage_index, self.skip_layout)
        self._rows: Dict[Tuple[str, int], tuple] = {}
        self._signature = None
        self.step_seed: Optional[int] = None
        self._step = 0
        self.last_step: Optional[StepResult] = None
        self.last_sizes: List[int] = []

    def num_stages(self) -> int:
        """The number of pipeline stages."""
        return self._num_stages

    def stage_index(self) -> int:
        """This process's stage."""
        return self._stage_index

    stage_id = stage_index

    def _skip_layout(self, module: nn.Module) -> Optional[SkipLayout]:
        """Gather every stage's stash/pop declarations (a collective over the group, once)."""
        local = declarations(list(module.named_children()) if isinstance(module, nn.Sequential) else [("", module)])
        per_stage: List[Any] = [None] * self._num_stages
        if self._num_stages > 1:
            dist.all_gather_object(per_stage, local, group=self.group)
        else:
            per_stage = [local]
        if not any(per_stage):
            return None
        return SkipLayout(per_stage)

    def _row(self, name: str, num_microbatches: int) -> tuple:
        key = (name, num_microbatches)
        if key not in self._rows:
            generator = gpipe_forward if name == "forward" else SCHEDULES[name]
            routes = self.skip_layout.routes if self.skip_layout is not None else ()
            tables = generator(self._num_stages, num_microbatches)
            self._rows[key] = validate(tables, routes)[self._stage_index]
        return self._rows[key]

    def _start_step(self, inputs: tuple) -> Tuple[Optional[list], list]:
        """Split the inputs on stage 0 and agree on the step's microbatches with every stage."""
        microbatches = None
        header = None
        if self._stage_index == 0:
            microbatches = scatter(tuple(inputs), self.chunks, self.batch_dim)
            signature = (torch.is_grad_enabled(), _meta_signature(microbatches))
            fresh = signature != self._signature or self.variable_messages
            self._signature = signature
            sizes = microbatch_sizes(batch_size_of(inputs, self.batch_dim), self.chunks)
            header = [len(microbatches), int(fresh), rng.draw_step_seed()] + sizes + [0] * (self.chunks - len(sizes))
        header = self.transport.exchange_header(header, 3 + self.chunks)
        num_microbatches = header[0]
        self.step_seed = self.stage.step_seed = header[2]
        self.last_sizes = header[3 : 3 + num_microbatches]
        return microbatches, self.last_sizes

    def _split_labels(self, labels: tuple, sizes: Sequence[int]) -> list:
        if not labels:
            return [()] * len(sizes)
        got = microbatch_sizes(batch_size_of(labels, self.batch_dim), len(sizes))
        if got != list(sizes):
            raise ConfigurationError(
                f"labels split into microbatches of sizes {got} but the inputs into {list(sizes)}; "
                "labels need the inputs' batch size along batch_dim"
            )
        return scatter(tuple(labels), len(sizes), self.batch_dim)

    def _loss_fn(self, criterion, labels, sizes, loss_scale, loss_reduction, losses) -> Callable[[int, tuple], torch.Tensor]:
        """The last stage's per-microbatch loss: weighted, scaled for backward, recorded."""
        label_parts = self._split_labels(tuple(labels), sizes)
        total = float(sum(sizes))

        def loss_fn(i: int, outputs: tuple) -> torch.Tensor:
            loss = criterion(*outputs, *label_parts[i]) if criterion is not None else outputs[0]
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigurationError(
                    f"the loss of a microbatch must be a one-element tensor, got {type(loss).__name__} "
                    f"{tuple(getattr(loss, 'shape', ()))}; reduce it in the criterion"
                )
            weighted = loss.reshape(()) * (sizes[i] / total) if loss_reduction == "mean" else loss.reshape(())
            losses[i] = weighted.detach()
            return weighted * loss_scale if loss_scale != 1.0 else weighted

        return loss_fn

    def forward_backward(
        self,
        *inputs: Any,
        criterion: Optional[Callable[..., torch.Tensor]] = None,
        labels: Sequence[Any] = (),
        return_outputs: bool = False,
        loss_scale: float = 1.0,
        loss_reduction: str = "mean",
    ) -> Tuple[Optional[torch.Tensor], Any]:
        """Run forward and backward of one batch through the pipeline.

        ``criterion(*outputs, *labels)`` runs per microbatch on the last stage (without a
        criterion the last stage's output is the loss). With ``loss_reduction="mean"`` the loss
        returned is the microbatch losses' mean weighted by microbatch size, and the gradients
        accumulated into ``.grad`` are those of that loss: for a criterion that averages over
        samples, exactly one forward/backward of the whole batch. With ``"sum"`` the microbatch
        losses are summed: right for a criterion that sums over samples (``reduction="sum"``). A
        loss averaged over something else (tokens under a padding mask) is exact as ``"sum"`` of
        per-microbatch sums with ``loss_scale=1 / total count``. ``loss_scale`` multiplies the loss
        that is backpropagated, not the loss returned (Lightning divides by
        ``accumulate_grad_batches`` this way). Tied parameters that :func:`partition` found on
        several stages get the sum of their stages' gradients before this returns.

        Returns:
            ``(loss, outputs)`` on the last stage (``outputs`` None unless ``return_outputs``);
            ``(None, None)`` on the other stages.
        """
        if loss_reduction not in ("mean", "sum"):
            raise ConfigurationError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        microbatches, sizes = self._start_step(inputs)
        num_microbatches = len(sizes)
        losses: Dict[int, torch.Tensor] = {}
        loss_fn = self._loss_fn(criterion, labels, sizes, loss_scale, loss_reduction, losses) if self.stage.is_last else None

        def run() -> StepResult:
            return self.executor.run(
                self._row(self.schedule, num_microbatches), self._step, num_microbatches,
                microbatches, loss_fn, keep_outputs=return_outputs,
            )

        result = sum_step_gradients(self.ties, run) if self.ties else run()
        self._finish_step(result)
        if not self.stage.is_last:
            return None, None
        loss = torch.stack([losses[i] for i in range(num_microbatches)]).sum()
        outputs = self._merge([result.outputs[i] for i in range(num_microbatches)]) if return_outputs else None
        return loss, outputs

    def _finish_step(self, result: StepResult) -> None:
        if self.deferred_batch_norm:
            commit_deferred_batch_norm(self.module)
        self.reseed(rng.END)
        self._step += 1
        self.last_step = result

    def reseed(self, *keys: int) -> None:
        """Put torch, Python and NumPy generators in the state ``rng.derive(step seed, *keys)``.

        After a step every rank of the pipeline is left in the state of ``keys = (rng.END,)``.
        """
        rng.seed_all(rng.derive(self.step_seed, *keys), self.transport.device)

    def forward_microbatches(self, *inputs: Any) -> Optional[List[tuple]]:
        """Run forward only and return the last stage's outputs per microbatch (None elsewhere)."""
        microbatches, sizes = self._start_step(inputs)
        num_microbatches = len(sizes)
        result = self.executor.run(
            self._row("forward", num_microbatches), self._step, num_microbatches, microbatches, keep_outputs=True
        )
        self.stage.clear()  # a forward-only step under grad mode keeps no graph for later
        self._finish_step(result)
        return [result.outputs[i] for i in range(num_microbatches)] if self.stage.is_last else None

    def forward(self, *inputs: Any) -> Any:
        """Run forward only (use under ``torch.no_grad()`` for evaluation).

        Returns:
            The merged output on the last stage (on every stage with ``broadcast_outputs``), else None.
        """
        per_microbatch = self.forward_microbatches(*inputs)
        outputs = self._merge(per_microbatch) if per_microbatch is not None else None
        if self.broadcast_outputs and self._num_stages > 1:
            outputs = self._broadcast(outputs)
        return outputs

    __call__ = forward

    def _merge(self, per_microbatch: List[tuple]) -> Any:
        merged = gather(per_microbatch, self.batch_dim)
        return merged[0] if len(merged) == 1 else merged

    def _broadcast(self, outputs: Any) -> Any:
        # Evaluation path only: the meta is pickled once per call, the tensors are broadcast.
        source = self.ranks[-1]
        leaves, spec = tree_flatten(outputs) if self.stage.is_last else (None, None)
        box = [(spec, [(l.shape, l.dtype) for l in leaves])] if self.stage.is_last else [None]
        dist.broadcast_object_list(box, src=source, group=self.group, device=self.transport.device)
        spec, metas = box[0]
        if not self.stage.is_last:
            leaves = [torch.empty(shape, dtype=dtype, device=self.transport.device) for shape, dtype in metas]
        for tensor in leaves:
            dist.broadcast(tensor, src=source, group=self.group)
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(leaves, spec)

    # -- timelines ---------------------------------------------------------------------------------
    def trace_steps(self, steps: Optional[Iterable[int]] = None, keep: int = 64) -> Recorder:
        """Record the timeline of ``steps`` (default: every step from now on, the last ``keep`` kept).

        Steps are counted by the pipeline from 0; each ``forward_backward`` and ``forward`` call is
        one. Every stage should record the same steps. Recording costs about a microsecond per
        action; when it is off (the default) the executor pays one ``is not None`` test per action.
        Export with :meth:`export_trace` and :meth:`save_timeline_png`, or gather the records with
        :meth:`gather_trace` for :func:`lightning_pipe.trace.pipeline_metrics`.

        Example (one process; more stages need one process each):
            >>> import os, tempfile, torch, torch.distributed as dist
            >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            >>> pipe = GPipe(torch.nn.Sequential(torch.nn.Linear(3, 1)), chunks=2)
            >>> recorder = pipe.trace_steps(range(1, 3))  # steps 1 and 2
            >>> for _ in range(4):
            ...     _ = pipe.forward_backward(torch.ones(4, 3), criterion=torch.nn.functional.mse_loss,
            ...                               labels=(torch.zeros(4, 1),))
            >>> [record.step for record in recorder.records]
            [1, 2]
            >>> [str(action) for action, begin, end in recorder.records[0].compute]
            ['0F0', '0F1', '0B1', '0B0']
            >>> path = pipe.export_trace(os.path.join(tempfile.mkdtemp(), "trace.json"))  # ui.perfetto.dev
            >>> pipe.stop_tracing() is recorder
            True
            >>> dist.destroy_process_group()
        """
        self.executor.recorder = Recorder(steps, keep)
        return self.executor.recorder

    def stop_tracing(self) -> Optional[Recorder]:
        """Stop recording; return the recorder (its records stay readable), None if none was set."""
        recorder, self.executor.recorder = self.executor.recorder, None
        return recorder

    @property
    def recorder(self) -> Optional[Recorder]:
        """The recorder set by :meth:`trace_steps`, or None when no step is being recorded."""
        return self.executor.recorder

    def gather_trace(self, records: Optional[Sequence[StepRecord]] = None) -> Optional[List[StepRecord]]:
        """Every stage's records (default: its recorder's) on stage 0, clocks aligned.

        A collective over the pipeline's group: every stage must call it. Returns None elsewhere.
        """
        if records is None:
            if self.executor.recorder is None:
                raise ConfigurationError("no steps were recorded: call pipe.trace_steps() on every stage before the steps")
            records = self.executor.recorder.records
        return gather_records(records, self.group, 0, self.transport.device)

    def export_trace(self, path: str) -> Optional[str]:
        """Write every stage's recorded steps as one Chrome trace JSON (opens in ui.perfetto.dev).

        A collective over the pipeline's group: every stage calls it; stage 0 writes ``path`` and
        returns it, the others return None.
        """
        from lightning_pipe.timeline import write_chrome_trace

        records = self.gather_trace()
        return write_chrome_trace(records, path) if records is not None else None

    def save_timeline_png(self, path: str, step: Optional[int] = None) -> Optional[str]:
        """Draw a recorded step of every stage above its simulated plan as a PNG (needs matplotlib).

        A collective over the pipeline's group: every stage calls it; stage 0 writes ``path`` and
        returns it, the others return None. ``step`` defaults to the last step recorded.
        """
        from lightning_pipe.timeline import save_timeline_png

        records = self.gather_trace()
        return save_timeline_png(records, path, step) if records is not None else None


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
    ) -> None:
        super().__init__(
            module, chunks, process_group, batch_dim, checkpoint, "gpipe", broadcast_outputs, timeout,
            deferred_batch_norm=deferred_batch_norm,
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
    ) -> None:
        super().__init__(
            module, chunks, process_group, batch_dim, checkpoint, "1f1b", False, timeout,
            deferred_batch_norm=deferred_batch_norm,
        )
