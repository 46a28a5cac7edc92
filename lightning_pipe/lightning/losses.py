"""How the microbatches' losses and results combine into the batch's, as one step over the batch would.

The rule, stated once (PipeStrategy's docstring and README repeat it):

- ``loss_reduction="mean"`` (default): the step's loss is a mean over the samples of its batch.
  The batch's loss is the microbatch losses' mean weighted by microbatch size. If the loss is a
  mean over something else (tokens under a padding mask, pixels), the step says over how many by
  returning ``{"loss": loss, "num_items": count}``; the weights are then those counts, and as the
  total is known only once the last microbatch ran, the step's gradients are divided by it at the
  end of the step on every stage.
- ``loss_reduction="sum"``: the step's loss is a sum over samples; the batch's loss is the sum.

A step that returns the output of ``torch.nn.functional.cross_entropy`` or ``nll_loss`` itself
(reduction ``"mean"``, class-index targets: a language model's loss with ``ignore_index``, a
Hugging Face model's ``outputs.loss``) averages over the targets that are not ignored, weighted
by ``weight`` where given: :class:`MeanTargets` counts them, and that count is its ``num_items``
unless the step gives one. A loss computed *from* such a call (``ce + aux``) whose targets include
ignored ones is left to the rule above, with a warning.

Other results of the step (``on_train_batch_end``'s ``outputs``) merge the same way: tensors whose
rows follow the samples are concatenated (a 0-dim tensor from a one-sample microbatch counts as a
row), lists joined, numbers and 0-dim tensors combined like the loss (``num_items`` and other
integers summed, as counts, an index kept), anything else (a per-batch tensor such as a confusion matrix, with a warning) kept as a list with
one value per microbatch; :func:`merge` gives the rules.
"""

from __future__ import annotations

import inspect
import math
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F

from lightning_pipe.errors import ConfigurationError

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
    np = None

LOSS_REDUCTIONS = ("mean", "sum")


def loss_of(output: Any, hook: str, required: bool = True) -> Optional[torch.Tensor]:
    """The loss in a step's result: the tensor itself or its ``"loss"`` entry.

    Raises:
        ConfigurationError: ``required`` (a training step) and the loss, computed with gradients enabled,
            does not require grad (DDP's backward would fail on it; the pipeline would step on no gradient).
    """
    loss = output.get("loss") if isinstance(output, dict) else output
    if isinstance(loss, torch.Tensor):
        if required and torch.is_grad_enabled() and not loss.requires_grad:
            what = "a dict whose 'loss' is a tensor" if isinstance(output, dict) else "a tensor"
            raise ConfigurationError(
                f"{hook} returned {what} that does not require grad (shape {tuple(loss.shape)}, "
                f"grad_fn={loss.grad_fn}): it does not depend on any trainable parameter, e.g. a constant like "
                "`torch.zeros(())` or a `.detach()`ed loss. Lightning's DDP fails on it in backward ('element 0 of "
                "tensors does not require grad'), and PipeStrategy would take an optimizer step on no gradient. Return "
                "the loss computed from the model's output; to skip a batch, return `loss * 0` (or mask its samples)"
            )
        return loss
    if required:
        raise ConfigurationError(
            f"under PipeStrategy, {hook} must return the loss (a tensor, or a dict with 'loss') for every "
            f"microbatch, got {type(output).__name__}; skipping a batch by returning None is not supported"
        )
    return None


