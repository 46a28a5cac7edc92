"""The plain-PyTorch pipeline API: :class:`Pipeline`, ``GPipe`` and ``PipeDream`` (1F1B), without Lightning.

Each process holds one rank's stages (see :func:`lightning_pipe.partition`: one stage, or several
under interleaved and V placements) and calls the same method with the same arguments
shape-wise; only the rank holding the first stage needs real inputs and only the rank holding
the last stage needs labels (rank 0 and the last rank, except under ZB-V, whose last stage is on
rank 0). The surface follows haiscale's pipeline API.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_pipe import rng
from lightning_pipe.batchnorm import DeferredBatchNorm, commit_deferred_batch_norm
from lightning_pipe.checkpoint import check_checkpoint
from lightning_pipe.errors import ConfigurationError, PipelineAbortedError
from lightning_pipe.executor import Executor, StepResult
from lightning_pipe.faults import ErrorChannel, end_process_groups_at_exit, note_failed_group, refuse_failed_group
from lightning_pipe.memory import ActivationMeter, MeterOff
from lightning_pipe.microbatch import (NoChunk, batch_size_of, gather, microbatch_sizes, open_containers, plain_tensors,
                                      scatter)
from lightning_pipe.partition import PART_ATTRIBUTE, TIES_ATTRIBUTE
from lightning_pipe.replicas import ReplicaSync
from lightning_pipe.schedule import ALL_SCHEDULES, forward_only, make_table, validate
from lightning_pipe.skip.layout import SkipLayout, declarations
from lightning_pipe.stage import Stage
from lightning_pipe.ties import TiedGradients, sum_step_gradients
from lightning_pipe.tracing import Tracing
from lightning_pipe.transport import Transport

_instances = itertools.count()


def _input_signature(inputs: tuple, chunks: int, batch_dim: int) -> tuple:
    """What the microbatches' structure, shapes and dtypes follow from (``scatter`` is deterministic)."""
    tensors = plain_tensors(inputs)
    if tensors is not None:  # the common batch, described without torch's pytree (see plain_tensors)
        return _plain_structure(inputs), tuple((t.dtype, tuple(t.shape), t.requires_grad) for t in tensors), \
            chunks, batch_dim
    leaves, spec = tree_flatten(open_containers(inputs, keep=False), is_leaf=lambda x: isinstance(x, NoChunk))
    metas = []
    for leaf in leaves:
        tensor = leaf.tensor if isinstance(leaf, NoChunk) else leaf
        metas.append((type(leaf), tensor.dtype, tuple(tensor.shape), tensor.requires_grad)
                     if isinstance(tensor, torch.Tensor) else type(leaf))
    return spec, tuple(metas), chunks, batch_dim


def _plain_structure(tree: Any) -> Any:
    """The containers of a tree :func:`plain_tensors` accepts: their types, lengths, keys and where ``None`` is."""
    kind = type(tree)
    if kind is torch.Tensor:
        return 0
    if kind is dict:
        return dict, tuple(tree), *(_plain_structure(value) for value in tree.values())
    return tree if tree is None else (kind, *(_plain_structure(item) for item in tree))


def _device_of(modules: Sequence[nn.Module], group) -> torch.device:
    for tensor in itertools.chain.from_iterable(itertools.chain(m.parameters(), m.buffers()) for m in modules):
        return tensor.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_modules(module: Union[nn.Module, Sequence[nn.Module]]) -> List[nn.Module]:
    if isinstance(module, (list, tuple, nn.ModuleList)):
        return list(module)
    return [module]


def _stages_per_rank(schedule: str, virtual_stages: Optional[int], modules: List[nn.Module]) -> int:
    """Check the schedule and the number of modules this rank was given; return stages per rank."""
    if schedule not in ALL_SCHEDULES:
        raise ConfigurationError(f"schedule must be one of {sorted(ALL_SCHEDULES)}, got {schedule!r}")
    spec = ALL_SCHEDULES[schedule]
    if virtual_stages is None and spec.stages_per_rank is None and len(modules) > 1:
        virtual_stages = len(modules)
    v = spec.virtual_stages(virtual_stages)
    if len(modules) != v:
        how = "placement='v'" if spec.placement == "v" else "placement='loop'"
        raise ConfigurationError(
            f"schedule {schedule!r} runs {v} stage{'s' if v > 1 else ''} per rank, but this rank was given "
            f"{len(modules)} module{'s' if len(modules) > 1 else ''}; pass the list that "
            f"partition(model, rank, nranks, num_model_chunks={v}, {how}) returns"
        )
    return v


