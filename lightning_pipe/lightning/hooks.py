"""What Lightning's hooks see under PipeStrategy: the whole model, the step's state, combined logs.

- :class:`BodySwap`: ``on_fit_start`` callbacks (the model summary) see the unsplit body; the learning rate
  finder, which trains in its ``on_fit_start``, the split one.
- :class:`StepState`: before epoch-end hooks, the attributes the last stage's steps built are
  handed to the other stages, so ``on_validation_epoch_end`` computes the same on every rank; before
  ``on_train_epoch_end``, each stage's copies of what another stage trains are refreshed too.
- :class:`FailTogether`: before the callbacks' ``on_exception`` (which may save a checkpoint, a
  collective), a rank that failed alone stops the job instead of waiting for ranks still in a step.
- :func:`combine_stage_logs`: what ``on_before_optimizer_step`` and ``on_after_backward`` hooks
  log on each stage is gathered over the pipeline and combined per name (Lightning's
  ``grad_norm`` made whole-model), then logged on every rank.
- :func:`norms_over_stages`: while the precision plugin runs the gradient hooks (``on_after_backward``,
  ``on_before_optimizer_step``, ``configure_gradient_clipping``), the user's own
  ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` over this module's parameters (or their
  gradients) take the norm over every stage, as on one process (see :class:`StageNorms`).
- :func:`finetuning_filter`: Lightning's ``BaseFinetuning.filter_on_optimizer`` compares parameters
  with ``torch.equal``, which meta tensors (other stages' released parameters) refuse; meta ones
  are compared by identity.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as _clip_grad
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import BaseFinetuning, BasePredictionWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_pipe import gradients
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.lightning.logs import LogRecorder, combine_stages, replay
from lightning_pipe.lightning.state import merge_orders


class BodySwap(Callback):
    """Puts the unsplit body into the module (``whole``) or the local stage back, at fit start."""

    def __init__(self, strategy: Any, whole: bool) -> None:
        self.strategy = strategy
        self.whole = whole

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        split = self.strategy.split
        split.install(whole=self.whole)
        if self.whole and self.strategy.pp_size > 1:
            # other stages' layers are meta copies here: the summary's forward of `example_input_array` (its in and
            # out sizes) would fail on them, so it shows none
            self.strategy.hidden_example = (pl_module._example_input_array,)
            pl_module._example_input_array = None
        if not self.whole:  # the last callback: both swaps are done for this fit
            hidden = self.strategy.hidden_example
            if hidden is not None:
                pl_module._example_input_array, self.strategy.hidden_example = hidden[0], None
            trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, BodySwap)]


class FailTogether(Callback):
    """First of the callbacks' ``on_exception``: learn whether every rank failed (see
    :func:`~lightning_pipe.faults.all_ranks_failed`); where this one failed alone, stop the job at once, before a
    later callback's collective (``ModelCheckpoint``'s save on exception) waits for good. Every rank meets, whatever
    its callbacks, so that the meetings of all ranks stay in step."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.strategy.stop_if_failed_alone(exception)


def count_replicas_in_throughput(callbacks: List[Callback], dp_size: int) -> None:
    """Lightning's ``ThroughputMonitor`` makes its global rates (``train/samples_per_sec``) the device's times
    ``trainer.world_size``, which counts every stage; each stage of a pipeline sees the same samples, so only the
    replicas multiply them. Its ``Throughput`` objects (private, made in the callback's ``setup``, which runs before
    the strategy's) take the number of replicas instead."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    for callback in callbacks:
        if isinstance(callback, ThroughputMonitor):
            for throughput in getattr(callback, "_throughputs", {}).values():
                throughput.world_size = dp_size


class StepState(Callback):
    """Hands the state built by the last stage's steps to the other stages before epoch-end hooks."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # hooks and monitors read the whole model here (EarlyStopping on a weight's norm): the copies of modules
        # another stage trains are refreshed, as before evaluation; a no-op where a validation just did it
        self.strategy.refresh_stale_copies()
        self.strategy.share_step_state()

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.share_step_state()

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.share_step_state()

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.share_step_state()


