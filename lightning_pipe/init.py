"""Materialization of meta-device modules, deterministic per module and independent of the layout.

A model built on the ``meta`` device (``configure_model()``, ``Trainer.init_module(empty_init=True)``)
has the structure of the whole model but no storage. :func:`materialize` gives the modules a rank
runs real tensors and initializes each with its own ``reset_parameters()``, as Lightning's
``lightning.fabric.utilities.init`` does, with one difference: every module is reset under a random
state derived from the seed and its qualified name in the *unpartitioned* model
(``"layers.7.attn"``), never from what was drawn before it. A module gets the same values whichever
rank, ``pipe_size`` or number of replicas materializes it, and the same as when the whole model is
materialized at once on one device: that call, ``materialize(model, device, seed)``, is the
reference an unpipelined run starts from.

Rules the modules must follow (torch's own modules do):

- ``reset_parameters()`` initializes every parameter and buffer the module registers *itself*
  (not those of its children: each child is reset under its own name). A module that owns meta
  tensors and has no ``reset_parameters`` is refused with :class:`MaterializationError`, unless it
  lies inside a Hugging Face model (a module with a ``config``, ``post_init`` and an
  ``_init_weights(module)`` method, as every ``PreTrainedModel`` has): there the innermost such
  model's ``_init_weights(module)`` initializes it after its ``reset_parameters()`` if it has one,
  and runs on the modules between it and the stage's layer that hold no tensors themselves
  (children first), as transformers 5 initializes a model it builds (normal weights of the
  config's ``initializer_range``, GPT-2's scaled output projections, norms of ones, rotary tables
  and position ids computed). An integer tensor it leaves unwritten is refused, as a
  floating-point one is.
- Buffers are uninitialized memory until ``reset_parameters()`` writes them: a buffer computed in
  ``__init__`` (a rotary table, a causal mask) must be computed again there. A floating-point
  parameter or buffer that ``reset_parameters()`` leaves unwritten is detected (it is filled with
  NaN beforehand) and refused by name; integer and boolean ones are zero-filled beforehand, so an
  unwritten one is zero on every rank.
- A tensor registered in several modules (a tied embedding and output head) stays one tensor and
  takes the values its *first* holder in ``named_modules()`` order gives it. When only a part of
  the model is materialized (``include``), the first holders of the part's tied tensors are
  materialized too, so a tie that crosses stages gets the same values on every stage.

The values depend on the seed, the names and the device type (CPU and CUDA generators differ),
not on the layout. Torch's random state is left as it was.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_pipe.errors import PipelineError
from lightning_pipe.rng import derive, seed_torch

_CHUNK = 1 << 24  # elements checked for NaN at a time (bounds the temporary mask)


class MaterializationError(PipelineError, TypeError):
    """A meta-device module cannot be given deterministic values (no or incomplete ``reset_parameters``)."""


class _RefuseValuesIntoMeta(TorchFunctionMode):
    """Raises where code copies a real tensor's values into a meta tensor, which keeps none of them."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        source = args[1] if func is torch.Tensor.copy_ and len(args) > 1 else \
            args[2] if func is torch.Tensor.__setitem__ and len(args) > 2 else None
        if isinstance(source, torch.Tensor) and not source.is_meta and isinstance(args[0], torch.Tensor) \
                and args[0].is_meta:
            raise MaterializationError(
                f"values were copied into a tensor of shape {tuple(args[0].shape)} built on the meta device (in "
                "configure_model() or under init_module(empty_init=True)), which keeps none of them: a meta tensor "
                "has no storage, and the model is given its initial values later, module by module. Load "
                "pretrained weights in on_fit_start (`self.model.load_state_dict(weights)`: each process copies its "
                "own part), or with load_state_dict(..., assign=True), which puts the real tensors in place"
            )
        return func(*args, **kwargs)


@contextmanager
def building_on_meta() -> Iterator[None]:
    """Build modules on the meta device (``torch.device("meta")``), where copying a real tensor's values into a
    meta tensor (``copy_``, item assignment) does nothing: here it raises :class:`MaterializationError` instead
    (pretrained weights loaded there would be lost when the model is materialized; ``load_state_dict``
    reports the error in its own ``RuntimeError``).

    Example:
        >>> pretrained = nn.Linear(2, 2).state_dict()
        >>> with building_on_meta():
        ...     layer = nn.Linear(2, 2)
        ...     with torch.no_grad():
        ...         layer.weight.copy_(pretrained["weight"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        lightning_pipe.init.MaterializationError: values were copied into a tensor of shape (2, 2) built on ...
    """
    with torch.device("meta"), _RefuseValuesIntoMeta():
        yield


def name_seed(seed: int, name: str) -> int:
    """The seed of the module named ``name``: stable across processes (never Python's salted ``hash``).

    Example:
        >>> name_seed(0, "layers.7.attn") == name_seed(0, "layers.7.attn") != name_seed(0, "layers.7.mlp")
        True
    """
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return derive(seed, int.from_bytes(digest, "little"))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


