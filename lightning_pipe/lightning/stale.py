"""The last stage's copies of modules outside the body that it does not train.

The last stage reruns the user's step whole (see :mod:`.steps`), so the code before the body call
runs there too, with the last stage's copies of the modules it calls (an embedding, say). The
first stage trains those modules (their gradients come from the body's input); the last stage's
copy gets no gradient and, from the second step on, is out of date. That is harmless while what
it computes only feeds the body call, whose result the pipeline replaces (a language model's
embedding: the common case, which then costs nothing). Anything else such a value reaches would
silently differ from what one process computes: a logged value, a metric's state, a number read
into Python (``if h.isnan().any()``), the step's result, a list the step appends it to.

So in training steps the last stage *marks* the outputs and parameters of the modules outside the
body (:class:`Stale`, a tensor subclass whose ``__torch_function__`` passes the mark on to
whatever is computed from them; torch has no other way to follow a value through arbitrary user
code, and operations on unmarked tensors pay nothing); a call after the body (a module under
``torch.no_grad()`` in the loss) is followed too. A marked value reaching one of those *sinks*
notes its module. In the first training step every copy still equals the first stage's, so
noting is all: after it (:meth:`StaleCopies.learn`), each noted module the last stage does not
train (whose gradients it neither computes nor gets summed in) is kept equal to the first stage's
copy, sent before every training step that follows an optimizer step (:meth:`StaleCopies.refresh`).
A module whose marked values first reach a sink later (code under ``if batch_idx % 100 == 50``)
raises :class:`~lightning_pipe.errors.StaleValueError` instead of computing with an old copy.
Printing a marked value (``repr``, ``format``) is not a sink.
Evaluation steps follow nothing: before the first evaluation step after an optimizer step, every
copy the last stage does not train is refreshed (once per validation loop, not per step).

What a watched module computes on the last stage after the first step can only feed the body, so
a watched ``nn.Linear``, ``nn.Embedding``, ``nn.Conv*d`` or ``nn.LayerNorm`` (pure functions of
input and parameters) without hooks of its own skips the computation there: zeros of the output's
shape, after one real call per input shape (:func:`_skipping_forward`).

The other way round, the first stage's code before the body may read a parameter that only the last
stage trains (``h = self.embed(x) * self.temperature.detach()``, or a head called under
``torch.no_grad()`` to gate the input): the first stage computes no gradient for it, so its copy
would never change. Those the first training step read there (recorded by
:func:`.release.uses_recorded`) are sent from the last stage to the first before every training
step that follows an optimizer step; before evaluation, also the LightningModule's own parameters
the last stage trains, which any code may read as attributes.

A write of a marked value into an unmarked tensor (``buffer.copy_(h)``, ``x[:, :n] = h``) counts
as a sink, since the tensor written may be a metric's state; in the first step that only costs
the refresh.
"""

from __future__ import annotations

import pickle
import types
from contextlib import contextmanager
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set

import numpy as np
import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils._pytree import tree_flatten, tree_map

from lightning_pipe.errors import StaleValueError
from lightning_pipe.lightning import release
from lightning_pipe.lightning.objects import broadcast_object, dumps

_WATCH: Optional["StaleCopies"] = None  # the copies being watched while the last stage runs the user's step

# functions whose result does not depend on a tensor's values (besides ``is_*`` ones, see _reads)
_METADATA = {"shape", "dtype", "ndim", "device", "layout", "requires_grad", "grad_fn", "size", "dim", "numel",
             "nelement", "stride", "storage_offset", "element_size", "itemsize", "nbytes", "data_ptr", "get_device",
             "__len__", "__hash__", "names", "_version", "is_leaf"}
_READ_TYPES = (bool, int, float, complex, list, np.ndarray)  # not str: printing a value is not a sink


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property's getter: the property's own name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _reads(func: Any, name: str, out: Any) -> bool:
    """Whether ``func`` took a tensor's values into Python (``item``, ``bool``, ``tolist``, ``torch.equal``)."""
    if name in _METADATA or name.startswith("is_") and name != "is_nonzero":
        return False
    return isinstance(out, _READ_TYPES)


