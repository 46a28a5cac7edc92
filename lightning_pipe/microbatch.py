"""Splitting a batch into microbatches and merging outputs back.

Any pytree (tuples, lists, dicts, namedtuples) of tensors is split along ``batch_dim``. The rules,
with ``B`` the size of the batch dimension that every splittable tensor shares:

- a tensor with at least one dimension is split along ``batch_dim``;
- a *per-sample sequence* is split like the tensors: a ``list`` of exactly ``B`` elements that are
  all strings, bytes, numbers (``int``, ``float``, ``complex``, ``bool``) or ``None``; or a plain
  ``tuple`` (not a namedtuple) of exactly ``B`` strings or bytes, which is what ``default_collate``
  makes of per-sample strings (file names, captions, ids);
- everything else is given whole to every microbatch: 0-dim tensors, tensors wrapped in
  :class:`NoChunk`, other non-tensor leaves, lists and tuples of another length, and tuples of
  numbers (use a tuple for per-batch numeric constants whose length may happen to equal ``B``).
  Each microbatch after the first gets its own copy of a 0-dim tensor, made before any of them
  runs (except where a slice would stay a view, below): a write into it is then made once per
  microbatch on the value one process would write into, not once more on each microbatch's result.

Two containers torch's pytree does not open are opened too, and rebuilt as their own type in each
microbatch: dataclasses (through ``dataclasses.replace``, so ``__post_init__`` runs for each
microbatch; one whose ``__post_init__`` changes the values it is given again is refused) and
``collections.UserDict`` subclasses such as Hugging Face's ``BatchEncoding`` (its items split by
the rules above; an attribute that is a list of exactly ``B`` objects, such as a fast tokenizer's
per-sample ``encodings``, split per sample; other attributes kept). Such containers without
tensors reach every microbatch whole.
Other containers (other ``Mapping`` types, objects carrying tensors as attributes, a dataclass
holding tensors in fields its ``__init__`` does not take) are refused with a
:class:`~lightning_pipe.errors.ConfigurationError` naming the type when they hold tensors, rather
than given whole to every microbatch: convert them to a dict, tuple or namedtuple in the
``collate_fn`` (or in ``LightningModule.on_before_batch_transfer``).

``torch.tensor_split`` decides the sizes, so 10 samples in 4 microbatches are 3, 3, 2, 2, and a
batch smaller than the requested number of microbatches gives one microbatch per sample. A slice
shares the batch's memory but counts its own writes (its own version counter), so a stage or
criterion that writes into its microbatch in place trains as one process writing into the batch
once; except where that would hide a write from autograd or from a gradient: slices of a tensor
that requires grad, of an inference tensor or a tensor subclass, of a tensor whose rows overlap
(``expand``, ``unfold``), and of tensors whose memory another tensor of the batch uses
(``tokens[:, :-1]`` and ``tokens[:, 1:]``) stay views, which share their tensor's counter. (A
``detach()`` of a tensor still in a graph shares its counter with it, which cannot be told here.)
The same tensor given twice gets the same slices in both places. A :class:`NoChunk` tensor is the
same object in every microbatch.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import UserDict
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
# torch's pytree helpers are private but stable and used throughout torch.distributed; a public
# replacement (optree) would be one more dependency for the same few calls.
from torch.utils._pytree import SUPPORTED_NODES, register_pytree_node, tree_flatten, tree_map, tree_unflatten

from lightning_pipe.errors import ConfigurationError


class NoChunk:
    """Wrap a tensor so that every microbatch gets all of it instead of a slice.

    Example:
        >>> mask = torch.ones(3)
        >>> [m[1].shape for m in scatter((torch.zeros(4, 2), NoChunk(mask)), chunks=2)]
        [torch.Size([3]), torch.Size([3])]
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"NoChunk wraps a tensor, got {type(tensor).__name__}")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"NoChunk({self.tensor!r})"


SCALARS = (str, bytes, int, float, complex, bool, type(None))