def _agree(group: dist.ProcessGroup, problem: Optional[Exception], settings: Dict[str, Any],
           parts: List[Optional[tuple]]) -> List[List[Optional[tuple]]]:
    """Every rank's argument problem, settings and model parts, on every rank (one collective, at construction): a
    rank given bad arguments, or other settings than the others (microbatches, schedule, stages per rank: the
    step's messages would not pair; a gloo rank aborts, another waits), fails on every rank with the same error,
    instead of only where it was given. Returns the ranks' parts (see :func:`_check_parts`)."""
    mine = (str(problem) if problem is not None else None, settings, parts)
    everyone: List[Any] = [mine]
    if dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    if problem is not None:
        raise problem
    for rank, (text, _, _) in enumerate(everyone):
        if text is not None:
            raise ConfigurationError(f"pipeline rank {rank} refused its arguments: {text}")
    for key, value in settings.items():
        values = [other[key] for _, other, _ in everyone]
        if any(v != value for v in values):
            raise ConfigurationError(
                f"the pipeline's ranks were given different {key}: {values} (by rank in the group); every rank "
                "must build its Pipeline with the same arguments (stages per rank: the number of modules given)")
    return [rank_parts for _, _, rank_parts in everyone]


def _check_parts(parts: List[List[Optional[tuple]]], stage_ranks: Sequence[int]) -> None:
    """The stages :func:`~lightning_pipe.partition.partition` cut must make up one model, each where the schedule
    runs it: a rank given another rank's part, parts of another split (its own ``balance``, a number of ranks
    other than the group's, the wrong ``placement``) would run a model with layers missing or twice, silently."""
    for rank, held in enumerate(parts):
        stages = [s for s, owner in enumerate(stage_ranks) if owner == rank]
        for stage, part in zip(stages, held):
            if part is None:  # a stage built by hand: nothing to check
                continue
            index, num_parts, balance, placement = part
            if index != stage or num_parts != len(stage_ranks):
                raise ConfigurationError(
                    f"pipeline rank {rank} was given part {index} of a model cut into {num_parts} "
                    f"(partition(..., placement={placement!r})) as its stage {stage} of {len(stage_ranks)}: pass "
                    "partition(model, rank, nranks, ...) the rank's index in the pipeline's group and the group's "
                    "size, with the placement the schedule uses")
    cuts = {(part[1], part[2]) for held in parts for part in held if part is not None}
    if len(cuts) > 1:
        raise ConfigurationError(
            f"the pipeline's ranks were given parts of different splits of the model (balance by part: "
            f"{sorted(cut[1] for cut in cuts)}): some layers would run twice or not at all. Pass every rank the same "
            "balance (partition's default balances by parameter count, the same everywhere for the same model)")