Holder = Tuple[nn.Module, str, str]  # (module, "_parameters" or "_buffers", attribute name)


class _Plan:
    """Which modules hold which meta tensors, under which names (a tensor's first holder owns it)."""

    def __init__(self, module: nn.Module, prefix: str) -> None:
        self.names: Dict[int, List[str]] = {}
        self.order: List[nn.Module] = []
        paths: Dict[str, nn.Module] = {}
        for name, sub in module.named_modules(remove_duplicate=False):
            if id(sub) not in self.names:
                self.names[id(sub)] = []
                self.order.append(sub)
            self.names[id(sub)].append(_join(prefix, name))
            paths[name] = sub
        self.initializer: Dict[int, nn.Module] = {}  # module id -> the Hugging Face model that initializes it
        for name, sub in paths.items():
            parts = name.split(".") if name else []
            for k in range(len(parts), -1, -1):  # the innermost enclosing model, the module itself included
                owner = paths.get(".".join(parts[:k]))
                if owner is not None and _initializes_modules(owner):
                    self.initializer.setdefault(id(sub), owner)
                    break
        self.holders: Dict[int, List[Holder]] = {}
        self.tensors: Dict[int, torch.Tensor] = {}
        self.held: Dict[int, List[int]] = {}  # module id -> ids of the meta tensors it holds
        for sub in self.order:
            self.held[id(sub)] = []
            for kind in ("_parameters", "_buffers"):
                for attr, tensor in getattr(sub, kind).items():
                    if tensor is not None and tensor.is_meta:
                        self.holders.setdefault(id(tensor), []).append((sub, kind, attr))
                        self.tensors[id(tensor)] = tensor
                        self.held[id(sub)].append(id(tensor))

    def name(self, module: nn.Module) -> str:
        return self.names[id(module)][0]

    def select(self, include: Optional[Callable[[str], bool]]) -> List[nn.Module]:
        """The modules to reset: those included that hold meta tensors, and the owners of their tensors."""
        chosen = {id(m) for m in self.order if self.held[id(m)] and
                  (include is None or any(include(n) for n in self.names[id(m)]))}
        pending = list(chosen)
        while pending:
            for tensor_id in self.held[pending.pop()]:
                owner = self.holders[tensor_id][0][0]
                if id(owner) not in chosen:
                    chosen.add(id(owner))
                    pending.append(id(owner))
        return [m for m in self.order if id(m) in chosen]

    def initialized_containers(self, modules: List[nn.Module]) -> List[nn.Module]:
        """Modules inside a Hugging Face model that hold no tensors themselves but whose whole subtree is among
        ``modules``: Hugging Face's ``_init_weights`` of such a module may set its children (GPT-2's attention
        rescales its output projection), so it runs too. Hugging Face models and module lists are left out: they
        span stages, and a call on part of them would make the values depend on the layout."""
        selected = {t for m in modules for t in self.held[id(m)]}
        containers = []
        for m in self.order:
            if self.held[id(m)] or id(m) not in self.initializer or _initializes_modules(m) \
                    or isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
                continue
            tensors = [t for sub in m.modules() for t in (*sub._parameters.values(), *sub._buffers.values())
                       if t is not None]
            if tensors and all(t.is_meta and id(t) in selected for t in tensors):
                containers.append(m)
        return containers


