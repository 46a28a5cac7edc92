"""Finding a LightningModule's body, and the stand-in that replaces it on each stage.

A body is an ordered list of layers with a calling convention. Two kinds exist: an
``nn.Sequential`` (called once, each layer's output feeding the next) and an ``nn.ModuleList`` of
blocks that the user's own loop calls with the same extra arguments (see
:mod:`lightning_pipe.lightning.layer_list`). On every rank the body is replaced by a stand-in that
holds only the local stage's layers, under their original names (so ``state_dict`` keys stay those
of the unpartitioned model). What calling the stand-in does depends on where the step is:

- ``"local"``: run the local layers (one stage holds them all);
- ``"stop"``: run the first stage's layers and stop the user's step with :class:`BodyReached`;
- ``"replace"``: return the output the pipeline computed, whatever the input (last stage);
- ``"released"``: refuse to run (after ``fit`` without gathering the whole model).

Seen from the user's code, the ``nn.Sequential`` stand-in is the whole body once
:func:`present_whole_body` has run (the strategy calls it at setup): ``len``, iteration and indexing
(``self.body[-1]``, ``self.body[:2]``) give every layer of the body in order, other stages' layers
being their released (``meta``) copies, as the ``nn.ModuleList`` stand-in does with its block
proxies. So ``configure_optimizers`` builds the same param groups as without PipeStrategy
(layer-wise learning rates, a last layer of its own): groups over released parameters are
harmless, the optimizers hold meta stand-ins for those anyway (see :mod:`.release`). Registered
children stay the local layers only: ``parameters()``, ``state_dict()`` and ``named_modules()``
are this rank's part, and calling the stand-in runs only the local layers.

Under an interleaved placement a rank holds several stages (``stages``, e.g. stages 1 and 3 of 4):
the stand-in still holds all of the rank's layers under their original names, and the pipeline
runs each stage through a chunk (:meth:`StandIn.chunk`) that holds only that stage's layers.
"""

from __future__ import annotations

import enum
import operator
import warnings
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_pipe.checkpoint import autocast_state, checkpointed, saved_tensors_pack
from lightning_pipe.errors import BodyCallError, ConfigurationError
from lightning_pipe.lightning.release import reads_paused
from lightning_pipe.lightning.stale import Stale
from lightning_pipe.skip.tracker import current_tracker, use_tracker

BODY_KINDS = (nn.Sequential, nn.ModuleList)


def swapped_parameters(stand_in: nn.Module) -> bool:
    """Whether some parameter of this rank's layers is a plain tensor at the body call: the step called the model
    with parameters of its own (``torch.func.functional_call``, ``nn.utils.stateless``), which only this stage's
    layers would use (the other stages run in the pipeline, outside the step)."""
    return any(not isinstance(p, nn.Parameter) for p in stand_in.parameters())


# modules whose hooks on the body's layers are known to change values only (weight_norm, spectral_norm, pruning)
_LIBRARIES = ("torch.", "lightning.", "lightning_fabric.", "lightning_pipe.")


def _hook_origin(hook: object) -> str:
    """The module that defined ``hook`` (a function, a bound method, a ``functools.partial``, a callable object)."""
    function = getattr(getattr(hook, "func", hook), "__func__", getattr(hook, "func", hook))
    return getattr(function, "__module__", None) or type(function).__module__


def find_body(module: nn.Module, body: Optional[str] = None) -> Tuple[str, nn.Module]:
    """Return ``(attribute path, module)`` of the body: ``body`` if given, else the one candidate.

    Candidates are the ``nn.Sequential`` and ``nn.ModuleList`` submodules not nested in another
    candidate. With several, the one holding more than half of the module's parameters is the body.
    A body registered under several names is returned under the first (see :func:`body_paths`).

    Raises:
        ConfigurationError: the named body is not a Sequential/ModuleList, or no single candidate, or the
            body is compiled as a whole.
    """
    path, found = _locate(module, body)
    _refuse_compiled(module, path)
    if isinstance(found, nn.Sequential) and (found._backward_hooks or found._backward_pre_hooks):
        raise ConfigurationError(
            f"`self.{path}`, the body, has a backward hook of its own (`register_full_backward_hook` on the body "
            "itself): under PipeStrategy no process holds the whole body, so no gradient of its input or output "
            "exists in one place for it. Put the hook on the module before the body (its output's gradient is the "
            "body input's) or after it, or on the body's layers")
    return body_paths(module, found)[0], found