def _written(func: Any, name: str, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The tensor ``func`` writes into: ``out=``, or the first argument of an in-place method."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    in_place = name.endswith("_") and not name.startswith("_") or name == "__setitem__" \
        or name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__", "__init__", "__iter__")
    return args[0] if in_place and args and isinstance(args[0], torch.Tensor) else None


def sources_of(tree: Any) -> FrozenSet[str]:
    """The modules the marked tensors in ``tree`` come from."""
    found: Set[str] = set()
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, Stale):
            found |= leaf._sources
    return frozenset(found)


def _mark(value: Any, sources: FrozenSet[str]) -> Any:
    if type(value) is torch.Tensor or isinstance(value, nn.Parameter):
        marked = value.as_subclass(Stale)
        marked._sources = sources
        return marked
    if isinstance(value, Stale):
        value._sources = value._sources | sources
    return value


def mark(tree: Any, sources: FrozenSet[str]) -> Any:
    """``tree`` with each tensor marked as computed from ``sources``."""
    with torch._C.DisableTorchFunctionSubclass():
        return tree_map(lambda leaf: _mark(leaf, sources), tree)


def unmark(tree: Any, what: str) -> Any:
    """``tree`` with its marked tensors plain again (same data and graph); their sources reached ``what``."""
    sources = sources_of(tree)
    if not sources:
        return tree
    if _WATCH is not None:
        _WATCH.note(sources, what)
    with torch._C.DisableTorchFunctionSubclass():
        return tree_map(lambda leaf: leaf.as_subclass(torch.Tensor) if isinstance(leaf, Stale) else leaf, tree)


# Modules whose output is a function of their input and parameters alone (no buffers updated, no
# randomness): a watched one's computation on the last stage can be skipped (see _skipping_forward).
_PURE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm)


def _skippable(module: nn.Module, handle: Any) -> bool:
    return type(module) in _PURE and not module._modules and not module._forward_pre_hooks \
        and list(module._forward_hooks) == [handle.id] and "forward" not in module.__dict__ \
        and getattr(module, "max_norm", None) is None  # nn.Embedding(max_norm=...) renormalizes its weight in place