def is_sample_list(value: Any, batch_size: int) -> bool:
    """Whether ``value`` is a per-sample sequence of a batch of ``batch_size`` (see the module docstring)."""
    if type(value) is tuple:
        return len(value) == batch_size > 0 and all(isinstance(v, (str, bytes)) for v in value)
    return isinstance(value, list) and len(value) == batch_size > 0 and all(isinstance(v, SCALARS) for v in value)


class _Samples:
    """A per-sample attribute of an opened ``UserDict`` (a list of the batch's length): split, not opened."""

    __slots__ = ("items",)

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items


class _Layout:
    """How an opened container is rebuilt from its values. Layouts compare equal for containers of one type with
    the same keys, so that microbatches and steps of one batch structure share a tree spec.

    ``template`` is the container itself (its other attributes are kept), or None in a layout that only
    describes (the pipeline's cached signature of a step's inputs, which must not keep a batch alive).
    """

    __slots__ = ("kind", "template", "keys", "attributes")

    def __init__(self, template: Any, keys: tuple, attributes: tuple, keep: bool = True) -> None:
        self.kind, self.template = type(template), template if keep else None
        self.keys, self.attributes = keys, attributes

    def _key(self) -> tuple:
        return self.kind, self.keys, self.attributes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"{self.kind.__qualname__}{list(self.keys + self.attributes)}"

    def rebuild(self, values: Sequence[Any]) -> Any:
        named = dict(zip(self.keys, values))
        if dataclasses.is_dataclass(self.template):
            return dataclasses.replace(self.template, **named)
        container = copy.copy(self.template)  # UserDict's own copy: other attributes kept, its dict a new one
        container.data = named
        for name, samples in zip(self.attributes, values[len(self.keys):]):
            setattr(container, name, samples.items)
        return container


class _Opened:
    """A dataclass or ``UserDict`` in a batch, opened for torch's pytree (registered below): its values are the
    node's children, so the split reaches the tensors inside, and unflattening rebuilds the original type."""

    __slots__ = ("values", "layout")

    def __init__(self, values: list, layout: _Layout) -> None:
        self.values, self.layout = values, layout


register_pytree_node(_Opened, lambda node: (node.values, node.layout),
                     lambda values, layout: layout.rebuild(list(values)))


def _holds_tensor(value: Any) -> bool:
    """Whether ``value`` holds a tensor anywhere, inside containers pytree does not open included."""
    for leaf in tree_flatten(value, is_leaf=_closed)[0]:
        if isinstance(leaf, (torch.Tensor, NoChunk)):
            return True
        contents = _opaque_contents(leaf) if _closed(leaf) else None
        if contents and _holds_tensor(list(contents.values())):
            return True
    return False


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a plain equality (a NumPy array): not the same
        return False


def _rebuildable(leaf: Any, keys: tuple) -> None:
    """Refuse a dataclass whose ``__init__`` cannot rebuild it from its own field values, or whose
    ``__post_init__`` changes them (each microbatch would be changed a second time)."""
    name = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
    fix = "return a dict, tuple or namedtuple from the collate_fn (or convert the batch in on_before_batch_transfer)"
    try:
        trial = dataclasses.replace(leaf, **{k: getattr(leaf, k) for k in keys})
    except Exception as error:  # noqa: BLE001 - whatever __init__ raises, said with the fix
        raise ConfigurationError(
            f"the batch holds a {name} (a dataclass), which lightning_pipe rebuilds for each microbatch through "
            f"dataclasses.replace, and that raised {type(error).__name__}: {error}; {fix}") from error
    changed = [k for k in keys if not _same(getattr(trial, k), getattr(leaf, k))]
    if changed:
        raise ConfigurationError(
            f"the batch holds a {name} (a dataclass) whose __post_init__ changes {changed} when it is rebuilt from its "
            "own values; lightning_pipe rebuilds it for each microbatch through its __init__, so each microbatch "
            f"would be changed a second time. Make __post_init__ leave values it already converted as they are, or "
            f"{fix}")