# not `_forward_hooks_always_called`: on the first stage the stand-in's forward stops the step by raising, and torch
# would call such a hook with no output there; on the last stage, where the body's output reaches the step, it runs
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs")


def share_forward_hooks(body: nn.Module, stand_in: nn.Module) -> None:
    """The stand-in runs the forward hooks put on the body itself (``self.body.register_forward_hook(...)``, reading
    the backbone's output): the same dicts, so a hook removed from or added to either is so for both. A pre-hook then
    runs where the step calls the body (on the first stage its result is the pipeline's input), a forward hook where
    the body's output reaches the step (the last stage), as in one process.

    Example:
        >>> body, stand_in = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Identity())
        >>> handle = body.register_forward_hook(lambda m, args, out: out * 0)
        >>> share_forward_hooks(body, stand_in)
        >>> stand_in(torch.ones(1, 2)).sum().item()
        0.0
        >>> handle.remove()
        >>> stand_in(torch.ones(1, 2)).sum().item()
        2.0
    """
    for name in _FORWARD_HOOKS:
        stand_in.__dict__[name] = body.__dict__[name]


def body_paths(module: nn.Module, body: nn.Module) -> List[str]:
    """Every attribute path under which ``body`` is registered in ``module`` (``self.backbone = self.body``),
    in ``named_modules`` order: the first is the one its layers are named under in ``named_modules()``."""
    return [name for name, sub in module.named_modules(remove_duplicate=False) if sub is body]


def _refuse_compiled(module: nn.Module, path: str) -> None:
    """A body compiled whole, or a module holding it compiled (``torch.compile(net)``, ``net.compile()`` in place,
    a LightningModule given to ``fit`` compiled, whose forward then calls it), runs torch.compile's graph of every
    layer, which no stage holds: refused, with the per-block compile that works. (The body's own in-place
    ``compile()`` is not: its stand-in, which the step calls, is not compiled.)"""
    parts = path.split(".")
    where = None
    if getattr(module, "_compiler_ctx", None):
        where = f"{type(module).__name__} was given to the Trainer torch.compile'd whole"
    for k in range(len(parts)):  # the LightningModule and every module between it and the body
        held = ".".join(parts[:k])
        ancestor = module.get_submodule(held) if held else module
        name = f"`self.{held}`" if held else type(module).__name__
        if where is None and type(ancestor).__name__ == "OptimizedModule":  # torch._dynamo's, not imported
            where = f"{name} is torch.compile'd whole"
        elif where is None and getattr(ancestor, "_compiled_call_impl", None) is not None:
            where = f"{name} is compiled in place (`.compile()`)"
        methods = ("forward", "training_step", "validation_step", "test_step", "predict_step") if k == 0 else ("forward",)
        for method in methods:  # `self.net.forward = torch.compile(self.net.forward)`: dynamo's wrapper keeps the original
            if where is None and hasattr(ancestor.__dict__.get(method), "_torchdynamo_orig_callable"):
                where = f"{name}'s `{method}` is torch.compile'd"
    if where is not None:
        raise ConfigurationError(
            f"{where}: its compiled graph spans every layer of the body `self.{path}`, while under PipeStrategy each "
            "stage holds only its own layers. Compile the blocks instead, each on its own (`for block in "
            "self.blocks: block.compile()`, or `nn.Sequential(*[torch.compile(b) for b in blocks])`), and pass the "
            "module to the Trainer uncompiled")