class MeanTargets:
    """The number of targets each mean-reduced ``cross_entropy``/``nll_loss`` call of a step averaged over.

    While :meth:`watching`, the two functions of ``torch.nn.functional`` are wrapped: torch has no
    hook on one function (a ``TorchFunctionMode`` would run Python for every op of the step), and
    ``nn.CrossEntropyLoss``, Hugging Face's losses and ``F.cross_entropy`` in user code all look the
    function up there when they call it. Code that bound it earlier (``from torch.nn.functional
    import cross_entropy``) is not seen: its loss follows the microbatch-size rule.

    It also notes the reduction of each call whose output is one value, so that a step returning
    a summed loss under ``loss_reduction="mean"`` (or a mean one under ``"sum"``) is refused rather
    than scaled by the number of microbatches (:meth:`reduction_of`).

    Example:
        >>> targets = MeanTargets()
        >>> with targets.watching():
        ...     loss = F.cross_entropy(torch.zeros(4, 3), torch.tensor([0, 2, -100, 1]))
        ...     total = F.cross_entropy(torch.zeros(4, 3), torch.tensor([0, 2, -100, 1]), reduction="sum")
        >>> targets.count_of(loss), targets.count_of(loss * 1), targets.ignored_some()
        (tensor(3), None, True)
        >>> targets.reduction_of(loss), targets.reduction_of(total), targets.reduction_of(total / 3)
        ('mean', 'sum', None)
    """

    def __init__(self) -> None:
        # by the output's data pointer: (the output, its count, its version then, the targets kept)
        self._seen: Dict[int, Tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]] = {}
        self._reductions: Dict[int, Tuple[torch.Tensor, str, int]] = {}  # the same, for every call giving one value
        self._wrapped: Dict[Callable, Callable] = {}  # made once: a signature is slow to read

    @contextmanager
    def watching(self) -> Iterator[None]:
        self._seen, self._reductions = {}, {}
        originals = F.cross_entropy, F.nll_loss
        F.cross_entropy, F.nll_loss = (self._wrapped.get(f) or self._wrapped.setdefault(f, self._wrap(f))
                                       for f in originals)
        try:
            yield
        finally:
            F.cross_entropy, F.nll_loss = originals

    def _wrap(self, function: Callable) -> Callable:
        # both functions: (input, target, weight, size_average, ignore_index, reduce, reduction[, label_smoothing])
        names = list(inspect.signature(function).parameters)
        defaults = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean"}

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = function(*args, **kwargs)
            if torch.compiler.is_compiling():  # traced by torch.compile: no tensor to count yet, and nothing to see
                return out
            a = {**defaults, **dict(zip(names, args)), **kwargs}  # not inspect's bind: 5 times slower
            target, weight, reduction = a.get("target"), a["weight"], a["reduction"]
            if a["size_average"] is not None or a["reduce"] is not None or reduction not in ("mean", "sum") \
                    or not isinstance(out, torch.Tensor) or out.dim() != 0:
                return out
            # kept (without its graph) so that its memory is not reused while it is looked up by address
            noted, version = out.detach(), _version_of(out)
            self._reductions[out.data_ptr()] = (noted, reduction, version)
            if reduction == "mean" and isinstance(target, torch.Tensor) and not target.is_floating_point() \
                    and not target.is_complex():
                with torch.no_grad():
                    kept = target != a["ignore_index"]
                    count = kept.sum() if weight is None else weight[target[kept]].sum()
                self._seen[out.data_ptr()] = (noted, count, version, kept)
            return out

        counted.__wrapped__ = function  # type: ignore[attr-defined]
        return counted

    def count_of(self, loss: torch.Tensor) -> Optional[torch.Tensor]:
        """The count ``loss`` averaged over, if it is a watched call's output itself.

        Told by memory, not by object: the step's result may come back as another tensor object over the
        same value (a subclass made plain again, a view); the outputs are kept, so their memory is not reused.
        """
        return _noted(self._seen, loss)

    def reduction_of(self, loss: torch.Tensor) -> Optional[str]:
        """``"mean"`` or ``"sum"``: the reduction of the watched call whose output ``loss`` is itself (told by
        memory, as in :meth:`count_of`); None for any other value."""
        return _noted(self._reductions, loss)

    def ignored_some(self) -> bool:
        """Whether a watched call of the step left out some targets (``ignore_index``)."""
        return any(not bool(entry[3].all()) for entry in self._seen.values())


def _noted(table: Dict[int, tuple], loss: torch.Tensor) -> Any:
    """What ``table`` noted about the watched call whose output ``loss`` is, unchanged since (``(output, what,
    version)``, by the output's data pointer); None for any other value, or one written in place since
    (``loss /= n`` after a summed cross entropy: the same memory, another value)."""
    seen = table.get(loss.data_ptr()) if loss.device.type != "meta" else None
    if seen is None or seen[0].shape != loss.shape or seen[0].dtype != loss.dtype or _version_of(seen[0]) != seen[2]:
        return None
    return seen[1]