def _skipping_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A watched module's forward on the last stage after the first step: zeros of the output's shape, marked.

    What it computes there can only feed the body call, whose result the pipeline replaces: any other
    use raises StaleValueError. So after one real call per input shape, the last stage skips the
    computation (for the ViT patch embedding or projection before the body, a layer's worth of work
    per microbatch). Bound per instance (``types.MethodType``), so that a deep copy of the module
    binds it to the copy, which is not watched and runs its own forward.

    The module's marking hook is removed once it skips (:meth:`StaleCopies.learn`): it marks here,
    and hands back the same marked zeros for successive calls with the same input while no step
    wrote into them, since a new tensor, its mark and the hook cost 0.06 ms a microbatch after the
    step's matrix products (``benchmarks/glue_cost.py``).
    """
    watch, x = _WATCH, args[0] if len(args) == 1 and not kwargs else None
    skipped = watch._skipped.get(id(self)) if watch is not None else None
    if skipped is None or skipped[0] is not self:  # not watching, or a deep copy (an EMA teacher)
        return type(self).forward(self, *args, **kwargs)
    sources = skipped[1]
    if type(x) is not torch.Tensor or module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return mark(type(self).forward(self, *args, **kwargs), sources)
    key = (id(self), tuple(x.shape), x.dtype, x.device, torch.is_grad_enabled(), torch.is_autocast_enabled(x.device.type))
    known = watch._shapes.get(key)
    if known is None:
        out = type(self).forward(self, x)
        if type(out) in (torch.Tensor, Stale) and len(watch._shapes) < 256:  # Stale: from the marked parameters
            watch._shapes[key] = (out.shape, out.dtype, out.requires_grad)
        return mark(out, sources)
    shape, dtype, requires_grad = known
    if torch.is_inference_mode_enabled():  # an inference tensor has no version to tell a write by: made anew
        return mark(torch.zeros(shape, dtype=dtype, device=x.device), sources)
    cached = watch._zeros.get(id(self))
    if cached is not None and cached[0] == key and cached[1]._version == cached[2]:
        return cached[3]
    zeros = torch.zeros(shape, dtype=dtype, device=x.device).requires_grad_(requires_grad)
    marked = mark(zeros, sources)
    watch._zeros[id(self)] = (key, zeros, zeros._version, marked)  # for the latest input only: activation-sized
    return marked


class Stale(torch.Tensor):
    """A value the last stage computed from its copy of a module outside the body that it does not train.

    Example:
        >>> model = nn.Module()
        >>> model.embed = nn.Linear(2, 2)
        >>> copies = StaleCopies(model, "body", watch=True)
        >>> with copies.watching():
        ...     h = model.embed(torch.ones(2)) * 2
        ...     _ = h.sum().item()
        >>> type(h).__name__, copies.noted
        ('Stale', {'embed': 'read into Python (item)'})
    """

    _sources: FrozenSet[str] = frozenset()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name == "__format__":  # Tensor.__format__ formats a number only for a plain Tensor
            return format(args[0].as_subclass(torch.Tensor), *args[1:])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        watch = _WATCH
        if watch is None:  # a marked value kept past the step: it stops spreading
            return out
        sources = sources_of((args, kwargs))
        if not watch.learned:  # a parameter read as an attribute is a use of its module (see release.uses_recorded)
            watch.read |= sources
        target = _written(func, name, args, kwargs)
        if target is not None and not isinstance(target, Stale):
            watch.note(sources, f"written into a tensor ({name})")
            return out
        if _reads(func, name, out):
            watch.note(sources, f"read into Python ({name})")
            return out
        if name == "__iter__":
            return iter([mark(t, sources) for t in out])
        return mark(out, sources)


class StaleCopies:
    """Watches and refreshes the last stage's copies of the modules the first stage trains (see the module docstring).

    Built on every rank of a pipeline whose last stage is on another process than its first, from
    the same module structure; only the last stage's process watches, only the first stage's sends.

    Args:
        module: the LightningModule (its body already replaced by the stand-in).
        body_path: the body's attribute path.
        watch: whether this process holds the last stage (it marks and follows values).
    """

    def __init__(self, module: nn.Module, body_path: str, watch: bool) -> None:
        self.module = module
        self.candidates = self.find_candidates(module, body_path)
        self.noted: Dict[str, str] = {}  # module path -> the first sink its marked values reached
        self.read: Set[str] = set()  # the modules whose marked values the first step computed with
        self.learned = False
        self.kept: Set[str] = set()  # parameters the last stage trains itself (learned): never refreshed
        self.behind: List[str] = []  # parameters only the last stage trains, which the first stage reads (learned)
        self.behind_in_evaluation: List[str] = []
        self.stale: List[str] = []  # the candidates the last stage does not train (learned)
        self.synced: List[str] = []  # those refreshed before every training step
        self.version = 0  # optimizer steps so far
        self._synced_at = self._all_at = 0  # the version the synced copies, and all stale ones, were refreshed at
        self._watched = set(self.candidates) if watch else set()
        self._handles = {path: self.module.get_submodule(path).register_forward_hook(self._hook(path))
                         for path in sorted(self._watched)}
        self._skipped: Dict[int, tuple] = {}  # id -> (a watched module whose computation is skipped, its sources)
        self._shapes: Dict[tuple, tuple] = {}  # (module id, input, grad mode, autocast) -> output shape, dtype, grad
        self._zeros: Dict[int, tuple] = {}  # module id -> (key, the zeros handed back, their version, marked)
        self._aliases: Dict[tuple, tuple] = {}  # (path, name) -> (parameter, its marked alias, requires_grad)

    @staticmethod
    def find_candidates(module: nn.Module, body_path: str) -> List[str]:
        """The paths of the modules outside the body that own parameters (the copies that can fall behind)."""
        return [path for path, m in release.named_outside_body(module, body_path)
                if m is not module and any(p is not None for p in m._parameters.values())]

    def _hook(self, path: str) -> Any:
        sources, own = frozenset({path}), self.module.get_submodule(path)

        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if _WATCH is not self or path not in self._watched or module is not own:  # not a deep copy's call
                return None
            return mark(output, sources)
        return hook

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Mark and follow the watched modules' outputs and parameters while the last stage runs the user's step.

        A parameter read as an attribute (``x @ self.proj.weight``, ``self.pos.weight[:n]``) passes through no
        call a hook sees, so for the step each watched module holds marked aliases of its parameters instead
        (same data, and the same autograd graph: gradients still reach the parameters).
        """
        global _WATCH
        outer, _WATCH = _WATCH, self if self._watched else None
        swapped = self._alias_parameters() if _WATCH is self else []
        try:
            yield
        finally:
            for params, name, param in swapped:
                params[name] = param
            _WATCH = outer

    def _alias_parameters(self) -> List[tuple]:
        swapped = []
        for path in self._watched:
            params = self.module.get_submodule(path)._parameters
            for name, param in list(params.items()):
                if param is None:
                    continue
                alias = self._aliases.get((path, name))
                # made once per parameter object and grad mode: it shares the data and is a view in the graph.
                # The grad mode is kept beside it: reading the alias's own goes through Stale.__torch_function__
                if alias is None or alias[0] is not param or alias[2] != param.requires_grad:
                    alias = self._aliases[(path, name)] = (param, mark(param, frozenset({path})), param.requires_grad)
                swapped.append((params, name, param))
                params[name] = alias[1]
        return swapped

    def active(self) -> bool:
        """Whether this process is watching a step now."""
        return _WATCH is self

    def note(self, sources: FrozenSet[str], what: str) -> None:
        """Marked values from ``sources`` reached a sink (``what``): noted before :meth:`learn`, refused after."""
        if not self.learned:
            for path in sources:
                self.noted.setdefault(path, what)
            return
        late = sorted(p for p in sources if p in self._watched and self._trainable(p))
        if late:
            raise StaleValueError(
                f"on the last stage, training_step computed a value from `self.{late[0]}` and it was {what}, a use the "
                f"first training step did not make. The first stage trains `self.{late[0]}`; the "
                "last stage, which runs your step again whole, keeps its copy equal to the first stage's only for the "
                "uses the first step showed, so this value would come from an old copy. Make the use happen in the "
                "first step too (e.g. every step), or compute the value from the body's output instead"
            )

    def _trainable(self, path: str) -> bool:
        return any(p is not None and p.requires_grad for p in self.module.get_submodule(path)._parameters.values())

    def learn(self, noted: Sequence[str], kept: Set[str] = frozenset(), behind: Sequence[str] = (),
              behind_in_evaluation: Sequence[str] = ()) -> List[str]:
        """After the first training step (on every rank, with the last stage's :attr:`noted`): keep the noted
        modules the last stage does not train in sync; watch the others that it does not train.

        Args:
            noted: the paths the last stage noted.
            kept: the parameters (by name under the LightningModule) whose copies on the last stage stay equal to
                the trained ones (:meth:`~lightning_pipe.lightning.split.SplitModel.trained_on_last`); never
                refreshed, even in a module that is (a ``temperature`` of the LightningModule used after the body,
                beside a ``pos_embed`` used before it). A module all of whose parameters are kept is not stale.
            behind: the other way round, the parameters only the last stage trains that the first stage's training
                steps read (:meth:`~lightning_pipe.lightning.split.SplitModel.behind_on_first`): sent from the last
                stage to the first before every training step that follows an optimizer step.
            behind_in_evaluation: those its evaluation steps may read, sent before the first evaluation step after
                an optimizer step.

        Returns:
            The paths kept in sync (sorted).
        """
        self.kept = set(kept)
        self.behind, self.behind_in_evaluation = list(behind), list(behind_in_evaluation)
        stale = {path for path in self.candidates if not self._all_kept(path)}
        self.synced = sorted(set(noted) & stale)
        if not self._all_kept(""):
            # parameters of the LightningModule itself (a ViT's pos_embed) are read as attributes, through no call
            # a hook could follow: kept in sync whenever the first stage trains one
            stale.add("")
            self.synced = sorted(set(self.synced) | {""})
        self.stale = sorted(stale)
        self.learned = True
        self._watched = self._watched & set(self.stale) - set(self.synced)
        for path in set(self._handles) - self._watched:  # a module with hooks takes nn.Module's slower call path
            self._handles.pop(path).remove()
        for path in sorted(self._watched):
            m = self.module.get_submodule(path)
            if _skippable(m, self._handles[path]):
                m.forward = types.MethodType(_skipping_forward, m)
                self._skipped[id(m)] = (m, frozenset({path}))
                self._handles.pop(path).remove()  # it marks its output itself; a module with hooks is slower to call
        return self.synced

    def _all_kept(self, path: str) -> bool:
        """Whether the last stage trains every parameter of the module at ``path`` itself (:attr:`kept`)."""
        return all((f"{path}.{n}" if path else n) in self.kept
                   for n, p in self.module.get_submodule(path)._parameters.items() if p is not None)

    def stepped(self) -> None:
        """An optimizer stepped: the first stage's copies changed."""
        self.version += 1

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        for m, _ in self._skipped.values():
            del m.forward
        self._handles, self._watched, self._skipped, self._aliases = {}, set(), {}, {}
        self._shapes, self._zeros = {}, {}

    def _state(self, paths: Sequence[str]) -> Dict[str, torch.Tensor]:
        """What the first stage changes in those modules: trainable parameters the last stage does not train
        itself, and buffers (running statistics of a normalization before the body, which the last stage's copy
        would compute from old inputs)."""
        state = {}
        for path in paths:
            m = self.module.get_submodule(path)
            names = {n: f"{path}.{n}" if path else n for n in (*m._parameters, *m._buffers)}
            state.update({names[n]: p.detach() for n, p in m._parameters.items()
                          if p is not None and p.requires_grad and names[n] not in self.kept})
            if path:  # the LightningModule's own buffers cannot change in a step (SideEffectError)
                state.update({names[n]: b for n, b in m._buffers.items() if b is not None})
        return state

    def refresh(self, transport: Any, first: int, last: int, training: bool) -> None:
        """Before a step: send the copies the step needs from pipeline rank ``first`` to ``last`` and, for the
        parameters only the last stage trains that the first stage reads, from ``last`` to ``first``, if an optimizer
        stepped since they were last sent (every rank of the pipeline calls this; under NCCL each is a broadcast).

        A training step needs the synced modules; an evaluation step, which follows nothing, every stale one.
        """
        at = self._synced_at if training else self._all_at
        if at == self.version:
            return
        if training:
            self._synced_at = self.version
        else:  # not the synced ones' version: a callback may swap weights in for evaluation (an averaged model)
            self._all_at = self.version
        paths = self.synced if training else self.stale
        if paths:
            self._send(transport, first, last, lambda: self._state(paths),
                       f"the first stage's copies of {paths}, which the last stage's code before the body uses")
        behind = self.behind if training else self.behind_in_evaluation
        if behind:
            self._send(transport, last, first, lambda: {name: self.module.get_parameter(name).detach() for name in behind},
                       f"the last stage's copies of {behind}, which it trains and the first stage's code reads")

    def _send(self, transport: Any, source: int, to: int, state: Any, what: str) -> None:
        """Copy ``state()`` (names under the LightningModule -> tensors) of pipeline rank ``source`` into rank ``to``'s."""
        if transport.batched:
            got = broadcast_object(state() if transport.pp_rank == source else None, transport.ranks[source],
                                   transport.group, transport.device)
        elif transport.pp_rank == source:
            transport.send_bytes(dumps(state()), [to])
            return
        elif transport.pp_rank == to:
            got = pickle.loads(transport.recv_bytes(source, what))
        else:
            return
        if transport.pp_rank == to:
            with torch.no_grad():
                for name, value in got.items():
                    path, _, attr = name.rpartition(".")
                    getattr(self.module.get_submodule(path), attr).copy_(value)