def _locate(module: nn.Module, body: Optional[str]) -> Tuple[str, nn.Module]:
    if body is not None:
        try:
            found = module.get_submodule(body)
        except AttributeError as exc:
            raise ConfigurationError(f"PipeStrategy(body={body!r}): {type(module).__name__} has no submodule {body!r}") from exc
        _refuse_released(body, found)
        if not isinstance(found, BODY_KINDS):
            raise ConfigurationError(
                f"PipeStrategy(body={body!r}) names a {type(found).__name__}; the body must be an nn.Sequential "
                "(or lightning_pipe.SequentialModel) or an nn.ModuleList whose children are the layers to split"
            )
        return body, found
    candidates = _candidates(module)
    for name in candidates:
        _refuse_released(name, module.get_submodule(name))
    if len(candidates) == 1:
        return candidates[0], module.get_submodule(candidates[0])
    if not candidates:
        raise ConfigurationError(
            f"{type(module).__name__} has no nn.Sequential or nn.ModuleList attribute to pipeline. Put the layers to "
            "split into one (e.g. `self.blocks = nn.ModuleList(...)` called in a loop) and call it from training_step"
        )
    total = sum(p.numel() for p in module.parameters())
    largest = max(candidates, key=lambda n: sum(p.numel() for p in module.get_submodule(n).parameters()))
    if 2 * sum(p.numel() for p in module.get_submodule(largest).parameters()) > total:
        return largest, module.get_submodule(largest)
    # blocks held in an nn.ModuleDict holding most of the parameters: its blocks' inner lists are the candidates,
    # none of which is the body the user means
    holders = [(n, m) for n, m in module.named_modules() if n and isinstance(m, nn.ModuleDict)
               and 2 * sum(p.numel() for p in m.parameters()) > total]
    hint = (f"; `self.{holders[-1][0]}`, which holds most of them, is an nn.{type(holders[-1][1]).__name__}, which "
            "cannot be a body: hold its blocks in an nn.ModuleList (called in a loop) or an nn.Sequential") \
        if holders else f". Name the one to pipeline with PipeStrategy(body=...), e.g. PipeStrategy(body={candidates[0]!r})"
    raise ConfigurationError(
        f"{type(module).__name__} has several bodies to choose from: {candidates}, none holding most of the "
        f"parameters{hint}"
    )


def _refuse_released(path: str, found: nn.Module) -> None:
    if isinstance(found, StandIn):
        raise ConfigurationError(
            f"`{path}` holds only stage {found.stage_index} of a body split by an earlier PipeStrategy run that did "
            "not put the whole model back (gather_full_model=False, or a fit that failed); build the module anew or "
            "load it from a checkpoint"
        )


def _candidates(module: nn.Module) -> List[str]:
    found = []
    for name, child in module.named_modules():
        if not name or not isinstance(child, BODY_KINDS) and not isinstance(child, StandIn):
            continue
        if any(name.startswith(outer + ".") for outer in found):
            continue
        found.append(name)
    return found


def set_submodule(root: nn.Module, path: str, value: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, value)


class BodyReached(Exception):
    """Raised inside the user's step on the first stage once the body has produced its output."""

    def __init__(self, outputs: tuple) -> None:
        super().__init__("the first stage reached the end of its part of the body")
        self.outputs = outputs


_MODULE_STATE = frozenset(nn.Module().__dict__) | {"_compiled_call_impl"}  # nn.Module's own, not the user's
_PLAIN = (bool, int, float, str, type(None), enum.Enum)


def _same(a: object, b: object) -> bool:
    """Whether two attribute values are the same object, or equal plain values."""
    return a is b or isinstance(a, _PLAIN) and type(a) is type(b) and a == b


def _short(value: object) -> str:
    return repr(value) if isinstance(value, _PLAIN) else f"<{type(value).__name__}>"


def is_plain_state(name: str, value: object) -> bool:
    """Whether a module's attribute is plain state: a number, string, flag, enum, or a list, tuple or dict of them
    (PEFT's active adapters), or the module's ``training`` flag; not nn.Module's own bookkeeping."""
    if name in _MODULE_STATE:
        return name == "training"
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _PLAIN) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _PLAIN) and isinstance(v, _PLAIN) for k, v in value.items())
    return isinstance(value, _PLAIN)