def _version_of(tensor: torch.Tensor) -> Optional[int]:
    """Its version counter (shared with its ``detach()``); None under inference mode, which keeps none."""
    return None if tensor.is_inference() else tensor._version


class LossAccount:
    """The microbatch losses of one step on the last stage.

    Args:
        sizes: the microbatch sizes.
        reduction: ``"mean"`` or ``"sum"``.
    """

    def __init__(self, sizes: Sequence[int], reduction: str) -> None:
        self.sizes = list(sizes)
        self.reduction = reduction
        self.items: Dict[int, Optional[float]] = {}
        self.extras: Dict[int, Dict[str, Any]] = {}
        self._reference: Optional[float] = None  # see add: the first count with items, times the microbatches

    def add(self, i: int, loss: torch.Tensor, output: Any, counted: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Note microbatch ``i``'s result; return what its backward starts from.

        ``counted``: the targets a mean-reduced loss averaged over (:class:`MeanTargets`), taken as
        its ``num_items`` when the step gives none.
        """
        items = _items(output)
        if items is None and counted is not None and self.reduction == "mean":
            items = _items({"num_items": counted})
        if self.items and (items is None) != (next(iter(self.items.values())) is None):
            raise ConfigurationError(
                "the step returned 'num_items' for some microbatches and not for others, or returned the output of "
                "cross_entropy/nll_loss itself for some (which counts its targets) and a value computed otherwise for "
                "others; return 'num_items' every time (the number of items, e.g. tokens, that its loss averages over)"
            )
        if items is not None and self.reduction == "sum":
            raise ConfigurationError(
                "the step returned 'num_items' under PipeStrategy(loss_reduction='sum'): a summed loss needs no count. "
                "Drop 'num_items', or use loss_reduction='mean' for a loss averaged over num_items items"
            )
        self.items[i] = items
        if isinstance(output, dict):
            self.extras[i] = {k: _detached(v) for k, v in output.items() if k != "loss"}
        loss = loss.reshape(()) if loss.dim() else loss
        if self.reduction == "sum":
            return loss
        if items is None:
            return loss * (self.sizes[i] / sum(self.sizes))
        if items == 0:  # its loss is 0/0; it adds nothing, and its backward must not spread NaN
            return torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
        # Weighted by items / reference, the total (unknown until the last microbatch) divided by the reference
        # at the end: the backward runs near the scale one step over the batch gives it (exactly, with one
        # microbatch or equal counts), which matters where a model computes in float32 inside a float64 run.
        if self._reference is None:
            self._reference = items * len(self.sizes)
        return loss * (items / self._reference)

    @property
    def counts_items(self) -> bool:
        return any(v is not None for v in self.items.values())

    def normalizer(self) -> Optional[float]:
        """What the step's summed losses and gradients are divided by at its end (the total count over the
        reference :meth:`add` scaled by), or None when the step counts no items (nothing to divide)."""
        if not self.counts_items:
            return None
        total = sum(self.items.values())
        if total <= 0:
            raise ConfigurationError(
                f"the step's 'num_items' add up to {total} over the batch; the loss averages over no item"
            )
        return total / self._reference

    def log_weights(self) -> Optional[List[float]]:
        """Per microbatch, the weight of its loss in the batch's mean (None: summed)."""
        if self.reduction == "sum":
            return None
        if self.counts_items:
            return [self.items[i] for i in range(len(self.sizes))]
        return [float(s) for s in self.sizes]

    def merged_extras(self, shapes: Optional["Shapes"] = None) -> Dict[str, Any]:
        """The step's other results, merged over the microbatches (``shapes``: see :func:`merge`)."""
        if not self.extras:
            return {}
        return merge([self.extras[i] for i in sorted(self.extras)], self.log_weights(),
                     [self.sizes[i] for i in sorted(self.extras)], shapes=shapes)


def _items(output: Any) -> Optional[float]:
    if not isinstance(output, dict) or "num_items" not in output:
        return None
    value = output["num_items"]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype == torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigurationError(
            f"the step's 'num_items' must be a non-negative number (or one-element tensor), got {value!r}; it counts "
            "the items (e.g. tokens) its loss averages over"
        )
    return float(value)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