def _initializes_modules(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face model, which initializes its submodules with ``_init_weights(m)``
    (duck-typed: transformers is not a dependency)."""
    return callable(getattr(module, "_init_weights", None)) and hasattr(module, "config") \
        and callable(getattr(module, "post_init", None))


def _check_resettable(plan: _Plan, modules: List[nn.Module]) -> None:
    missing = [f"`{plan.name(m)}` ({type(m).__name__})" for m in modules
               if not callable(getattr(m, "reset_parameters", None)) and id(m) not in plan.initializer]
    if missing:
        raise MaterializationError(
            "materializing meta-device modules needs a `reset_parameters()` method on every module that "
            f"registers parameters or buffers itself; these have none: {', '.join(missing)}. Implement "
            "`reset_parameters()` to initialize the tensors the module registers itself (as Lightning's "
            "meta-device initialization also requires), e.g. `reset_parameters = _reset_parameters` for "
            "torch's nn.MultiheadAttention"
        )


def _unwritten_value(tensor: torch.Tensor, by_hugging_face: bool) -> Union[float, int, bool]:
    """What a tensor holds before its initialization: NaN where it can; an integer tensor a module of a Hugging Face
    model initializes gets its dtype's largest value (Hugging Face recomputes such buffers, position ids, in
    ``_init_weights``, on some versions not: left so, they are refused rather than zero); other integers 0."""
    if tensor.is_floating_point() or tensor.is_complex():
        return float("nan")
    if by_hugging_face and tensor.dtype != torch.bool:
        return torch.iinfo(tensor.dtype).max
    return 0


def _allocate(plan: _Plan, modules: List[nn.Module], device: torch.device) -> Dict[int, int]:
    """One real tensor per meta tensor the modules hold, put into every holder (ties stay ties).

    Returns the integer tensors filled with another value than 0 (by their ``id``: the value), for
    :func:`_check_written`.
    """
    sentinels: Dict[int, int] = {}
    for tensor_id in dict.fromkeys(t for m in modules for t in plan.held[id(m)]):
        meta = plan.tensors[tensor_id]
        real = torch.empty_like(meta, device=device)
        by_hugging_face = any(id(holder) in plan.initializer for holder, _, _ in plan.holders[tensor_id])
        value = _unwritten_value(real, by_hugging_face)
        real.fill_(value)
        if isinstance(value, int) and not isinstance(value, bool) and value != 0:
            sentinels[id(real)] = value
        if isinstance(meta, nn.Parameter):
            real = nn.Parameter(real, requires_grad=meta.requires_grad)
            real.__dict__.update(meta.__dict__)  # user tags on the parameter (e.g. no weight decay)
        for holder, kind, attr in plan.holders[tensor_id]:
            getattr(holder, kind)[attr] = real
    return sentinels


def _has_nan(tensor: torch.Tensor) -> bool:
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return False
    flat = tensor.detach().reshape(-1)
    return any(bool(torch.isnan(part).any()) for part in flat.split(_CHUNK))


def _check_written(plan: _Plan, modules: List[nn.Module], sentinels: Dict[int, int]) -> None:
    unwritten, untied = [], []
    for m in modules:
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(m, kind).items():
                left = tensor is not None and id(tensor) in sentinels and bool((tensor == sentinels[id(tensor)]).any())
                if tensor is not None and (_has_nan(tensor) or left):
                    unwritten.append(f"`{_join(plan.name(m), attr)}` ({type(m).__name__})")
    for tensor_id in dict.fromkeys(t for m in modules for t in plan.held[id(m)]):
        holders = plan.holders[tensor_id]
        if len({id(getattr(h, kind).get(attr)) for h, kind, attr in holders}) > 1:
            untied.append(" = ".join(f"`{_join(plan.name(h), attr)}`" for h, _, attr in holders))
    if unwritten:
        raise MaterializationError(
            f"`reset_parameters()` left these tensors uninitialized: {', '.join(unwritten)}. Initialize "
            "every parameter and buffer the module registers itself there (compute buffers such as rotary "
            "tables or masks in `reset_parameters()`, not only in `__init__`); inside a Hugging Face model, "
            "its `_init_weights(module)` ran after it and did not write them either"
        )
    if untied:
        raise MaterializationError(
            f"`reset_parameters()` replaced tied tensors, so they are no longer shared: {'; '.join(untied)}. "
            "Initialize parameters in place (`nn.init.*_`, `tensor.copy_`) instead of assigning new ones"
        )


def materialize(module: nn.Module, device: Union[str, torch.device], seed: int = 0, prefix: str = "",
                include: Optional[Callable[[str], bool]] = None) -> List[str]:
    """Give the meta tensors of ``module`` real, deterministic values on ``device`` (see the module docstring).

    Args:
        module: a module whose parameters and buffers are (partly) on the ``meta`` device.
        device: where the tensors are created.
        seed: the run's seed; with the names it fixes every value.
        prefix: the qualified name of ``module`` in the unpartitioned model (``"layers.7"`` for a
            layer materialized on its own), so that its values are those it has in the whole model.
        include: which modules to materialize, by qualified name (a module registered under several
            names is included if one of them is); None for every module with meta tensors. Others
            stay on the meta device, except the first holders of included tensors (tied ones).

    Returns:
        The qualified names of the modules reset, in ``named_modules()`` order.

    Raises:
        MaterializationError: a module to reset has no ``reset_parameters()`` and is not inside a
            Hugging Face model (raised before any change), leaves a floating-point tensor unwritten,
            or replaces a tied tensor.

    Example:
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> materialize(model, "cpu", seed=1)
        ['0', '2']
        >>> with torch.device("meta"):
        ...     last = nn.Linear(4, 2)
        >>> materialize(last, "cpu", seed=1, prefix="2")  # the same layer alone, as a stage would
        ['2']
        >>> torch.equal(last.weight, model[2].weight) and torch.equal(last.bias, model[2].bias)
        True
    """
    device = torch.device(device)
    plan = _Plan(module, prefix)
    modules = plan.select(include)
    _check_resettable(plan, modules)
    containers = {id(m) for m in plan.initialized_containers(modules)}
    sentinels = _allocate(plan, modules, device)
    devices = [device] if device.type == "cuda" else []
    reset = {id(m) for m in modules}
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"), \
            torch.no_grad(), device:
        # children before their parents, as Hugging Face applies _init_weights; a tied tensor's first holder
        # resets it last: its values win
        for m in reversed([m for m in plan.order if id(m) in reset or id(m) in containers]):
            seed_torch(name_seed(seed, plan.name(m)), device)
            if id(m) in reset and callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
            if id(m) in plan.initializer:
                plan.initializer[id(m)]._init_weights(m)
    _check_written(plan, modules, sentinels)
    return [plan.name(m) for m in modules]