def _open_one(leaf: Any, batch_size: Optional[int], keep: bool) -> Any:
    """``leaf`` as an :class:`_Opened` node where it is a container we can rebuild and it holds tensors (see the
    module docstring); anything else as it is."""
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        fields = dataclasses.fields(leaf)
        if not _holds_tensor([getattr(leaf, f.name, None) for f in fields]):
            return leaf  # nothing to split: every microbatch gets it whole
        if any(not f.init and _holds_tensor(getattr(leaf, f.name, None)) for f in fields):
            return leaf  # replace() would not carry such a field over: refused if it holds batched tensors
        keys = tuple(f.name for f in fields if f.init)
        if keep:
            _rebuildable(leaf, keys)
        return _Opened([open_containers(getattr(leaf, k), batch_size, keep) for k in keys],
                       _Layout(leaf, keys, (), keep))
    data = getattr(leaf, "data", None) if isinstance(leaf, UserDict) else None
    if isinstance(data, dict) and _holds_tensor(list(data.values())):
        samples = []
        for name, value in vars(leaf).items():
            if name == "data":
                continue
            if isinstance(value, list) and batch_size is not None and len(value) == batch_size > 0:
                samples.append(name)
            elif _holds_tensor(value):
                return leaf  # a tensor outside the items: refused if batched
        keys = tuple(data)
        values = [open_containers(data[k], batch_size, keep) for k in keys]
        return _Opened(values + [_Samples(getattr(leaf, name)) for name in samples],
                       _Layout(leaf, keys, tuple(samples), keep))
    return leaf


def open_containers(tree: Any, batch_size: Optional[int] = None, keep: bool = True) -> Any:
    """``tree`` with its dataclasses and ``UserDict`` containers opened for torch's pytree; flattening it reaches
    their tensors and unflattening rebuilds them. Attributes of a ``UserDict`` are split per sample only when they
    are lists of ``batch_size`` entries. ``keep=False`` opens for a description only (the tree spec keeps no
    container; it cannot be unflattened).

    Example:
        >>> @dataclasses.dataclass
        ... class Batch:
        ...     x: torch.Tensor
        ...     tag: str
        >>> leaves, spec = tree_flatten(open_containers(Batch(torch.zeros(2), "a")))
        >>> len(leaves), tree_unflatten(leaves, spec)
        (2, Batch(x=tensor([0., 0.]), tag='a'))
    """
    if not any(isinstance(leaf, UserDict) or dataclasses.is_dataclass(leaf)
               for leaf in tree_flatten(tree, is_leaf=lambda x: _closed(x) or _scalar_sequence(x))[0]):
        return tree  # the common case: nothing to open
    return tree_map(lambda leaf: _open_one(leaf, batch_size, keep), tree, is_leaf=_closed)


def _scalar_sequence(value: Any) -> bool:
    """A list or tuple of numbers and strings only (per-sample names): nothing in it to open or to watch, and
    walking it item by item with pytree costs about a microsecond an item."""
    return isinstance(value, (list, tuple)) and all(isinstance(v, SCALARS) for v in value)


def _closed(value: Any) -> bool:
    """Whether torch's pytree takes ``value`` for a leaf though we can open it (a type registered with pytree,
    such as Hugging Face's ``ModelOutput``, is left to pytree)."""
    return isinstance(value, NoChunk) or (dataclasses.is_dataclass(value) or isinstance(value, UserDict)) \
        and type(value) not in SUPPORTED_NODES


def _opaque_contents(leaf: Any) -> Optional[dict]:
    """The fields of a container torch's pytree treats as a leaf (dataclass, non-dict Mapping, object), else None."""
    if isinstance(leaf, (torch.Tensor, NoChunk, type) + SCALARS):
        return None
    if dataclasses.is_dataclass(leaf):
        return {f.name: getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)}
    if isinstance(leaf, UserDict):
        data = getattr(leaf, "data", None)
        return {**vars(leaf), **(dict(data) if isinstance(data, Mapping) else {})}
    if isinstance(leaf, Mapping):
        try:
            return dict(leaf.items())
        except Exception:  # noqa: BLE001 - an exotic mapping: not ours to judge
            return None
    return dict(vars(leaf)) if hasattr(leaf, "__dict__") and not callable(leaf) else None