class Shapes:
    """What earlier batches showed about one hook's results, by key path (see :func:`merge`)."""

    def __init__(self) -> None:
        self.per_sample: Set[str] = set()  # joined with one row per sample
        self.first_size: Dict[str, int] = {}  # the first dimension's size seen first
        self.varied: Set[str] = set()  # first dimensions that differed (between microbatches or batches): rows
        self.not_batched: Set[str] = set()  # one unvaried shape from microbatches of different sizes
        self.warned: Set[str] = set()
        self.indices: Set[int] = set()  # this step's batch_idx, dataloader_idx and global step (see counts)

    def rows(self, key: str, values: List[torch.Tensor], sizes: Sequence[int]) -> bool:
        """Whether ``values`` (each with a dimension, none with one row per sample) are rows of the batch: not
        where one shape came from microbatches of different sizes and the key's first size never varied (a
        mean over the batch, a confusion matrix); an empty selection is rows."""
        firsts = {v.shape[0] for v in values}
        if len(firsts) > 1 or 0 in firsts or firsts != {self.first_size.setdefault(key, min(firsts))}:
            self.varied.add(key)
        if key not in self.varied and len({v.shape for v in values}) == 1 and len(set(sizes)) > 1:
            self.not_batched.add(key)
        return key in self.varied or key not in self.not_batched

    def counts(self, values: List[Any]) -> bool:
        """Whether integers the step returned (one per microbatch) count something per microbatch, their sum
        the batch's (correct predictions, ``len(y)``), rather than an index one step returns as it is.

        An index is a plain int equal in every microbatch to one the step knows (:attr:`indices`: its
        ``batch_idx``, ``dataloader_idx`` or the global step); anything else counts. Equal counts cannot
        be told from a setting by their values, so only known indices are kept; integer tensors always
        count (no device sync to read them).
        """
        first = values[0]
        return not (type(first) is int and first in self.indices and all(v == first for v in values))


