"""What the user's step logs on the last stage, logged on every rank as Lightning's DDP would.

The last stage runs the user's step once per microbatch. :class:`LogRecorder` catches those
``self.log`` calls instead of handing them to Lightning, folds them into the calls one step over
the whole batch would make (the loss like the loss; a ``Metric`` logged on step, or the value its
call returned, by computing it over the batch; other values with the name's own ``reduce_fx``: a
size-weighted mean for ``"mean"``, the sum for ``"sum"``, the max or min), and after the step
every rank of the pipeline replays the same calls. So every rank (rank 0 included, whose
loggers, progress bar and checkpoint callbacks read them) sees the values DDP would log for the
whole batch, and ``sync_dist`` reduces over the replicas of its stage only. torchmetrics ``Metric`` objects are
mirrored: their states travel from the last stage to the other stages of the pipeline, so
``compute()`` gives the same value everywhere and syncs over the data-parallel group, never over
ranks that did not update them.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_pipe.checkpoint import is_recomputing
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.lightning.release import refuse_other_stages_values
from lightning_pipe.lightning.stale import unmark

try:  # torchmetrics is a dependency of Lightning, but keep this module importable without it
    from torchmetrics import Metric
except ImportError:  # pragma: no cover
    Metric = ()  # type: ignore[assignment,misc]

_MEAN = {"mean", "avg"}
_LOG_PARAMETERS: Optional[Tuple[List[str], Dict[str, Any]]] = None


def _log_parameters() -> Tuple[List[str], Dict[str, Any]]:
    """``LightningModule.log``'s parameter names after ``self``, and their defaults."""
    global _LOG_PARAMETERS
    if _LOG_PARAMETERS is None:
        from lightning.pytorch import LightningModule

        parameters = list(inspect.signature(LightningModule.log).parameters.values())[1:]
        _LOG_PARAMETERS = ([p.name for p in parameters],
                           {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty})
    return _LOG_PARAMETERS