_WRITES = ("write_on_batch_end", "write_on_epoch_end")


def _write_nothing(*args: Any, **kwargs: Any) -> None:
    return None


def route_prediction_writers(callbacks: List[Callback], writes: bool,
                             among_writers: Callable[[], Any]) -> List[Callback]:
    """Every ``BasePredictionWriter`` writes on the first stage's processes only, and runs there inside
    ``among_writers()`` (until :func:`restore_prediction_writers`); the list of the writers routed.

    Every process of a pipeline gets the same predictions, where each DDP process gets its own shard's: a writer
    naming its files by global rank wrote each prediction once per stage. The first stage's processes have global
    ranks ``0 .. dp_size - 1`` (``stage_index = global_rank // dp_size``), the ranks of DDP's processes on the
    same shards, so theirs write the files DDP writes (``writes``); elsewhere the writer writes nothing.
    ``among_writers`` is the strategy's: a ``trainer.strategy.barrier()`` or ``broadcast`` in a writer then runs
    over the processes that write, as DDP's runs over all of its own, instead of waiting for stages that never
    call it. Only the two methods a writer implements are replaced (per instance), not its other hooks.
    """
    routed = [c for c in callbacks if isinstance(c, BasePredictionWriter)]
    for callback in routed:
        for name in _WRITES:
            setattr(callback, name, _among(getattr(callback, name), among_writers) if writes else _write_nothing)
    return routed


def _among(write: Callable[..., Any], among_writers: Callable[[], Any]) -> Callable[..., Any]:
    def among(*args: Any, **kwargs: Any) -> Any:
        with among_writers():
            return write(*args, **kwargs)
    return among


def restore_prediction_writers(routed: List[Callback]) -> None:
    for callback in routed:
        for name in _WRITES:
            callback.__dict__.pop(name, None)


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


# -- the user's clip_grad_norm_ / get_total_norm over the whole pipeline ---------------------------
# torch's clip_grad_norm_ (under any name, even one imported before fit) finds ``_get_total_norm`` in
# its module's globals at each call: replacing it there, and ``torch.nn.utils.get_total_norm``, while
# the gradient hooks run covers every way of calling them but ``from torch.nn.utils import
# get_total_norm`` done before fit.
_TOTAL_NORM_NAMES = ((_clip_grad, "_get_total_norm"), (torch.nn.utils, "get_total_norm"))
_TORCH_TOTAL_NORM: Callable[..., torch.Tensor] = _clip_grad._get_total_norm


def _key(t: torch.Tensor) -> Tuple[int, int, Any, Any]:
    """Which tensor ``t``'s memory is (a ``.detach()`` or a flattened view of it is the same one)."""
    return t.data_ptr(), t.numel(), t.dtype, t.device