def _check_opaque(leaves: Sequence[Any], batch_size: Optional[int], batch_dim: int) -> None:
    """Refuse a container that hides batched tensors from the split (it would reach every microbatch whole).

    With ``batch_size`` None (no visible tensor to split) any tensor inside counts; else one whose
    ``batch_dim`` has ``batch_size`` elements.
    """
    for leaf in leaves:
        contents = _opaque_contents(leaf)
        if contents is None:
            continue
        inner, _ = tree_flatten(list(contents.values()), is_leaf=lambda x: isinstance(x, NoChunk))
        if any(isinstance(t, torch.Tensor) and (batch_size is None or t.dim() > 0 and -t.dim() <= batch_dim < t.dim()
                                                and t.shape[batch_dim] == batch_size) for t in inner):
            kind = "a dataclass" if dataclasses.is_dataclass(leaf) else \
                "a Mapping that is not a dict" if isinstance(leaf, Mapping) else "an object with tensor attributes"
            fix = "a namedtuple with the same fields (attribute access keeps working)" \
                if dataclasses.is_dataclass(leaf) else "`dict(batch)` (item access keeps working)" \
                if isinstance(leaf, Mapping) else "a dict, tuple or namedtuple"
            raise ConfigurationError(
                f"the batch holds a {type(leaf).__module__}.{type(leaf).__qualname__} ({kind}), a container "
                "lightning_pipe cannot look into to split its tensors into microbatches (it splits tensors inside "
                f"tuples, lists, dicts and namedtuples). Return {fix} from the DataLoader's collate_fn, or convert "
                "the batch in LightningModule.on_before_batch_transfer"
            )


def batch_size_of(inputs: Any, batch_dim: int = 0) -> int:
    """The size of the batch dimension shared by every splittable tensor in ``inputs``.

    Raises:
        ConfigurationError: no tensor to split, tensors disagree on the batch size, or a container
            that hides tensors from the split (see the module docstring).
    """
    size = _plain_batch_size(plain_tensors(inputs), batch_dim)
    if size is not None:
        return size
    leaves, _ = tree_flatten(open_containers(inputs, keep=False))  # the leaves only: nothing is rebuilt
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    short = [tuple(t.shape) for t in tensors if not -t.dim() <= batch_dim < t.dim()]
    if short:
        raise ConfigurationError(
            f"tensors of shapes {short} have no dimension batch_dim={batch_dim} to split into microbatches; "
            "wrap tensors that every microbatch needs whole in NoChunk, or set batch_dim"
        )
    sizes = {tuple(t.shape): t.shape[batch_dim] for t in tensors}
    found = set(sizes.values())
    _check_opaque(leaves, next(iter(found)) if len(found) == 1 else None, batch_dim)
    if not found:
        raise ConfigurationError(
            "the inputs hold no tensor with a batch dimension to split into microbatches; "
            "wrap tensors that every microbatch needs whole in NoChunk and pass at least one batched tensor"
        )
    if len(found) > 1:
        raise ConfigurationError(
            f"the inputs disagree on the batch size along batch_dim={batch_dim}: shapes {sorted(sizes)}; "
            "wrap tensors that are not batched in NoChunk, or set batch_dim"
        )
    return found.pop()