def bind_log_call(name: str, value: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
    """The arguments of one ``self.log`` call by name, defaults filled in.

    What ``inspect.Signature.bind`` + ``apply_defaults`` give, at a tenth of their cost: the last
    stage binds every call of every microbatch, on the pipeline's critical path. A call that
    Lightning itself would refuse raises the same ``TypeError``.

    Example:
        >>> call = bind_log_call("loss", 1.0, True, batch_size=4)
        >>> call["prog_bar"], call["batch_size"], call["reduce_fx"]
        (True, 4, 'mean')
    """
    names, defaults = _log_parameters()
    if len(args) > len(names) - 2:
        raise TypeError(f"LightningModule.log() takes at most {len(names)} arguments after self, got {len(args) + 2}")
    call = dict(defaults)
    call["name"], call["value"] = name, value
    for key, arg in zip(names[2:], args):
        call[key] = arg
    for key, arg in kwargs.items():
        if key not in defaults or key in names[2:2 + len(args)]:
            raise TypeError(f"LightningModule.log() got an unexpected or repeated argument {key!r}")
        call[key] = arg
    return call


def metric_paths(module: nn.Module, exclude: str) -> Dict[int, str]:
    """``id(metric) -> attribute path`` for every torchmetrics Metric outside the body."""
    return {
        id(m): name
        for name, m in module.named_modules()
        if isinstance(m, Metric) and not (name == exclude or name.startswith(exclude + "."))
    }


class LogRecorder:
    """Records ``self.log`` calls per microbatch and folds them into whole-batch calls."""

    def __init__(self, module: nn.Module, body_path: str) -> None:
        self.module = module
        self.body_path = body_path
        self._synced: set = set()  # paths of the Metrics whose value over a step is synced (see recording)
        self._calls: List[List[Dict[str, Any]]] = []
        self._called: List[Counter] = []  # per microbatch: how often it called each Metric (by path)
        self._step_states: Dict[str, tuple] = {}  # per Metric: its state over this step's calls alone
        self._metric_paths: Dict[int, str] = {}
        # per name logged with batch_size: what its number is (see _fold_one), decided by the first step that
        # could tell and kept, so that every step of an epoch is weighed alike
        self._batch_size_kind: Dict[str, str] = {}
        # Metrics logged on step, and off step (epoch values, validation's default): only a Metric never
        # logged on step and seen logged off step is not followed (its calls need no step state)
        self._on_step: set = set()
        self._off_step: set = set()
        # the targets a logged cross_entropy/nll_loss mean averaged over (set by the step runner: losses.MeanTargets)
        self.count_of: Callable[[torch.Tensor], Optional[torch.Tensor]] = lambda value: None

    @contextmanager
    def recording(self, microbatched: bool = False) -> Iterator[None]:
        """Catch the module's ``log`` calls (``log_dict`` goes through ``log``), and follow the Metrics' calls.

        ``microbatched``: the calls are a step's, run once per microbatch. A Metric that syncs its value on step
        (``dist_sync_on_step``) then does not sync in each call: the replicas of a stage may split their batches into
        different numbers of microbatches (a short last batch) and would call its collective a different number of
        times, waiting for each other for good. Its value over the step is synced once instead (:meth:`_batch_value`),
        where DDP's one call per step syncs it.
        """
        self._calls, self._called, self._step_states = [], [], {}
        self._metric_paths = metric_paths(self.module, self.body_path)
        self._synced = {path for path in set(self._metric_paths.values())
                        if microbatched and self.module.get_submodule(path).dist_sync_on_step}
        for path in self._synced:
            self.module.get_submodule(path).dist_sync_on_step = False
        handles = []
        for path in set(self._metric_paths.values()) - (self._off_step - self._on_step):
            metric = self.module.get_submodule(path)
            handles.append(metric.register_forward_hook(self._follow(path), with_kwargs=True))
        self.module.log = self._record  # an instance attribute shadows LightningModule.log
        try:
            yield
        finally:
            del self.module.log
            for handle in handles:
                handle.remove()
            for path in self._synced:
                self.module.get_submodule(path).dist_sync_on_step = True

    def _follow(self, path: str) -> Any:
        """A Metric's forward hook: update its step state too, as its ``forward`` updates its batch state."""
        def hook(metric: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not self._called or is_recomputing():
                return
            self._called[-1][path] += 1
            kept = _state_of(metric)
            try:
                if path in self._step_states:
                    _set_state(metric, self._step_states[path])
                else:
                    metric.reset()
                metric.update(*args, **kwargs)
                self._step_states[path] = _state_of(metric)
            finally:
                _set_state(metric, kept)
        return hook

    @property
    def calls(self) -> List[List[Dict[str, Any]]]:
        """The calls recorded so far, per microbatch."""
        return self._calls

    def start_microbatch(self) -> None:
        if not is_recomputing():
            self._calls.append([])
            self._called.append(Counter())

    def discard_microbatch(self) -> None:
        """Forget the current microbatch's calls: a first stage's run up to the body, which the process holding
        the last stage (under ZB-V the same process) runs again whole."""
        if self._calls and not is_recomputing():
            self._calls.pop()
            self._called.pop()

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if is_recomputing() or not self._calls:
            return
        forward_of = self._forward_of(value)
        value = unmark(value, f"logged as {name!r}")
        if isinstance(value, torch.Tensor) and value.is_meta:  # read from another stage's layer: no values here
            refuse_other_stages_values(self.module, self.body_path, f"self.log({name!r}, ...) got a tensor on the meta "
                                       "device")
        call = bind_log_call(name, value, *args, **kwargs)
        if isinstance(value, Metric):
            unmark(value._forward_cache, f"logged as {name!r}")
            call["value"] = ("metric", self._metric_paths[id(value)], _detach(value._forward_cache))
        else:
            call["value"] = _detach(value)
            call["source"] = value  # until mark_loss: is this the loss the step returns?
            if forward_of is not None:
                call["forward_of"] = forward_of
            count = self.count_of(value) if isinstance(value, torch.Tensor) else None
            if count is not None:
                call["count"] = float(count)
        self._calls[-1].append(call)

    def _forward_of(self, value: Any) -> Optional[str]:
        """The path of the Metric whose ``forward`` returned ``value`` in this microbatch (its value over the
        microbatch, ``self.log("acc", self.acc(logits, y))``), if any."""
        if not isinstance(value, torch.Tensor):
            return None
        for path in self._called[-1]:
            if self.module.get_submodule(path)._forward_cache is value:
                return path
        return None

    def mark_loss(self, loss: Optional[torch.Tensor]) -> None:
        """Mark the current microbatch's calls that log the loss its step returned (``loss`` or its value)."""
        for call in self._calls[-1] if self._calls else ():
            source = call.pop("source", None)
            call["is_loss"] = loss is not None and source is not None and _is_value_of(source, loss)

    def fold(self, sizes: Sequence[int], loss_weights: Optional[Sequence[float]] = None,
             on_step_by_default: bool = True) -> List[Dict[str, Any]]:
        """The calls for the whole batch: per name, one call for each call a microbatch made, in the
        order the names were first logged (a name logged twice in a step is replayed twice, as the
        step made it: Lightning's step value is the last call, its epoch value counts both).

        A name that logs the step's loss in every microbatch folds like the loss, whatever its
        ``reduce_fx``: its values weighted by ``loss_weights`` (summed when those are None: a
        summed loss), so that it logs the batch's loss as one step over the whole batch would.
        Other names fold with their ``reduce_fx``, a mean weighted by microbatch size or by the
        ``batch_size`` they log with (see :func:`_fold_one`). A torchmetrics ``Metric`` logged on
        step (``on_step``, by default ``on_step_by_default``) logs its value over the whole batch
        (see :meth:`_batch_value`).
        """
        by_name: Dict[Tuple[str, int], List[Tuple[int, int, Dict[str, Any]]]] = {}
        for i, (size, calls) in enumerate(zip(sizes, self._calls)):
            seen: Dict[str, int] = {}
            for call in calls:
                occurrence = seen[call["name"]] = seen.get(call["name"], -1) + 1
                by_name.setdefault((call["name"], occurrence), []).append((i, size, call))
        total = sum(sizes)
        folded = []
        for (name, _), entries in by_name.items():
            call, kind = _fold_one(entries, loss_weights, total, self._batch_size_kind.get(name))
            if kind is not None and len(entries) > 1:  # one microbatch cannot tell: its batch_size is the batch's
                self._batch_size_kind[name] = kind
            value = call["value"]
            forward_of = {c.get("forward_of") for _, _, c in entries}
            if len(forward_of) == 1 and None not in forward_of and (len(entries) > 1 or forward_of <= self._synced):
                # a Metric's value over each microbatch: one step over the batch logs its value over the batch,
                # which no fold of the microbatches' values gives (a macro average, an F1 score); and is synced
                # over the replicas where it syncs on step, whatever the number of microbatches
                batch_value = self._batch_value(forward_of.pop())
                if batch_value is not None and batch_value.shape == value.shape:
                    call["value"] = batch_value.to(value.device, value.dtype)
            if isinstance(value, tuple) and value and value[0] == "metric":
                if call["on_step"] if call["on_step"] is not None else on_step_by_default:
                    self._on_step.add(value[1])
                    batch_value = self._batch_value(value[1])
                    if batch_value is not None:
                        call["value"] = ("metric", value[1], batch_value)
                else:
                    self._off_step.add(value[1])
            folded.append(call)
        return folded

    def _batch_value(self, path: str) -> Any:
        """What the Metric at ``path`` gives over this step's microbatches together (None if it was not
        called once in every microbatch that ran the step, or gives no tensor: a metric called twice per step,
        on a source and a target batch, logs each call's value, which no state over the whole step gives).

        As torchmetrics' own ``forward`` computes a batch's value from a state updated with the batch
        alone: each call of the step also updated a step state (:meth:`_follow`), which is computed
        here, the metric's own state kept. Synced, as ``forward`` syncs under DDP, only where the metric has
        ``dist_sync_on_step`` (see :meth:`recording`): over its ``process_group``, the replicas of this stage
        (PipeStrategy sets it), which compute theirs here at the same point of the step.
        """
        if not self._called or any(called[path] != 1 for called in self._called) or path not in self._step_states:
            return None
        metric = self.module.get_submodule(path)
        kept = _state_of(metric)
        try:
            _set_state(metric, self._step_states[path])
            metric._to_sync = path in self._synced
            value = metric.compute()
        finally:
            _set_state(metric, kept)
        return value.detach().clone() if isinstance(value, torch.Tensor) else None


_METRIC_PRIVATE = ("_update_count", "_computed", "_forward_cache", "_to_sync", "_should_unsync", "_is_synced",
                   "_cache")  # what reset, update and compute change besides the states


def _state_of(metric: Any) -> tuple:
    """A Metric's states and the private attributes that go with them (the objects, not copies)."""
    return ({name: getattr(metric, name) for name in metric._defaults},
            {name: getattr(metric, name) for name in _METRIC_PRIVATE if hasattr(metric, name)})


def _set_state(metric: Any, state: tuple) -> None:
    for part in state:
        for name, value in part.items():
            setattr(metric, name, value)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    if isinstance(value, list):  # a list state (CatMetric's) grows in place: a copy, not the same list
        return [_detach(v) for v in value]
    return value


def _reduce(values: List[Any], sizes: List[int], reduce_fx: Any, by_samples: Optional[str] = None) -> Any:
    """Fold ``values`` weighted by ``sizes``; ``by_samples``: the logged name, where ``sizes`` are the
    microbatches' sizes (a mean NaN in some of them only is warned about)."""
    if values[0] is None:
        return None
    # fold on the CPU in float64: the values may live on a GPU, the weights are plain numbers
    stacked = torch.stack([torch.as_tensor(v).detach().to("cpu", torch.float64) for v in values])
    name = _name_of(reduce_fx)
    if by_samples is not None and name in _MEAN and len(values) > 1:
        _warn_if_empty_somewhere(by_samples, stacked)
        _warn_if_integers_differ(by_samples, values, stacked)
    if name in _MEAN and 0 in sizes and any(sizes):  # a microbatch that averaged over nothing (its mean 0/0, NaN)
        stacked = stacked[torch.tensor([size != 0 for size in sizes])]  # adds nothing to the batch's mean
        sizes = [size for size in sizes if size != 0]
    if name in _MEAN:
        weights = torch.tensor(sizes, dtype=torch.float64).reshape(-1, *([1] * (stacked.dim() - 1)))
        folded = (stacked * weights).sum(0) / weights.sum()
    elif name == "sum":
        folded = stacked.sum(0)
    elif name == "max":
        folded = stacked.max(0).values
    elif name == "min":
        folded = stacked.min(0).values
    elif isinstance(reduce_fx, str):  # Lightning refuses the call the same way
        raise ConfigurationError(f"only self.log(..., reduce_fx={{min,max,mean,sum}}) are supported, got {reduce_fx!r}")
    else:
        folded = reduce_fx(stacked)
    first = values[0]
    return folded.to(first.device, first.dtype) if isinstance(first, torch.Tensor) else folded.item()


def _is_value_of(source: Any, loss: torch.Tensor) -> bool:
    if isinstance(source, torch.Tensor):
        return source is loss or (source.numel() == 1 and source.dtype == loss.dtype
                                  and source.device == loss.device and source.data_ptr() == loss.data_ptr())
    return isinstance(source, (int, float)) and not isinstance(source, bool) and source == loss.item()


def _fold_one(entries: List[Tuple[int, int, Dict[str, Any]]], loss_weights: Optional[Sequence[float]],
              total: int, kind_before: Optional[str] = None) -> Tuple[Dict[str, Any], Optional[str]]:
    """One call from a name's calls in several microbatches (``total``: the batch's size), and what the
    ``batch_size`` they give is (None when they give none).

    A value that is a mean-reduced ``cross_entropy``/``nll_loss`` output in every call, logged
    without ``batch_size``, is weighted by the targets each averaged over (:class:`.losses.MeanTargets`).
    A ``batch_size`` given with the calls is one of three kinds:

    - ``"counted"``: a count per microbatch (tokens, items kept), shown by numbers that differ
      between the microbatches of this step or an earlier one. The counts weigh the values, and
      the folded call logs their sum, the batch's count.
    - ``"batch"``: the batch's number, which every microbatch passes alike
      (``batch_size=self.hparams.batch_size``): equal in every call, and equal to the batch's size
      or given by microbatches whose sizes differ. The microbatch sizes weigh the values, and the
      folded call logs the number, as one step over the batch does.
    - ``"summed"``: equal in every call of a first step that cannot tell the two apart (microbatches
      of one size; ``len(x)`` in each, or equal token counts): the folded call logs the sum, the
      batch's count. Later steps keep logging the sum of the numbers given, even one whose sizes
      differ (which then weigh the values), so that a constant taken for a count at first still
      weighs every step of the epoch alike.

    ``kind_before``: the kind an earlier step showed; a kind once seen is kept, except that numbers
    that differ make a count of it for good.
    """
    sizes = [size for _, size, _ in entries]
    calls = [call for _, _, call in entries]
    folded = {k: v for k, v in calls[-1].items() if k not in ("is_loss", "source", "count", "forward_of")}
    given = [c["batch_size"] for c in calls]
    kind = None
    by_samples = True  # weighted by the microbatches' sizes, for want of a count
    if given[-1] is not None:
        if kind_before == "counted" or any(bool(g != given[0]) for g in given):
            kind = "counted"
        elif kind_before is not None:
            kind = kind_before
        else:
            kind = "batch" if given[0] == total or len(set(sizes)) > 1 else "summed"
        if kind != "batch":
            folded["batch_size"] = sum(given)
        if kind == "counted":
            sizes, by_samples = given, False
    value = calls[-1]["value"]
    reduce_fx = calls[-1]["reduce_fx"]
    if all(c.get("is_loss") for c in calls):
        reduce_fx = "sum" if loss_weights is None else "mean"
        sizes = sizes if loss_weights is None else [loss_weights[i] for i, _, _ in entries]
        by_samples = False
    elif given[-1] is None and all("count" in c for c in calls) and _name_of(reduce_fx) in _MEAN:
        sizes = [c["count"] for c in calls]  # a cross_entropy mean: over the targets it counted, as over the batch
        by_samples = False
    if isinstance(value, tuple) and value and value[0] == "metric":
        forward = _reduce([c["value"][2] for c in calls], sizes, "mean")
        folded["value"] = ("metric", value[1], forward)
    elif isinstance(value, (torch.Tensor, int, float)):
        folded["value"] = _reduce([c["value"] for c in calls], sizes, reduce_fx,
                                  folded["name"] if by_samples else None)
    return folded, kind


def _warn_if_empty_somewhere(name: str, stacked: torch.Tensor) -> None:
    """Warn when a size-weighted mean is NaN because some microbatches' values were and others' were not
    (``stacked``: the values, one row per microbatch, on the CPU).

    The usual cause is a mean over a selection that was empty in a microbatch (``acc[labels != -100].mean()``
    over padding only: 0/0), which one step over the whole batch computes over all its samples. The fold cannot
    tell the selection's size; the user can give it, and a count of 0 then adds nothing (see :func:`_reduce`).
    """
    nan = stacked.isnan().reshape(len(stacked), -1).any(1)
    if not nan.any() or nan.all():
        return
    warnings.warn(
        f"PipeStrategy: self.log('{name}', ...) was NaN in some microbatches of a step and a number in the others, "
        "so the batch's value, their mean weighted by microbatch size, is NaN. If it is a mean over a selection "
        "that was empty in a microbatch (e.g. `acc[labels != -100].mean()` over a microbatch of padding only), one "
        "step over the whole batch computes it over all its samples at once and logs a number: log it with the "
        "selection's size, `self.log(..., batch_size=count)`, so that the microbatches are weighted by it and an "
        "empty one counts for nothing"
    )


def _is_integer(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return isinstance(value, int) and not isinstance(value, bool)


def _warn_if_integers_differ(name: str, values: List[Any], stacked: torch.Tensor) -> None:
    """Warn when integers that differ between the microbatches fold as a size-weighted mean: right for a mean
    over samples only, which integers rarely are; a count (``(pred == y).sum()``, ``mask.sum()``) or a maximum
    over the batch is its own value over the whole batch, which the fold cannot compute."""
    if not all(map(_is_integer, values)) or bool((stacked == stacked[0]).all()):
        return
    warnings.warn(
        f"PipeStrategy: self.log('{name}', ...) logged integers that differ between the microbatches of a step; "
        "they fold as a mean weighted by microbatch size, which is the batch's value only for a mean over its "
        "samples. A count (`(pred == y).sum()`, `mask.sum()`) or a maximum over the batch is not: one step over "
        "the whole batch logs the batch's count (here about num_microbatches times the folded value). Return it "
        "from the step (`return {'loss': loss, 'correct': correct}`: integers in the step's output are summed "
        "as counts) and log `outputs['correct']` in on_train_batch_end, or log a mean (`correct / len(y)`)"
    )


def _name_of(reduce_fx: Any) -> str:
    """``reduce_fx``'s name, lower case as Lightning reads it (``"Mean"`` and ``"AVG"`` are a mean)."""
    return reduce_fx.lower() if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")


def metric_states(module: nn.Module, body_path: str) -> Dict[str, Dict[str, Any]]:
    """The states of every Metric outside the body, to mirror onto the other stages."""
    out = {}
    for path in metric_paths(module, body_path).values():
        metric = module.get_submodule(path)
        state = {name: _detach(getattr(metric, name)) for name in metric._defaults}
        state["_update_count"] = metric._update_count
        out[path] = state
    return out


def load_metric_states(module: nn.Module, states: Dict[str, Dict[str, Any]],
                       device: Optional[torch.device] = None) -> None:
    """Put :func:`metric_states`' ``states`` into the module's Metrics, on ``device`` (None: where they are)."""
    def place(value: torch.Tensor) -> torch.Tensor:
        return value if device is None else value.to(device)

    for path, state in states.items():
        metric = module.get_submodule(path)
        for name, value in state.items():
            if name == "_update_count":
                metric._update_count = value
            elif isinstance(value, list):
                setattr(metric, name, [place(v) for v in value])
            else:
                setattr(metric, name, place(value))
        metric._computed = None


def replay(module: nn.Module, calls: List[Dict[str, Any]], device: torch.device) -> None:
    """Log the folded calls on this rank with Lightning's own ``LightningModule.log``."""
    for call in calls:
        call = dict(call)
        value = call.pop("value")
        if isinstance(value, tuple) and value and value[0] == "metric":
            metric = module.get_submodule(value[1])
            metric._forward_cache = value[2].to(device) if isinstance(value[2], torch.Tensor) else value[2]
            value = metric
        elif isinstance(value, torch.Tensor):
            value = value.to(device)
        elif isinstance(value, dict):
            value = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in value.items()}
        module.log(call.pop("name"), value, **call)


_GRAD_NORM = re.compile(r"^grad_(?P<norm>[0-9.]+|inf)_norm(?:(?P<total>_total)|.(?P<parameter>.+))$")


def combine_stages(per_stage: Sequence[List[Dict[str, Any]]], canonical: Dict[str, str],
                   order: Sequence[str]) -> Tuple[List[Dict[str, Any]], List[str]]:
    """One list of log calls from the calls every stage made in the same hook (stage order).

    Lightning's ``grad_norm`` logs are made whole-model: a parameter's entry comes from the stage
    that holds it (under its canonical name, once for tied copies) and ``grad_<p>_norm_total`` is
    recomputed over all of them as ``grad_norm`` computes it on one device. Any other name keeps
    its value when every stage that logged it agrees, and takes the last stage's otherwise.

    Returns:
        The calls, and the names whose stages disagreed.
    """
    calls: Dict[str, Dict[str, Any]] = {}
    values: Dict[str, List[Any]] = {}
    norms: Dict[str, Dict[str, Any]] = {}
    totals: Dict[str, Dict[str, Any]] = {}
    for stage_calls in per_stage:
        for call in stage_calls:
            call = {k: v for k, v in call.items() if k not in ("is_loss", "source")}
            match = _GRAD_NORM.match(call["name"])
            if match and match["total"]:
                totals.setdefault(match["norm"], call)
                continue
            if match and match["parameter"] in canonical or match and match["parameter"] in order:
                parameter = canonical.get(match["parameter"], match["parameter"])
                call["name"] = call["name"][: len(call["name"]) - len(match["parameter"])] + parameter
                norms.setdefault(match["norm"], {})[parameter] = call["value"]
            calls[call["name"]] = call  # the last stage's call wins
            values.setdefault(call["name"], []).append(call["value"])
    disagree = [name for name, vs in values.items() if any(not _equal(v, vs[0]) for v in vs[1:])]
    for norm, call in totals.items():
        by_parameter = norms.get(norm, {})
        entries = [by_parameter[n] for n in order if n in by_parameter]
        call = dict(call)
        # as grad_norm computes it: the norm of the per-parameter norms, in the unsplit model's order
        call["value"] = torch.stack([torch.as_tensor(v) for v in entries]).norm(float(norm)) if entries else call["value"]
        calls[call["name"]] = call
    return list(calls.values()), disagree


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu())
    return a == b