class StageNorms:
    """``get_total_norm`` for the tensors of the LightningModule: a parameter or its gradient, over every stage.

    Every stage runs the same hooks, so every stage makes the same calls. Each tensor is told by
    its memory (a subset such as ``self.head.parameters()`` works); meta tensors (another stage's)
    and parameters without gradient contribute nothing; a parameter held by several stages (tied)
    counts once, on the rank :meth:`SplitModel.counts_in_norm` names. Tensors of no parameter of the
    module are left to torch (this rank's own norm); a call mixing both is refused.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def _positions(self) -> Dict[Tuple, Tuple[int, bool]]:
        split = self.strategy.split
        order = {name: i for i, name in enumerate(split.parameter_order)}
        size = len(order)
        positions: Dict[Tuple, Tuple[int, bool]] = {}
        for name, p in self.strategy.lightning_module.named_parameters():
            name = split.canonical(name)
            if name not in order:  # the placeholder of a stage with no trainable parameter
                continue
            counts = split.counts_in_norm(name)
            if not p.is_meta and p.numel():
                positions[_key(p)] = (size + order[name], counts)  # a weight norm
            if p.grad is not None and not p.grad.is_meta and p.grad.numel():
                positions[_key(p.grad)] = (order[name], counts)
        return positions

    def __call__(self, tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                 foreach: Optional[bool] = None) -> torch.Tensor:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        positions = self._positions()
        real = [t for t in tensors if not t.is_meta and t.numel()]
        found = [positions.get(_key(t)) for t in real]
        if real and not any(found):
            return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)  # no tensor of the module
        if not all(found):
            raise ConfigurationError(
                "torch.nn.utils.clip_grad_norm_/get_total_norm was given both parameters (or gradients) of the "
                "LightningModule and other tensors; under PipeStrategy the module's are reduced over the pipeline's "
                "stages, the others cannot be. Pass the module's parameters only, e.g. self.parameters()")
        mine = {position: t for t, (position, counts) in zip(real, found) if counts}
        norm_type = float(norm_type)
        strategy = self.strategy
        size = 2 * len(strategy.split.parameter_order)
        total = gradients.total_norm_over_stages(gradients.stage_norms(mine, norm_type, foreach), size, norm_type,
                                                 strategy.pp_group, strategy.root_device)
        if total is None:
            return torch.tensor(0.0)
        total = total.to(real[0].device if real else strategy.root_device)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`")
        return total


@contextmanager
def total_norms_over_stages(norm: StageNorms) -> Iterator[None]:
    """torch's total-norm function replaced by ``norm`` in the block, put back after it whatever happens."""
    previous = [getattr(owner, name) for owner, name in _TOTAL_NORM_NAMES]
    for owner, name in _TOTAL_NORM_NAMES:
        setattr(owner, name, norm)
    try:
        yield
    finally:
        for (owner, name), value in zip(_TOTAL_NORM_NAMES, previous):
            setattr(owner, name, value)


def norms_over_stages(strategy: Any) -> None:
    """Wrap the precision plugin's ``post_backward`` (runs ``on_after_backward``) and ``_after_closure`` (runs
    ``on_before_optimizer_step`` and ``configure_gradient_clipping``) in :func:`total_norms_over_stages`."""
    plugin = strategy.precision_plugin
    norm = StageNorms(strategy)
    for method in ("post_backward", "_after_closure"):
        original = getattr(plugin, method)
        while getattr(original, "_pipe_norms", False):  # set up again (another fit): wrap the plain method once
            original = original.__wrapped__
        setattr(plugin, method, _with_norms(original, norm))


def _with_norms(original: Callable, norm: StageNorms) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with total_norms_over_stages(norm):
            return original(*args, **kwargs)

    wrapped._pipe_norms = True  # type: ignore[attr-defined]
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapped


# -- BaseFinetuning --------------------------------------------------------------------------------
_LIGHTNING_FILTER = BaseFinetuning.__dict__["filter_on_optimizer"]


def _filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Any) -> list:
    """Lightning's ``filter_on_optimizer`` (``torch.equal`` between real tensors), meta tensors compared by identity."""
    params = list(params)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(p.is_meta for p in params + held):
        return _LIGHTNING_FILTER.__func__(optimizer, params)
    kept, removed = [], []
    for param in params:
        same = any(p is param if p.is_meta or param.is_meta else torch.equal(p, param) for p in held)
        (removed if same else kept).append(param)
    if removed:
        rank_zero_warn("The provided params to be frozen already exist within another group of this optimizer. "
                       "Those parameters will be skipped.")
    return kept


@contextmanager
def finetuning_filter() -> Iterator[None]:
    """``BaseFinetuning.filter_on_optimizer`` that meta tensors pass, in the block (put back after it)."""
    previous = BaseFinetuning.__dict__["filter_on_optimizer"]
    BaseFinetuning.filter_on_optimizer = staticmethod(_filter_on_optimizer)
    try:
        yield
    finally:
        BaseFinetuning.filter_on_optimizer = previous