def scatter(inputs: Any, chunks: int, batch_dim: int = 0, made: Optional[list] = None) -> List[Any]:
    """Split ``inputs`` into ``min(chunks, batch size)`` microbatches of the same structure.

    Tensors and per-sample lists are split, everything else is given whole (see the module docstring).
    A tensor that appears more than once in ``inputs`` gets the same slices in each place. ``made``:
    a list to extend with each tensor the microbatches hold and its version (see :func:`written_since`).

    Example:
        >>> parts = scatter((torch.arange(10), "tag"), chunks=4)
        >>> [p[0].tolist() for p in parts], parts[0][1]
        ([[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]], 'tag')
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ConfigurationError(f"chunks (the number of microbatches) must be a positive integer, got {chunks!r}")
    tensors = plain_tensors(inputs)
    batch_size = _plain_batch_size(tensors, batch_dim)
    if batch_size is not None:
        return _scatter_plain(inputs, tensors, min(chunks, batch_size), batch_dim, made)
    batch_size = batch_size_of(inputs, batch_dim)
    num_microbatches = min(chunks, batch_size)
    leaves, spec = tree_flatten(open_containers(inputs, batch_size),
                                is_leaf=lambda x: isinstance(x, (NoChunk, _Samples)) or is_sample_list(x, batch_size))
    sizes = microbatch_sizes(batch_size, num_microbatches)
    bounds = list(zip(itertools.accumulate(sizes), sizes))
    shared = _shared_storages(leaves)
    columns = []
    done: Dict[int, list] = {}  # id of a tensor -> its column (the leaves keep every tensor alive meanwhile)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and id(leaf) in done:
            columns.append(done[id(leaf)])
            continue
        if isinstance(leaf, NoChunk):
            columns.append([leaf.tensor] * num_microbatches)
        elif isinstance(leaf, _Samples):
            columns.append([_Samples(leaf.items[end - size:end]) for end, size in bounds])
        elif isinstance(leaf, (list, tuple)):  # a per-sample sequence (the only list or tuple leaf)
            columns.append([leaf[end - size:end] for end, size in bounds])
        elif isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            columns.append(_slices(leaf, num_microbatches, batch_dim, shared))
        elif isinstance(leaf, torch.Tensor) and _own_versions(leaf, shared):  # 0-dim (see the module docstring)
            columns.append([leaf] + [leaf.clone() for _ in range(num_microbatches - 1)])
        else:
            columns.append([leaf] * num_microbatches)
        if isinstance(leaf, torch.Tensor):
            done[id(leaf)] = columns[-1]
    if made is not None:
        made += _versions(columns)
    return [tree_unflatten([column[i] for column in columns], spec) for i in range(num_microbatches)]


def _slices(tensor: torch.Tensor, num_microbatches: int, batch_dim: int, shared: set) -> List[torch.Tensor]:
    """``tensor`` split into microbatches, each slice with its own version counter where :func:`_own_versions`
    allows it."""
    parts = torch.tensor_split(tensor, num_microbatches, dim=batch_dim)
    return [part.data for part in parts] if _own_versions(tensor, shared) else list(parts)


def _versions(columns: Sequence[Sequence[Any]]) -> List[Tuple[torch.Tensor, int]]:
    """Each distinct tensor of ``columns`` (one per leaf, a value per microbatch) with its version now (an
    inference tensor has none)."""
    tensors = {id(t): t for column in columns for t in column if isinstance(t, torch.Tensor) and not t.is_inference()}
    return [(t, t._version) for t in tensors.values()]


def plain_tensors(tree: Any) -> Optional[List[torch.Tensor]]:
    """The tensors of ``tree`` in pytree's order if it is the common batch: plain ``tuple``, ``list`` and
    ``dict`` containers of plain tensors with a dimension (and ``None`` in tuples and dicts), nothing to open,
    keep whole or split per sample; else None.

    Such a batch is split and described without torch's pytree, written in Python, which costs
    tens of µs a flatten or unflatten: :func:`scatter` flattened a two-tensor batch four times and
    unflattened it once per microbatch, 0.2 ms on the step's critical path on this project's CPUs
    (0.04 ms this way).

    Example:
        >>> x = torch.zeros(2)
        >>> len(plain_tensors({"x": x, "pair": (x, None)})), plain_tensors((x, "tag"))
        (2, None)
    """
    tensors: List[torch.Tensor] = []
    return tensors if _collect_plain(tree, tensors) else None


def _collect_plain(tree: Any, tensors: List[torch.Tensor]) -> bool:
    kind = type(tree)
    if kind is torch.Tensor:
        tensors.append(tree)
        return tree.dim() > 0
    if kind is tuple or kind is list:  # a list of None only could be a per-sample list: not plain
        return all(item is None and kind is tuple or _collect_plain(item, tensors) for item in tree)
    if kind is dict:
        return all(item is None or _collect_plain(item, tensors) for item in tree.values())
    return False


def _plain_batch_size(tensors: Optional[List[torch.Tensor]], batch_dim: int) -> Optional[int]:
    """The batch size that ``tensors`` (from :func:`plain_tensors`) agree on; None where the general path has
    to look (and raise): no tensor, no ``batch_dim``, sizes that differ, an empty batch."""
    if not tensors:
        return None
    dims = tensors[0].dim()
    size = tensors[0].shape[batch_dim] if -dims <= batch_dim < dims else 0
    for tensor in tensors:
        dims = tensor.dim()
        if not -dims <= batch_dim < dims or tensor.shape[batch_dim] != size:
            return None
    return size or None


def _scatter_plain(inputs: Any, tensors: List[torch.Tensor], num_microbatches: int, batch_dim: int,
                   made: Optional[list]) -> List[Any]:
    """:func:`scatter` of a batch :func:`plain_tensors` accepts: the same microbatches, rebuilt directly."""
    shared = _shared_storages(tensors)
    slices: Dict[int, list] = {}  # id of a tensor -> its slices (the same ones wherever it appears)
    for tensor in tensors:
        if id(tensor) not in slices:
            slices[id(tensor)] = _slices(tensor, num_microbatches, batch_dim, shared)
    if made is not None:
        made += _versions(list(slices.values()))

    def build(tree: Any, i: int) -> Any:
        kind = type(tree)
        if kind is torch.Tensor:
            return slices[id(tree)][i]
        if kind is dict:
            return {key: build(value, i) for key, value in tree.items()}
        return tree if tree is None else kind(build(item, i) for item in tree)

    return [build(inputs, i) for i in range(num_microbatches)]


def _own_versions(tensor: torch.Tensor, shared: set) -> bool:
    """Whether each microbatch's slice of ``tensor`` gets a version counter of its own (``shared``: the memory
    that several distinct tensors of the batch use, see :func:`_shared_storages`).

    Views share their base's version counter, so a write into one microbatch's samples (a stage's
    ``x.mul_(0.5)``, a criterion's ``target.sub_(1)``) would look to autograd like a write into every
    other microbatch's, and the backward of one that saved its input would stop ("modified by an
    inplace operation") where one process writing into its batch once trains fine. A counter per
    microbatch is exact when the microbatches' samples are disjoint memory that no other tensor of
    the batch reaches: not for a tensor whose rows overlap (``expand``, ``unfold``), nor for tensors
    over the same memory (``tokens[:, :-1]`` and ``tokens[:, 1:]`` must see each other's writes).
    ``.data`` is torch's alias of the same memory without the version counter. A tensor that requires
    grad (its gradient flows back), an inference tensor and a tensor subclass keep their views.
    """
    return type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.requires_grad \
        and not tensor.is_inference() and _storage(tensor) not in shared and not _overlaps_itself(tensor)


def _overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` share memory (a stride 0, an ``unfold``): strides sorted, each must
    step past everything the smaller ones reach."""
    reach = 0
    for stride, size in sorted((abs(st), sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _storage(tensor: torch.Tensor) -> Tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


def _shared_storages(leaves: Sequence[Any]) -> set:
    """The memory (device, storage) that more than one distinct plain tensor of ``leaves`` uses (NoChunk's
    included; a tensor subclass keeps its views anyway)."""
    seen, shared, counted = set(), set(), set()
    for leaf in leaves:
        tensor = leaf.tensor if isinstance(leaf, NoChunk) else leaf
        if type(tensor) is torch.Tensor and tensor.layout == torch.strided and id(tensor) not in counted:
            counted.add(id(tensor))
            key = _storage(tensor)
            (shared if key in seen else seen).add(key)
    return shared


def tensor_versions(tree: Any) -> List[Tuple[torch.Tensor, int]]:
    """Each tensor in ``tree`` with its version, which grows with every write into the tensor or into a view
    of it (each microbatch :func:`scatter` makes counts its own writes); see :func:`written_since`. The
    tensors are kept, so a write still counts after the tree drops them. Inference tensors have no version.

    Example:
        >>> parts = scatter(({"x": torch.zeros(4, 2)},), 2)
        >>> before = [tensor_versions(part) for part in parts]
        >>> parts[0][0]["x"] = parts[0][0]["x"].add_(1).double()  # written, then replaced
        >>> [written_since(versions) for versions in before]
        [True, False]
    """
    leaves = tree_flatten(open_containers(tree, keep=False), is_leaf=_scalar_sequence)[0]
    return [(t, t._version) for t in leaves if isinstance(t, torch.Tensor) and not t.is_inference()]


def written_since(versions: List[Tuple[torch.Tensor, int]]) -> bool:
    """Whether a tensor of :func:`tensor_versions`'s result was written into since."""
    return any(t._version != version for t, version in versions)


def copy_tensors(tree: Any) -> Any:
    """``tree`` with each tensor replaced by a copy: a write into one changes neither the tensor copied nor
    the tensors that share its memory (containers opened and rebuilt as :func:`scatter` does).

    Example:
        >>> batch = (torch.zeros(2), "tag")
        >>> copied = copy_tensors(batch)
        >>> _ = copied[0].add_(1)
        >>> batch[0].tolist(), copied
        ([0.0, 0.0], (tensor([1., 1.]), 'tag'))
    """
    leaves, spec = tree_flatten(open_containers(tree))
    return tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t for t in leaves], spec)


def microbatch_sizes(batch_size: int, chunks: int) -> List[int]:
    """The sizes :func:`scatter` gives: ``microbatch_sizes(10, 4) == [3, 3, 2, 2]``."""
    m = min(chunks, batch_size)
    return [batch_size // m + (1 if i < batch_size % m else 0) for i in range(m)]


def gather(outputs: Sequence[Any], batch_dim: int = 0) -> Any:
    """Merge microbatch outputs of the same structure back into one batch: the inverse of :func:`scatter`.

    Tensors are concatenated along ``batch_dim`` (0-dim tensors are stacked); per-sample sequences
    (as :func:`scatter` tells them, by each microbatch's own size) are concatenated; other leaves
    are taken from the first microbatch.

    Raises:
        ConfigurationError: the microbatches' outputs differ in structure (other keys, other lengths).

    Example:
        >>> gather([torch.zeros(2), torch.ones(1)]).tolist()
        [0.0, 0.0, 1.0]
        >>> gather([(torch.zeros(2), ["a", "b"]), (torch.ones(1), ["c"])])[1]
        ['a', 'b', 'c']
    """
    flat = []
    for out in outputs:
        size = _size_of_output(out, batch_dim)
        flat.append(tree_flatten(open_containers(out, size),
                                 is_leaf=lambda x, n=size: isinstance(x, _Samples) or n is not None and is_sample_list(x, n)))
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], start=1):
        if other != spec:
            raise ConfigurationError(
                f"the outputs of microbatches 0 and {i} differ in structure ({spec} against {other}), so they cannot "
                "be merged into one batch; return the same structure from every microbatch (tensors, or per-sample "
                "lists of the microbatch's length)"
            )
    merged = []
    for column in zip(*(leaves for leaves, _ in flat)):
        first = column[0]
        if isinstance(first, torch.Tensor):
            merged.append(torch.stack(column) if first.dim() == 0 else torch.cat(column, dim=batch_dim))
        elif isinstance(first, _Samples):
            merged.append(_Samples(type(first.items)(item for part in column for item in part.items)))
        elif isinstance(first, (list, tuple)):  # a per-sample sequence (the only list or tuple leaf)
            merged.append(type(first)(item for part in column for item in part))
        else:
            merged.append(first)
    return tree_unflatten(merged, spec)


def _size_of_output(output: Any, batch_dim: int) -> Optional[int]:
    """The batch size every tensor of a microbatch's output shares along ``batch_dim``, else None."""
    leaves, _ = tree_flatten(open_containers(output, keep=False))
    sizes = {t.shape[batch_dim] for t in leaves if isinstance(t, torch.Tensor) and -t.dim() <= batch_dim < t.dim()}
    return sizes.pop() if len(sizes) == 1 else None