class StandIn:
    """What both kinds of body share on a stage (a mixin of an ``nn.Module``): mode, replacement, checks.

    Subclasses hold the local layers under their original names and implement the body's own
    calling convention; :meth:`begin_step` and :meth:`end_step` bracket each run of the user's step.
    """

    def init_stand_in(self, stages: Sequence[int], num_stages: int) -> None:
        self.stages = tuple(stages)  # the stages this rank holds, in order
        self.stage_index = self.stages[0]
        self.num_stages = num_stages
        self.mode = "local"
        self.replacement: Optional[tuple] = None
        self.checkpoint_layers = False
        self.calls = 0
        self.input_asks_grad = False  # the last stage's body input asked for a gradient (see asks_for_gradient)
        self.modes: Optional[List[bool]] = None  # training_modes() as the step's run began (see refuse_changed_modes)

    def chunk(self, k: int) -> nn.Module:
        """What the pipeline runs for this rank's ``k``-th stage (the stand-in itself when it holds one;
        subclasses set ``chunks``)."""
        return self.chunks[k]

    def begin_step(self, mode: str, replacement: Optional[tuple] = None, checkpoint_layers: bool = False) -> None:
        # Plain values straight into __dict__: nn.Module.__setattr__ first looks for a parameter, buffer or
        # submodule of each name, and this runs twice per microbatch on the critical path.
        self.__dict__.update(mode=mode, replacement=replacement, checkpoint_layers=checkpoint_layers, calls=0,
                             grad_at_call=None, autocast_at_call=None, pack_at_call=None, swapped_at_call=False,
                             input_asks_grad=False,
                             modes=self.training_modes() if mode in ("stop", "replace") else None, attributes=None,
                             attributes_at_call=None)

    def every_layer(self) -> Sequence[nn.Module]:
        """Every layer of the body as the user's code sees it, other stages' copies included."""
        raise NotImplementedError

    def training_modes(self) -> List[bool]:
        """``training`` of the stand-in and of every module of every layer (the module list made once per list of
        layers: for a 32-block model about 400 flags, read in some 15 µs)."""
        layers = self.every_layer()
        cached = self.__dict__.get("_mode_modules")
        if cached is None or cached[0] is not layers:
            cached = self.__dict__["_mode_modules"] = (layers, [self, *dict.fromkeys(
                m for layer in layers for m in layer.modules())])
        return [m.training for m in cached[1]]

    def warn_layer_hooks(self) -> List[str]:
        """Warn once per hook about forward and backward hooks put on the body's layers by other code than torch's,
        Lightning's or ours (torch's own: ``weight_norm``, ``spectral_norm``, pruning masks); return what it warned
        about. Each layer runs on the process holding its stage, one microbatch at a time and apart from the step,
        so a hook changing values works as under DDP, while one recording values for the step records them only
        there (the last stage's step never sees those of other stages' layers); nothing can tell the two apart."""
        warned = self.__dict__.setdefault("_warned_hooks", set())
        found = []
        for index, layer in enumerate(self.every_layer()):
            for name, module in layer.named_modules():
                for kind, hooks in (("forward pre-hook", module._forward_pre_hooks),
                                    ("forward hook", module._forward_hooks),
                                    ("backward pre-hook", module._backward_pre_hooks),
                                    ("backward hook", module._backward_hooks)):
                    for key, hook in hooks.items():
                        if (id(module), key) in warned or _hook_origin(hook).startswith(_LIBRARIES):
                            continue
                        warned.add((id(module), key))
                        found.append(f"{kind} `{getattr(hook, '__qualname__', type(hook).__name__)}` on layer {index}"
                                     + (f" (its `{name}`)" if name else ""))
        if found:
            warnings.warn(
                f"PipeStrategy: the body's layers have hooks: {'; '.join(found)}. Each layer runs on the process "
                "holding its stage, one microbatch at a time, apart from your step. A hook that changes values "
                "(returns new inputs, outputs or gradients) works as under DDP; one that records values (activation "
                "statistics into a dict your step, a callback or a log reads) records them only on that process, "
                "once per microbatch, and the step (run on the last stage) never sees those of other stages' "
                "layers. Compute such values from the body's output in the step instead."
            )
        return found

    def attribute_values(self) -> List[tuple]:
        """The values of the attributes of every module of every layer, and of the objects they hold (a config the
        blocks share), by identity: what a step may set on the blocks just for the body call other than through
        the loop's blocks (`self.modules()`, PEFT's ``disable_adapter()``, ``self.config.use_lora = False``). A
        tuple of each ``__dict__``'s values, which compare by identity first: some 0.1 ms for a 32-block Llama (a
        dict of the flags alone took 1.2 ms); taken once a step (see .steps)."""
        layers = self.every_layer()
        cached = self.__dict__.get("_attribute_holders")
        if cached is None or cached[0] is not layers:
            self.training_modes()  # the module list, made once per list of layers
            modules = self.__dict__["_mode_modules"][1][1:]  # [0] is this stand-in
            held = {id(v): v for m in modules for name, v in m.__dict__.items() if name not in _MODULE_STATE
                    and not isinstance(v, (torch.Tensor, nn.Module, *_PLAIN)) and not callable(v)
                    and hasattr(v, "__dict__")}
            cached = self.__dict__["_attribute_holders"] = (layers, [*modules, *held.values()])
        return [tuple(vars(holder).values()) for holder in cached[1]]

    def note_call_context(self, first: bool = True) -> None:
        """At a call of the body (of a block: ``first`` for the loop's first), what the step called it under, for
        StepRunner.run's checks: gradients off (a body under no_grad), an autocast or saved-tensors hooks of the
        step's own, and (at the first call) parameters of its own."""
        self.__dict__.update(grad_at_call=torch.is_grad_enabled(), autocast_at_call=autocast_state(),
                             pack_at_call=saved_tensors_pack())
        if first:
            self.__dict__["swapped_at_call"] = swapped_parameters(self)

    def watch_attributes(self) -> None:
        """At the start of a step, on the process whose layers ran before the step did (the last stage's): take the
        attributes of the body's modules that :meth:`refuse_reverted_attributes` compares."""
        self.__dict__["attributes"] = self.attribute_values()

    def note_changed_attributes(self) -> None:
        """At the body call, on the process whose layers ran before the step did (the last stage's): note the
        attributes of the body's modules (:meth:`attribute_values`) the step changed since it began."""
        before = self.__dict__.get("attributes")
        if before is None:
            return
        now = self.attribute_values()
        try:
            unchanged = now == before
        except Exception:  # noqa: BLE001 (a tensor attribute replaced by another: `==` of two tensors)
            unchanged = False
        self.__dict__.update(attributes=None if unchanged else before, attributes_at_call=None if unchanged else now)

    def refuse_reverted_attributes(self, hook: str) -> None:
        """After the step: refuse the attributes it changed before the body call (:meth:`note_changed_attributes`)
        and put back after it, as ``with model.disable_adapter():`` does: set just for the body call, which the
        stages run apart from the step (the last stage before it, a middle stage never runs it), so they would not
        see them. A change the step keeps (a cache a shared module builds when the step calls it, a config field
        set for good) is left alone: most are read by the code around the blocks only, and those the blocks read
        reach the last stage's from the next microbatch on (a middle stage's never: see README)."""
        before, at_call = self.__dict__.get("attributes"), self.__dict__.get("attributes_at_call")
        if at_call is None:
            return
        self.__dict__.update(attributes=None, attributes_at_call=None)
        after = self.attribute_values()
        reverted = []  # (holder's place, attribute, value before, value at the call)
        for place, (holder, old, mid, new) in enumerate(zip(self.__dict__["_attribute_holders"][1], before, at_call,
                                                            after)):
            if len(old) == len(mid) == len(new):
                reverted += [(place, key, was, value) for key, was, value, end in zip(vars(holder), old, mid, new)
                             if not _same(was, value) and _same(was, end)]
        if not reverted:
            return  # changes the step keeps (a cache built, a config field set) are common: named only when refused
        names = self._holder_names()
        reverted = [f"`{'.'.join(p for p in (names[place], key) if p)}` {_short(was)} -> {_short(value)}"
                    for place, key, was, value in reverted]
        self.begin_step("local")
        raise BodyCallError(
            f"{hook} changed attributes of the body's modules just for the body call (set before it, put back after "
            f"it): {', '.join(reverted[:5])}{f' and {len(reverted) - 5} more' if len(reverted) > 5 else ''} (set "
            "through `self.modules()`, PEFT's `disable_adapter()`, or a config object the blocks share). Under "
            "PipeStrategy the stages run their layers apart from your step (the last stage before it, a middle stage "
            "never runs it), so they would not see them. Set such values in a hook every process runs before the step "
            "(`on_train_batch_start`, `on_validation_batch_start`), or pass them to the blocks as arguments"
        )

    def _holder_names(self) -> List[str]:
        """The name under the body of each holder of :meth:`attribute_values` (a held object: its holder's and
        attribute's)."""
        found = {}
        for layer_name, layer in zip(self.layer_names(), self.every_layer()):
            for name, module in layer.named_modules():
                path = ".".join(p for p in (layer_name, name) if p)
                found.setdefault(id(module), path)
                for key, value in module.__dict__.items():
                    found.setdefault(id(value), f"{path}.{key}")
        return [found.get(id(holder), "?") for holder in self.__dict__["_attribute_holders"][1]]

    def refuse_changed_modes(self, hook: str, when: str) -> None:
        """Refuse a step that switched the body's layers to another mode (``self.body.eval()``) since the run began:
        the stages run their layers apart from the step (the last one before it, a middle one never runs it), in the
        mode the process's copies had, so they would not see it."""
        if self.modes is not None and self.training_modes() != self.modes:
            self.begin_step("local")
            raise BodyCallError(
                f"{hook} changed the training mode of the body's layers {when} (e.g. `self.body.eval()`, "
                "`self.train()`, or one layer's `.train()`); under PipeStrategy the stages run their layers apart from "
                "your step (the last stage before it, a middle stage never runs it), in the mode Lightning set, so "
                "they would not see it. Switch modes in a hook every process runs before the step: "
                "`on_validation_model_eval` (e.g. call `self.body.train()` there after `super()."
                "on_validation_model_eval()` to keep dropout on), `on_train_batch_start` or `on_train_epoch_start`"
            )

    def reached(self) -> bool:
        """Whether the user's step has called the body since :meth:`begin_step`."""
        return self.calls > 0

    def end_step(self, hook: str, path: str) -> None:
        """Check how the user's step called the body; back to ``"local"``."""
        self.refuse_changed_modes(hook, "during the step")
        mode, calls = self.mode, self.calls
        self.begin_step("local")
        if mode == "replace" and calls != 1:
            raise BodyCallError(
                f"{hook} called the body `self.{path}` {calls} times in one step; under PipeStrategy it must be called "
                "exactly once (concatenate several inputs along the batch dimension and call it once)"
            )

    def refuse_if_released(self) -> None:
        if self.mode == "released":
            held = f"stage {self.stage_index}" if len(self.stages) == 1 else f"stages {list(self.stages)}"
            raise ConfigurationError(
                f"this body was trained under PipeStrategy(gather_full_model=False) and this process holds only "
                f"{held} of {self.num_stages}; load the whole model from a checkpoint "
                "(Module.load_from_checkpoint) or train with gather_full_model=True"
            )

    def _refuse_change(self, *args, **kwargs):
        raise ConfigurationError(
            f"the body's layers were changed (added, removed, replaced or copied into a new container) during fit; "
            f"under PipeStrategy they are split over {self.num_stages} stages, each process holding its own, so the "
            "body must keep its layers from setup to the end of fit. Change the model before trainer.fit (or in "
            "configure_model), or after it"
        )

    # the containers' own ways to change their layers (nn.Sequential's and nn.ModuleList's), on this stand-in
    __setitem__ = __delitem__ = __iadd__ = __add__ = __mul__ = __rmul__ = __imul__ = _refuse_change
    append = extend = insert = pop = _refuse_change

    def refuse_if_partial(self) -> None:
        """Outside the steps the pipeline runs ("local"), a process holding part of a split body cannot run it."""
        if self.mode == "local" and self.num_stages > 1:
            held = f"stage {self.stage_index}" if len(self.stages) == 1 else f"stages {list(self.stages)}"
            raise BodyCallError(
                f"the body was called outside the steps PipeStrategy pipelines (from a hook or a callback, e.g. "
                f"on_train_start or on_validation_epoch_end); during fit this process holds only {held} of "
                f"{self.num_stages}, so the call would run only those layers. Compute it in validation_step, test_step "
                "or predict_step (pipelined), or after trainer.fit, which puts the whole model back on every process "
                "(gather_full_model=True)"
            )

    def layer_names(self) -> List[str]:
        """The names of every layer of the body, this rank's and the other stages' (subclasses say)."""
        raise NotImplementedError

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """A whole model's state dict (pretrained weights loaded in ``on_fit_start``) holds every stage's layers:
        the other stages' keys are theirs to load, not unexpected here (each rank checks its own layers' keys)."""
        before = len(unexpected_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        others = set(self.layer_names()) - set(self._modules)
        unexpected_keys[before:] = [k for k in unexpected_keys[before:] if k[len(prefix):].split(".", 1)[0] not in others]

    def run_checkpointed(self, function, *inputs):
        """``function(*inputs)`` under activation checkpointing when asked (first stage only)."""
        if not self.checkpoint_layers:
            with reads_paused():
                return function(*inputs)
        tracker = current_tracker()  # the recomputation runs later, in backward: bind it again then

        def run(*args):
            with use_tracker(tracker):
                return function(*args)

        with reads_paused():
            return checkpointed(run, *inputs)


class PipelinedSequential(StandIn, nn.Sequential):
    """This rank's layers of an ``nn.Sequential`` body, called once from the user's unchanged step.

    Args:
        layers: the layers of each stage this rank holds (one dict per stage, in stage order).
        multi_value: whether layers pass several values (:class:`~lightning_pipe.SequentialModel`).
        stages: the stages this rank holds.
        num_stages: the number of stages.
    """

    def __init__(self, layers: Sequence["OrderedDict[str, nn.Module]"], multi_value: bool, stages: Sequence[int],
                 num_stages: int) -> None:
        nn.Sequential.__init__(self, OrderedDict((n, m) for part in layers for n, m in part.items()))
        self.init_stand_in(stages, num_stages)
        self.multi_value = multi_value
        # not registered: the layers' names stay the body's own (a second path would add state-dict keys). The
        # pipeline calls the chunks, the user's code the stand-in: outside a step it refuses (refuse_if_partial)
        self.__dict__["chunks"] = [SequentialChunk(self, part) for part in layers]

    # -- what the user's code sees: the whole body (see the module docstring) --------------------
    def _presented(self) -> List[nn.Module]:
        whole = self.__dict__.get("whole_layers")
        return list(self._modules.values()) if whole is None else whole

    def __len__(self) -> int:
        return len(self._presented())

    def layer_names(self) -> List[str]:
        return list(self.__dict__.get("whole_names") or self._modules)

    def __iter__(self):
        return iter(self._presented())

    def __getitem__(self, index):
        layers = self._presented()
        if isinstance(index, slice):
            names = list(self.__dict__.get("whole_names") or self._modules)
            return nn.Sequential(OrderedDict(zip(names[index], layers[index])))
        index = operator.index(index)
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"index {index} is out of range for a body of {len(layers)} layers")
        return layers[index]

    def run_layers(self, *inputs, layers: Optional[nn.Sequential] = None):
        """The registered (local) layers of ``layers`` (default: this rank's) on ``inputs``."""
        local = (self if layers is None else layers)._modules.values()  # never the presented whole body
        if self.multi_value:
            values = inputs
            for layer in local:
                out = layer(*values)
                values = out if isinstance(out, tuple) else (out,)
            return values[0] if len(values) == 1 else values
        if len(inputs) != 1:
            raise ConfigurationError(
                f"the body is an nn.Sequential, which takes one input, but stage {self.stage_index} got {len(inputs)}; "
                "use lightning_pipe.SequentialModel for layers that pass several values"
            )
        hidden = inputs[0]
        for layer in local:
            hidden = layer(hidden)
        return hidden

    def every_layer(self) -> Sequence[nn.Module]:
        whole = self.__dict__.get("whole_layers")  # set by present_whole_body; before it, the local layers
        return whole if whole is not None else self.__dict__.setdefault("_local_layers", list(self._modules.values()))

    def forward(self, *inputs):
        self.refuse_if_released()
        self.refuse_changed_modes("the step", "before calling it")
        self.note_changed_attributes()
        self.__dict__["calls"] += 1  # not nn.Module.__setattr__, which looks for a parameter of that name first
        self.note_call_context()
        if self.mode == "replace":
            self.__dict__["input_asks_grad"] = torch.is_grad_enabled() and asks_for_gradient(inputs)  # see .steps
            outputs = self.replacement
            return outputs[0] if len(outputs) == 1 else outputs
        self.refuse_if_partial()
        first = self.chunks[0]
        outputs = self.run_checkpointed(lambda *x: self.run_layers(*x, layers=first), *inputs)
        if self.mode == "stop":
            raise BodyReached(outputs if isinstance(outputs, tuple) else (outputs,))
        return outputs