def merge(values: List[Any], weights: Optional[Sequence[float]], sizes: Sequence[int], key: str = "",
          predictions: bool = False, shapes: Optional[Shapes] = None) -> Any:
    """Merge per-microbatch values into the batch's (``weights`` None: numbers are summed; ``sizes``: the
    microbatches' sizes; ``key``: the values' path in the result).

    Tensors with dimensions are concatenated: rows per sample (a 0-dim tensor counts as the row of a
    one-sample microbatch: ``out.squeeze()``), or rows that follow the samples (``logits.view(-1, V)``,
    a masked selection). Tensors of one shape from microbatches of different sizes, under a key whose
    first size never varied, are no rows of the batch (``logits.mean(0)``, a confusion matrix, which
    one step computes over the whole batch): they come as a list with one per microbatch, with a
    warning, then and in later steps until the first size varies (``shapes``, which this call
    updates); so do per-sample tensors whose other sizes differ (``generate``'s outputs of each
    microbatch's own length), which one step pads its own way. 0-dim tensors from microbatches of
    one sample each are stacked as rows, not combined like numbers, for ``predictions``
    (``predict_step``'s, which has no loss to average; not under a key ``loss``) and where an
    earlier batch's values under the key were joined per sample (a short last batch); otherwise
    they cannot be told from a per-batch number, and a key other than ``loss`` gets a warning.
    One value is returned as it is.

    Example:
        >>> merge([{"preds": torch.zeros(2), "acc": 1.0}, {"preds": torch.ones(1), "acc": 0.0}], [2, 1], [2, 1])
        {'preds': tensor([0., 0., 1.]), 'acc': 0.6666666666666666}
        >>> merge([(torch.zeros(2), ("a", "b")), (torch.ones(1), ("c",))], [2, 1], [2, 1])
        (tensor([0., 0., 1.]), ('a', 'b', 'c'))
        >>> merge([torch.zeros(2), torch.tensor(1.0)], [2, 1], [2, 1])  # the second squeezed from one sample
        tensor([0., 0., 1.])
    """
    if len(values) == 1:
        return values[0]
    shapes = shapes if shapes is not None else Shapes()
    first = values[0]
    if all(v is None for v in values):
        return None
    if isinstance(first, dict) and all(isinstance(v, dict) and v.keys() == first.keys() for v in values):
        return {k: merge([v[k] for v in values], weights, sizes, f"{key}.{k}" if key else str(k), predictions, shapes)
                for k in first}
    tensors = all(isinstance(v, torch.Tensor) for v in values)
    if tensors and any(v.dim() > 0 for v in values):
        same_rest = all(v.shape[1:] == values[-1].shape[1:] for v in values)
        if all(v.shape[0] == n if v.dim() > 0 else n == 1 for v, n in zip(values, sizes)):
            shapes.per_sample.add(key)
            if same_rest:
                return torch.cat([v.reshape(1) if v.dim() == 0 else v for v in values])
        elif all(v.dim() > 0 for v in values) and shapes.rows(key, values, sizes) and same_rest:
            return torch.cat(values)
        if key not in shapes.warned:
            shapes.warned.add(key)
            warnings.warn(
                f"the step returned tensors{f' under {key!r}' if key else ''} of shapes "
                f"{[tuple(v.shape) for v in values]} from microbatches of {list(sizes)} samples: not rows of the "
                "batch, or rows of different lengths, so they cannot be joined into the batch's value (one step over "
                "the batch computes or pads it its own way, which PipeStrategy cannot), and on_*_batch_end and the "
                "predictions get a list with one per microbatch. Return per-sample values of one shape or numbers, or "
                "compute such a value in an epoch-end hook", stacklevel=2)
        return list(values)
    if tensors and all(n == 1 for n in sizes) and all(v.dim() == 0 for v in values):
        name = key.rpartition(".")[2]
        if predictions and name != "loss" or key in shapes.per_sample:
            return torch.stack(values)
        if key and name not in ("loss", "num_items") and key not in shapes.warned:
            shapes.warned.add(key)
            warnings.warn(
                f"the step returned 0-dim tensors under {key!r} from microbatches of one sample each, which cannot be "
                "told from per-batch numbers: they are combined like the loss (a mean; integers summed, as counts). "
                "If they are per-sample values (`out.squeeze()` of one sample), return them with their batch "
                "dimension (`squeeze(-1)`)", stacklevel=2)
    if all(_is_number(v) for v in values):
        if all(_is_integer(v) for v in values):
            return sum(values[1:], values[0]) if key.rpartition(".")[2] == "num_items" or shapes.counts(values) \
                else first
        if key.rpartition(".")[2] == "num_items" or weights is None:
            return _combine(values, [1.0] * len(values), normalize=False)
        return _combine(values, weights, normalize=True)
    if all(isinstance(v, list) for v in values):
        return [x for v in values for x in v]
    if all(type(v) is tuple for v in values):
        if all(isinstance(x, (str, bytes)) for v in values for x in v):  # per-sample strings, as default_collate makes
            return tuple(x for v in values for x in v)
        if all(len(v) == len(first) for v in values):  # a step returning (predictions, targets)
            return tuple(merge([v[i] for v in values], weights, sizes, f"{key}[{i}]", predictions, shapes)
                         for i in range(len(first)))
    if all(isinstance(v, (str, bytes, bool)) and v == first for v in values):  # a constant ("v1", a flag): as one step
        return first
    arrays = np is not None and all(isinstance(v, np.ndarray) and v.ndim > 0 for v in values)
    if arrays and all(v.shape[0] == n and v.shape[1:] == first.shape[1:] for v, n in zip(values, sizes)):
        return np.concatenate(values)  # per-sample rows, as a `.numpy()` of the output
    return list(values)


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return isinstance(value, int) and not isinstance(value, bool)


def _combine(values: List[Any], weights: Sequence[float], normalize: bool) -> Any:
    if normalize and 0 in weights and any(weights):  # a microbatch that averaged over no item (0/0, NaN) adds nothing
        values, weights = [v for v, w in zip(values, weights) if w != 0], [w for w in weights if w != 0]
    total = sum(weights) if normalize else 1.0
    tensor = next((v for v in values if isinstance(v, torch.Tensor)), None)
    if tensor is not None:  # a number among tensors (`acc if n else 0.0`) joins them
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=tensor.device) for v in values])
        weight = torch.tensor(list(weights), dtype=torch.float64, device=stacked.device)
        return ((stacked * weight).sum() / total).to(tensor.dtype)
    return sum(v * w for v, w in zip(values, weights)) / total