class Pipeline(Tracing):
    """This rank's stages of a pipeline run over ``process_group`` with a given schedule.

    Args:
        module: this rank's stage (e.g. from :func:`lightning_pipe.partition`), or its stages in
            stage order (a list) for schedules that run several stages per rank.
        chunks: the number of microbatches a batch is split into (``num_microbatches``).
        process_group: the pipeline's group; under the schedule's placement its rank ``r`` runs
            stage ``r`` (and, with several stages per rank, ``r + p, ...`` or ``2p - 1 - r``).
            Default: WORLD.
        batch_dim: the dimension along which inputs and labels are split.
        checkpoint: ``"always"``, ``"except_last"``, ``"never"`` (or a bool).
        schedule: a name in :data:`lightning_pipe.schedule.ALL_SCHEDULES`: ``"gpipe"``,
            ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb_h1"``, ``"zb_h2"`` or ``"zbv"``.
        broadcast_outputs: whether :meth:`forward` returns the outputs on every rank.
        timeout: how long to wait for one message before failing.
        device: where received tensors go; default: the module's device (NCCL: the current GPU).
        deferred_batch_norm: replace the stages' BatchNorms with :class:`DeferredBatchNorm`, whose
            running statistics are updated once per step as if the whole batch ran at once.
        variable_messages: what stages send each other may change structure with the data (an
            optional mask that is None in some microbatches); their shapes then travel with every
            message instead of once, costing a small message each.
        virtual_stages: stages per rank for ``"interleaved_1f1b"`` (default: the number of
            modules given); the other schedules fix it (``"zbv"``: 2, the rest: 1).
        dp_group: the data-parallel group of this rank's stages (its replicas). With it,
            :meth:`forward_backward` averages the gradients over the replicas, overlapped with the
            backward (see :mod:`lightning_pipe.replicas`), unless ``sync_replicas=False``.
        count_activations: count the activation bytes autograd saves, per stage (``stages[k].meter``)
            and for the rank (``meter``): ``held_bytes``, ``peak_bytes``, exact. Off by default: the
            count hooks every saved tensor, which costs time (see :mod:`lightning_pipe.memory`).

    Raises:
        ConfigurationError: a bad argument, raised on every rank before any communication.
    """

    def __init__(
        self,
        module: Union[nn.Module, Sequence[nn.Module]],
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
        virtual_stages: Optional[int] = None,
        dp_group: Optional[dist.ProcessGroup] = None,
        count_activations: bool = False,
    ) -> None:
        if not dist.is_initialized():
            raise ConfigurationError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
        modules = _as_modules(module)
        self.group = process_group if process_group is not None else dist.group.WORLD
        problem: Optional[Exception] = None
        try:  # bad arguments on some ranks only are named on every rank (see _agree), not only where they were given
            if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
                raise ConfigurationError(
                    f"chunks (the number of microbatches) must be a positive integer, got {chunks!r}")
            self.virtual_stages = _stages_per_rank(schedule, virtual_stages, modules)
            checkpoint = check_checkpoint(checkpoint)
            if not ALL_SCHEDULES[schedule].runs_on_nccl and dist.get_backend(self.group) == "nccl":
                raise ConfigurationError(ALL_SCHEDULES[schedule].nccl_refusal())
        except ConfigurationError as error:
            problem = error
        refuse_failed_group(self.group)  # reads the job's store only: before any message, as on every rank
        agreed = _agree(self.group, problem, dict(
            chunks=chunks, schedule=schedule, virtual_stages=len(modules), batch_dim=batch_dim,
            broadcast_outputs=broadcast_outputs, variable_messages=variable_messages,
            deferred_batch_norm=deferred_batch_norm), [getattr(m, PART_ATTRIBUTE, None) for m in modules])
        if deferred_batch_norm:
            modules = [DeferredBatchNorm.convert_deferred_batch_norm(m) for m in modules]
        self.modules = modules
        self.module = modules[0] if len(modules) == 1 and not isinstance(module, (list, tuple, nn.ModuleList)) \
            else nn.ModuleList(modules)
        self.deferred_batch_norm = deferred_batch_norm
        self.variable_messages = variable_messages
        self.chunks = chunks
        self.batch_dim = batch_dim
        self.schedule = schedule
        self.spec = ALL_SCHEDULES[schedule]
        self.broadcast_outputs = broadcast_outputs
        self._place()
        _check_parts(agreed, self.stage_ranks)
        self.skip_layout = self._skip_layout(modules)
        device = device if device is not None else _device_of(modules, self.group)
        self._build_stages(modules, checkpoint, device, dp_group, count_activations)
        self._setup_communication(timeout, device)
        self._rows: Dict[Tuple[str, int], tuple] = {}
        self._signature = None
        self._trainable: Optional[tuple] = None  # which of this rank's parameters required grad in the last step
        self.step_seed: Optional[int] = None
        self._step = 0
        self.last_step: Optional[StepResult] = None
        self.last_sizes: List[int] = []
        # on rank 0, during a step: each tensor its microbatches hold and its version when split (a microbatch's
        # slice counts its own writes, so a caller that reads the batch late looks here for writes: written_since)
        self.input_versions: List[Tuple[torch.Tensor, int]] = []
        self._row(self.schedule, chunks)  # a table that cannot run fails here, on every rank

    def _place(self) -> None:
        """Which stages this rank runs, under the schedule's placement."""
        self.ranks = dist.get_process_group_ranks(self.group)
        self.pp_rank = dist.get_rank(self.group)
        self.num_ranks = len(self.ranks)
        self.stage_ranks = self.spec.stage_ranks(self.num_ranks, self.virtual_stages)
        self.stage_indices = tuple(s for s, r in enumerate(self.stage_ranks) if r == self.pp_rank)
        self.holds_first = 0 in self.stage_indices
        self.holds_last = len(self.stage_ranks) - 1 in self.stage_indices

    def _build_stages(self, modules: List[nn.Module], checkpoint: str, device: torch.device,
                      dp_group: Optional[dist.ProcessGroup], count_activations: bool) -> None:
        # this rank's activation bytes, all its stages together
        self.meter = ActivationMeter() if count_activations else MeterOff()
        self.stages = [
            Stage(m, s, len(self.stage_ranks), checkpoint, device, self.spec.split_backward, self.meter,
                  count_activations)
            for m, s in zip(modules, self.stage_indices)
        ]
        self.ties = TiedGradients(getattr(modules[0], TIES_ATTRIBUTE, ()), modules, self.pp_rank, self.group)
        self.dp_group = dp_group
        self.replicas = None
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            self.replicas = ReplicaSync([(s.stage_index, list(s.module.parameters())) for s in self.stages],
                                        dp_group, exclude=self.ties.parameters())

    def sync_replicas_of(self, dp_group: dist.ProcessGroup, parameters: Sequence[nn.Parameter]) -> ReplicaSync:
        """From now on average exactly ``parameters`` over ``dp_group`` in :meth:`forward_backward`,
        overlapped with the backward (replacing what ``dp_group=`` set up). For a caller that learns
        which parameters train on this rank only from a first step (PipeStrategy); one local stage.
        """
        if len(self.stages) != 1:
            raise ConfigurationError("sync_replicas_of takes the pipeline of one stage per rank")
        if self.replicas is not None:
            self.replicas.close()
        self.dp_group = dp_group
        self.replicas = ReplicaSync([(self.stages[0].stage_index, list(parameters))], dp_group)
        return self.replicas

    def _setup_communication(self, timeout: timedelta, device: torch.device) -> None:
        # Private API: the default store is the one place every rank already shares without a new
        # rendezvous; the error channel needs exactly that.
        store = dist.distributed_c10d._get_default_store()
        prefix = f"lightning_pipe/{next(_instances)}/{'-'.join(map(str, self.ranks))}/"
        self.errors = ErrorChannel(store, prefix, timeout, threaded=dist.get_backend(self.group) != "nccl")
        end_process_groups_at_exit(destroy=False)  # gloo can abort at exit otherwise (see end_process_groups)
        self.transport = Transport(self.group, self.pp_rank, self.num_ranks, device, self.errors, self.stage_ranks)
        self.executor = Executor(self.stages, self.transport, self.pp_rank, self.skip_layout)

    @property
    def stage(self) -> Stage:
        """The stage running a forward or backward now (the one that ran last between actions).

        With one stage per rank it is always that stage; the Lightning glue reads its
        ``microbatch_index`` inside the user's step.
        """
        return self.executor.stage

    def num_stages(self) -> int:
        """The number of pipeline stages (ranks times stages per rank)."""
        return len(self.stage_ranks)

    def stage_index(self) -> int:
        """This process's stage (with several stages per rank: its first, whose index is the pp rank)."""
        return self.stage_indices[0]

    stage_id = stage_index

    def _skip_layout(self, modules: List[nn.Module]) -> Optional[SkipLayout]:
        """Gather every stage's stash/pop declarations (a collective over the group, once)."""
        local = [declarations(list(m.named_children()) if isinstance(m, nn.Sequential) else [("", m)]) for m in modules]
        per_rank: List[Any] = [None] * self.num_ranks
        if self.num_ranks > 1:
            dist.all_gather_object(per_rank, local, group=self.group)
        else:
            per_rank = [local]
        per_stage: List[Any] = [None] * len(self.stage_ranks)
        for r, declared in enumerate(per_rank):
            for s, decls in zip((s for s, owner in enumerate(self.stage_ranks) if owner == r), declared):
                per_stage[s] = decls
        if not any(per_stage):
            return None
        return SkipLayout(per_stage)

    def _row(self, name: str, num_microbatches: int) -> tuple:
        key = (name, num_microbatches)
        if key not in self._rows:
            tables = make_table(self.schedule, self.num_ranks, num_microbatches, self.virtual_stages)
            if name == "forward":
                tables = forward_only(tables)
            routes = self.skip_layout.routes if self.skip_layout is not None else ()
            self._rows[key] = validate(tables, routes)[self.pp_rank]
        return self._rows[key]

    def _start_step(self, inputs: tuple, labels: tuple = ()) -> Tuple[Optional[list], list, Optional[list]]:
        """Split the inputs on rank 0 (stage 0) and agree on the step's microbatches with every rank.

        ``labels``: where rank 0 holds the last stage too, they are split with the inputs, in one
        :func:`scatter` (a tensor given as both gets the same slices, and tensors of either that share
        memory keep views that see each other's writes, as in one process); their microbatches are
        returned third (None otherwise).
        """
        microbatches = label_parts = None
        header = None
        self.input_versions = []
        # which parameters require grad decides which outputs do: a layer frozen or unfrozen since the last step
        # (BackboneFinetuning) changes what its stage sends, which the header then announces (see exchange_header)
        trainable = tuple(p.requires_grad for stage in self.stages for p in stage.module.parameters())
        changed, self._trainable = self._trainable is not None and trainable != self._trainable, trainable
        if self.pp_rank == 0:
            sizes = microbatch_sizes(batch_size_of(inputs, self.batch_dim), self.chunks)
            if labels:
                self._check_label_sizes(labels, sizes)
                parts = scatter((tuple(inputs), labels), self.chunks, self.batch_dim, self.input_versions)
                microbatches, label_parts = [part[0] for part in parts], [part[1] for part in parts]
            else:
                microbatches = scatter(tuple(inputs), self.chunks, self.batch_dim, self.input_versions)
            signature = (torch.is_grad_enabled(), _input_signature(tuple(inputs), self.chunks, self.batch_dim))
            fresh = signature != self._signature or self.variable_messages or changed
            self._signature = signature
            header = [len(microbatches), 0 if fresh else self.num_ranks, rng.draw_step_seed()] + sizes + \
                [0] * (self.chunks - len(sizes))
        try:
            header = self.transport.exchange_header(header, 3 + self.chunks, changed)
        except PipelineAbortedError:  # a rank failed before this step's header reached this one
            note_failed_group(self.group)
            raise
        num_microbatches = header[0]
        self.step_seed = header[2]
        for stage in self.stages:
            stage.step_seed = self.step_seed
        self.last_sizes = header[3 : 3 + num_microbatches]
        return microbatches, self.last_sizes, label_parts

    def _check_label_sizes(self, labels: tuple, sizes: Sequence[int]) -> None:
        got = microbatch_sizes(batch_size_of(labels, self.batch_dim), len(sizes))
        if got != list(sizes):
            message = (f"labels split into microbatches of sizes {got} but the inputs into {list(sizes)}; "
                       "labels need the inputs' batch size along batch_dim")
            if self.num_ranks > 1:  # found in the step: the other ranks wait for this one's messages (review RR: rank
                # 0 waited out the whole timeout), so they are told, as of a failing action
                note_failed_group(self.group)
                self.transport.errors.report(f"[pp_rank {self.pp_rank} | step {self._step}] ConfigurationError: "
                                             f"{message}")
            raise ConfigurationError(message)

    def _split_labels(self, labels: tuple, sizes: Sequence[int]) -> list:
        if not labels:
            return [()] * len(sizes)
        self._check_label_sizes(labels, sizes)
        return scatter(tuple(labels), len(sizes), self.batch_dim)

    def _loss_fn(self, criterion, labels, sizes, loss_scale, loss_reduction, losses,
                 label_parts: Optional[list]) -> Callable[[int, tuple], torch.Tensor]:
        """The last stage's per-microbatch loss: weighted, scaled for backward, recorded (``label_parts``: the
        labels' microbatches, if split already)."""
        if label_parts is None:
            label_parts = self._split_labels(tuple(labels), sizes)
        total = float(sum(sizes))

        def loss_fn(i: int, outputs: tuple) -> torch.Tensor:
            loss = criterion(*outputs, *label_parts[i]) if criterion is not None else outputs[0]
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigurationError(
                    f"the loss of a microbatch must be a one-element tensor, got {type(loss).__name__} "
                    f"{tuple(getattr(loss, 'shape', ()))}; reduce it in the criterion"
                )
            loss = loss.reshape(()) if loss.dim() else loss  # one op less per microbatch in the common case
            weighted = loss * (sizes[i] / total) if loss_reduction == "mean" else loss
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
        sync_replicas: bool = True,
        when_idle: Sequence[Callable[[], None]] = (),
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
        several ranks get the sum of their ranks' gradients before this returns. With a
        ``dp_group`` and ``sync_replicas`` (the default), ``.grad`` then holds the average over
        the replicas of everything accumulated so far; pass ``sync_replicas=False`` on steps that
        only accumulate. ``when_idle`` are callables run, in order, where this rank's schedule first
        waits for a message that has not arrived (or at its end if it never does): work of the
        caller's that need not delay the pipeline's start.

        Returns:
            ``(loss, outputs)`` on the rank holding the last stage (``outputs`` None unless
            ``return_outputs``); ``(None, None)`` on the other ranks.
        """
        if loss_reduction not in ("mean", "sum"):
            raise ConfigurationError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        labels = tuple(labels)
        microbatches, sizes, label_parts = self._start_step(inputs, labels if self.holds_last else ())
        num_microbatches = len(sizes)
        losses: Dict[int, torch.Tensor] = {}
        loss_fn = self._loss_fn(criterion, labels, sizes, loss_scale, loss_reduction, losses, label_parts) \
            if self.holds_last else None
        row = self._row(self.schedule, num_microbatches)
        replicas = self.replicas if sync_replicas else None
        before = replicas.begin((self.schedule, num_microbatches), row) if replicas is not None else None

        def run() -> StepResult:
            return self.executor.run(row, self._step, num_microbatches, microbatches, loss_fn,
                                     keep_outputs=return_outputs, before=before, when_idle=when_idle)

        result = sum_step_gradients(self.ties, run) if self.ties else run()
        if replicas is not None:
            replicas.finish()
        self._finish_step(result)
        if not self.holds_last:
            return None, None
        loss = torch.stack([losses[i] for i in range(num_microbatches)]).sum()
        outputs = self._merge([result.outputs[i] for i in range(num_microbatches)]) if return_outputs else None
        return loss, outputs

    def _finish_step(self, result: StepResult) -> None:
        self.input_versions = []  # the batch is not kept beyond its step
        if self.deferred_batch_norm:
            for module in self.modules:
                commit_deferred_batch_norm(module)
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
        microbatches, sizes, _ = self._start_step(inputs)
        num_microbatches = len(sizes)
        result = self.executor.run(
            self._row("forward", num_microbatches), self._step, num_microbatches, microbatches, keep_outputs=True
        )
        for stage in self.stages:
            stage.clear()  # a forward-only step under grad mode keeps no graph for later
        self._finish_step(result)
        return [result.outputs[i] for i in range(num_microbatches)] if self.holds_last else None

    def forward(self, *inputs: Any) -> Any:
        """Run forward only (use under ``torch.no_grad()`` for evaluation).

        Returns:
            The merged output on the rank holding the last stage (on every rank with
            ``broadcast_outputs``), else None.
        """
        per_microbatch = self.forward_microbatches(*inputs)
        outputs = self._merge(per_microbatch) if per_microbatch is not None else None
        if self.broadcast_outputs and self.num_ranks > 1:
            outputs = self._broadcast(outputs)
        return outputs

    __call__ = forward

    def _merge(self, per_microbatch: List[tuple]) -> Any:
        merged = gather(per_microbatch, self.batch_dim)
        return merged[0] if len(merged) == 1 else merged

    def _broadcast(self, outputs: Any) -> Any:
        # Evaluation path only: the meta is pickled once per call, the tensors are broadcast.
        source = self.ranks[self.stage_ranks[-1]]
        leaves, spec = tree_flatten(outputs) if self.holds_last else (None, None)
        box = [(spec, [(l.shape, l.dtype) for l in leaves])] if self.holds_last else [None]
        dist.broadcast_object_list(box, src=source, group=self.group, device=self.transport.device)
        spec, metas = box[0]
        if not self.holds_last:
            leaves = [torch.empty(shape, dtype=dtype, device=self.transport.device) for shape, dtype in metas]
        for tensor in leaves:
            dist.broadcast(tensor, src=source, group=self.group)
        return tree_unflatten(leaves, spec)