def support_finetuning(strategy: Any, callbacks: List[Callback]) -> None:
    """Make each ``BaseFinetuning`` callback work on a split module.

    - its ``on_train_epoch_start`` (which runs ``finetune_function``) sees :func:`finetuning_filter`;
    - the param groups it records name this rank's parameters only (:func:`_local_params_only`);
    - its ``state_dict`` (the param groups it added, by parameter name, which it restores on resume)
      names the parameters of every stage, not only this rank's: a collective, which Lightning calls
      on every rank when it saves a checkpoint. :meth:`PipeStrategy.load_optimizer_state_dict` restores
      them (Lightning's own ``on_fit_start`` runs before the callbacks' state is loaded here).
    """
    for callback in callbacks:
        if not isinstance(callback, BaseFinetuning) or getattr(callback, "_pipe_strategy", None) is strategy:
            continue
        callback._pipe_strategy = strategy
        callback.on_train_epoch_start = _with_filter(type(callback).on_train_epoch_start.__get__(callback))
        callback._store = _local_params_only(type(callback)._store.__get__(callback))
        callback.state_dict = _whole_model_groups(strategy, type(callback).state_dict.__get__(callback))


def _with_filter(method: Callable) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with finetuning_filter():
            return method(*args, **kwargs)
    return wrapped


def _local_params_only(store: Callable) -> Callable:
    """``BaseFinetuning._store`` names each param group's parameters with the module's ``named_parameters()``;
    a group over the body (``unfreeze_and_add_param_group(pl_module.backbone, ...)``) also holds the meta copies
    of other stages' layers (the stand-in iterates the whole body), which have no name here: left out, the
    other stages name them (:func:`_whole_model_groups` merges the names)."""
    def wrapped(pl_module: Any, opt_idx: int, num_param_groups: int, current_param_groups: list) -> None:
        named = {id(p) for p in pl_module.parameters()}
        groups = [{**g, "params": [p for p in g["params"] if id(p) in named]} for g in current_param_groups]
        store(pl_module, opt_idx, num_param_groups, groups)
    return wrapped


def _whole_model_groups(strategy: Any, state_dict: Callable) -> Callable:
    def whole() -> Dict[str, Any]:
        state = state_dict()
        metadata = state.get("internal_optimizer_metadata")
        split = strategy.split
        if strategy.pp_size == 1 or split is None or not isinstance(metadata, dict):
            return state
        per_stage: List[Any] = [None] * strategy.pp_size
        dist.all_gather_object(per_stage, metadata, group=strategy.pp_group)
        merged: Dict[int, List[Dict[str, Any]]] = {}
        for opt_idx in sorted({k for stage in per_stage for k in stage}):
            stages = [stage[opt_idx] for stage in per_stage if opt_idx in stage]
            if len({len(groups) for groups in stages}) != 1:
                raise ConfigurationError(
                    f"{type(state_dict.__self__).__name__} left optimizer {opt_idx} with different numbers of param groups "
                    f"on the pipeline's stages ({[len(groups) for groups in stages]}): unfreeze modules whose parameters "
                    "every stage holds (outside the body, or the whole body)")
            groups = []
            for g, group in enumerate(stages[0]):
                names = [[split.canonical(n) for n in groups_[g]["params"]] for groups_ in stages]
                groups.append({**group, "params": merge_orders(names, split.parameter_order)})
            merged[opt_idx] = groups
        return {**state, "internal_optimizer_metadata": merged}
    return whole


def restore_finetuning_groups(strategy: Any, callbacks: List[Callback], optimizers: List[Any]) -> bool:
    """On resume: the param groups the ``BaseFinetuning`` callbacks had added, rebuilt from this rank's
    parameters (what Lightning's ``BaseFinetuning.on_fit_start`` does when the state is loaded before it).

    Returns:
        Whether any optimizer's param groups changed.
    """
    changed = False
    split = strategy.split
    named = {split.canonical(n): p for n, p in strategy.lightning_module.named_parameters()}
    for callback in callbacks:
        if not isinstance(callback, BaseFinetuning) or not getattr(callback, "_restarting", False):
            continue
        for opt_idx, optimizer in enumerate(optimizers):
            groups = callback._internal_optimizer_metadata.get(opt_idx)
            if groups:
                optimizer.param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                                           "params": [named[n] for n in g["params"] if n in named]} for g in groups]
                changed = True
        callback._restarting = False
    return changed