def asks_for_gradient(inputs: Sequence[object]) -> bool:
    """Whether a body input is, or was computed from, a tensor other than a parameter with ``requires_grad``
    (``x.requires_grad_()`` for a saliency map or a gradient penalty; also the embeddings' output that Hugging
    Face's ``enable_input_require_grads`` marks, which nothing reads). Values the last stage computed from its
    copies of modules it does not train (:class:`.stale.Stale`) are left out. A pre-body graph is a few nodes;
    a longer one is walked up to 256."""
    for tensor in inputs:
        if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad or isinstance(tensor, Stale):
            continue
        if tensor.grad_fn is None:
            if not isinstance(tensor, nn.Parameter):
                return True
            continue
        nodes, seen = [tensor.grad_fn], set()
        while nodes and len(seen) < 256:
            node = nodes.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an AccumulateGrad: the leaf it accumulates into
            if variable is not None and not isinstance(variable, nn.Parameter):
                return True
            nodes.extend(next_node for next_node, _ in node.next_functions)
    return False


def present_whole_body(stand_in: StandIn, body: nn.Module) -> None:
    """Make an ``nn.Sequential`` stand-in present every layer of ``body`` to ``len``, iteration and indexing.

    ``body`` is the unsplit body (other stages' layers in it released to ``meta``); only the
    stand-in's registered children (the local layers) are its parameters, state and computation.
    A ``nn.ModuleList`` stand-in presents the whole list already; for it this does nothing.
    """
    if isinstance(stand_in, PipelinedSequential):
        stand_in.__dict__["whole_layers"] = list(body._modules.values())  # not registered: no new state-dict keys
        stand_in.__dict__["whole_names"] = list(body._modules)


class SequentialChunk(nn.Sequential):
    """One stage of this rank: that stage's layers of the stand-in, as the pipeline runs them (the user's code
    calls the stand-in, which runs them only inside a pipelined step).

    It registers the same layer objects as the stand-in, but it is no part of the LightningModule.
    """

    def __init__(self, owner: PipelinedSequential, layers: "OrderedDict[str, nn.Module]") -> None:
        super().__init__(layers)
        self.__dict__["owner"] = owner  # not a submodule

    def forward(self, *inputs):
        self.owner.refuse_if_released()
        return self.owner.run_layers(*inputs, layers=self)
