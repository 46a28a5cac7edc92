"""No rank keeps what it does not run: other stages' layers, and modules outside the body it never calls.

Released parameters and buffers are replaced by ``meta`` tensors of the same shape (new objects,
so a tied copy that this rank does run keeps its real tensor), and optimizers that held a released
parameter hold its meta stand-in instead. Structure stays: the model summary still counts every
layer. Non-persistent buffers (computed in ``__init__``, in no checkpoint) are kept. When they are
released:

- at setup, every body layer of another stage, on every rank; and on the stages between the first
  and the last, which run no code of the user's step, every module outside the body;
- after the first training step, on the first and the last stage, the modules outside the body
  that the step did not use there (call, or read a parameter or buffer of, as in
  ``self.pos.weight[:n]``) and that got no gradient there (the first stage, for instance, never
  runs the head after the body). The stage that owns a module's parameters (see
  :meth:`.split.SplitModel.learn_usage`) always keeps it, so that checkpoints hold its weights.

A module released after the first step refuses to run (:func:`refuse_calls`): calling it later
(first used after the first step, or only in ``validation_step``) raises
:class:`~lightning_pipe.errors.ConfigurationError` naming it, instead of torch's error about meta tensors.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_pipe.errors import BodyCallError, ConfigurationError

try:
    from torchmetrics import Metric
except ImportError:  # pragma: no cover
    Metric = ()  # type: ignore[assignment,misc]


def tensor_ids(modules: Iterable[nn.Module]) -> Set[int]:
    return {id(t) for m in modules for t in list(m.parameters()) + list(m.buffers())}


def release(modules: Iterable[nn.Module], keep: Set[int], optimizers: Sequence[torch.optim.Optimizer] = ()) -> int:
    """Replace the tensors owned directly by ``modules`` (except those in ``keep``) by meta tensors.

    Returns:
        The bytes released.
    """
    swapped: Dict[int, nn.Parameter] = {}
    originals: List[nn.Parameter] = []
    released = 0
    for module in modules:
        for name, p in list(module._parameters.items()):
            if p is None or p.is_meta or id(p) in keep:
                continue
            if id(p) not in swapped:
                released += p.numel() * p.element_size()
                originals.append(p)
                swapped[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            module._parameters[name] = swapped[id(p)]
        for name, b in list(module._buffers.items()):
            # non-persistent buffers (a rotary table, a causal mask) are in no checkpoint: kept everywhere
            if b is not None and not b.is_meta and id(b) not in keep and name not in module._non_persistent_buffers_set:
                released += b.numel() * b.element_size()
                module._buffers[name] = torch.empty_like(b, device="meta")
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [swapped.get(id(p), p) for p in group["params"]]
        for p in originals:  # state loaded from a checkpoint for a copy that another stage trains
            optimizer.state.pop(p, None)
    return released


def outside_body(module: nn.Module, body_path: str) -> List[nn.Module]:
    """The modules outside the body that own tensors directly (the LightningModule itself included).

    torchmetrics ``Metric`` objects are left out: every stage keeps their states for logging.
    """
    return [sub for _, sub in named_outside_body(module, body_path)]


def named_outside_body(module: nn.Module, body_path: str) -> List[Tuple[str, nn.Module]]:
    """:func:`outside_body` with each module's path in ``module`` (``""``: the LightningModule)."""
    metrics = {id(m) for m in module.modules() if isinstance(m, Metric) for m in m.modules()}
    out = []
    for name, sub in module.named_modules():
        if name == body_path or name.startswith(body_path + ".") or id(sub) in metrics:
            continue
        if sub._parameters or sub._buffers:
            out.append((name, sub))
    return out


def is_released(module: nn.Module) -> bool:
    """Whether some parameter or buffer owned directly by ``module`` is a released (meta) tensor."""
    return any(t is not None and t.is_meta for t in list(module._parameters.values()) + list(module._buffers.values()))


def explain_meta_error(error: Exception, module: nn.Module, body_path: str, hook: str) -> None:
    """Raise a named error for torch's about a meta tensor in the user's step: this process released modules outside
    the body (a parameter of one read as an attribute, ``self.post.weight``, which no hook sees, in a step that the
    first training step did not show, a validation step say), or holds part of the body, whose other layers are meta
    copies here (:func:`refuse_other_stages_values`). Returns for any other error."""
    if "meta" not in str(error):
        return
    released = [path or "the LightningModule" for path, m in named_outside_body(module, body_path) if is_released(m)]
    if not released:
        refuse_other_stages_values(module, body_path, f"{hook} computed with a tensor on the meta device ({error})",
                                   error)
        return
    raise ConfigurationError(
        f"{hook} computed with a tensor on the meta device ({error}). On this process PipeStrategy released the "
        f"weights of {[f'self.{p}' for p in released]} after the first training step, which neither used them "
        "here nor computed a gradient for them here: a parameter or buffer of one read as an attribute (`x @ "
        "self.proj.weight`) has no values. A module must be used from the first training step on by the stages "
        "that will use it; fix: read it in every training step from the first (e.g. add `0.0 * "
        "self.proj.weight.sum()` to the loss), or do the work outside the LightningModule"
    ) from error


def refuse_other_stages_values(module: nn.Module, body_path: str, what: str, cause: Optional[Exception] = None) -> None:
    """Raise :class:`~lightning_pipe.errors.BodyCallError` saying ``what`` came from another stage's layers, when
    this process holds only part of the body: the layers it presents for the others are meta copies
    (``self.body[0].weight`` read in the step on the last stage: a penalty on it, a logged norm)."""
    stand_in = module.get_submodule(body_path)
    num_stages, stages = getattr(stand_in, "num_stages", 1), getattr(stand_in, "stages", ())
    if num_stages == 1:
        return
    held = f"stage {stages[0]}" if len(stages) == 1 else f"stages {list(stages)}"
    raise BodyCallError(
        f"{what}: under PipeStrategy this process holds {held} of the {num_stages} stages of `self.{body_path}`, and "
        f"the layers of the other stages are meta copies here (no values), so a value computed from one (e.g. a penalty "
        f"on `self.{body_path}[0].weight`, or its norm logged, in the step on the last stage) cannot be computed. Use "
        "a layer's weights only inside the body, where its stage runs them; a penalty on weights can be the "
        "optimizer's weight_decay" + (
            f". If the step calls the layers of `self.{body_path}` one by one (`for layer in self.{body_path}: x = "
            f"layer(x)`): an nn.Sequential body is called whole (`self.{body_path}(x)`); blocks a loop calls belong "
            "in an nn.ModuleList" if isinstance(stand_in, nn.Sequential) else "")
    ) from cause


def refuse_calls(module: nn.Module, path: str, where: str) -> object:
    """Make a released module raise a named error when called (its tensors are meta: nothing to compute with).

    Args:
        module: the released module.
        path: its attribute path in the LightningModule.
        where: the process's place in the pipeline, for the message (e.g. ``"pipeline rank 0 (stage 0)"``).

    Returns:
        The hook's handle.
    """
    name = f"self.{path}" if path else "the LightningModule"

    def refuse(m: nn.Module, args: tuple) -> None:
        from lightning_pipe.lightning.layer_list import refuse_stand_ins  # imports this module

        # given a block's stand-in output: the loop stopped before the body's last block (fewer blocks than in the
        # first step), which is what to name, not this module's release
        refuse_stand_ins(args, f"a call of {name}")
        raise ConfigurationError(
            f"{name} ({type(m).__name__}) was called on {where}, where PipeStrategy released its weights after the "
            "first training step: that step neither called it here nor computed a gradient for it here, so its memory "
            "was freed (only the stage that uses it keeps it). A module must be used from the first training step on "
            "by the stages that will use it: a module first used after the first step, or used only in "
            "validation/test/predict steps on this stage, cannot run here. Fix: call it in every training step from "
            f"the first (e.g. add `0.0 * {name}(...).sum()` to the loss until it is really used), or do the work "
            "outside the LightningModule"
        )

    return module.register_forward_pre_hook(refuse)


class _Reads(TorchFunctionMode):
    """Notes the owners of the tensors a torch function takes (``owners``: tensor id -> the ids to note).

    A parameter or buffer read as an attribute (``self.pos.weight[:n]``, ``x @ self.proj.weight``)
    passes through no module call; only a torch function mode sees it. Arguments are looked at one
    list deep, as torch functions take tensors (``torch.cat([h, self.cls.weight])``).
    """

    def __init__(self, owners: Dict[int, Tuple[int, ...]], used: Set[int]) -> None:
        super().__init__()
        self.owners, self.used = owners, used
        self.paused = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        for arg in () if self.paused else (*args, *kwargs.values()):
            for leaf in arg if isinstance(arg, (list, tuple)) else (arg,):
                owner = self.owners.get(id(leaf))
                if owner is not None:
                    self.used.update(owner)
        return func(*args, **kwargs)


_READS: Optional[_Reads] = None  # set while uses_recorded records: the mode reads_recorded enters


@contextmanager
def uses_recorded(module: nn.Module, body_path: str) -> Iterator[Set[int]]:
    """Collect the ids of the modules called inside the block, and of the modules outside the body whose own
    parameters or buffers the user's code inside :func:`reads_recorded` reads (the module itself is not called);
    for the LightningModule's own parameters and buffers, also the ids of those read.

    Reads count only there: the machinery around the user's step reads every parameter (snapshots, gradients).
    """
    global _READS
    used: Set[int] = set()
    # the LightningModule's own tensors are noted one by one too (by id: never a module's while both live), since
    # it holds unrelated ones (a `pos_embed` read before the body, a `temperature` after it)
    owners = {id(t): (id(m), id(t)) if m is module else (id(m),) for _, m in named_outside_body(module, body_path)
              for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None}
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, args: used.add(id(m)))
    outer, _READS = _READS, _Reads(owners, used)
    try:
        yield used
    finally:
        handle.remove()
        _READS = outer


def reads_recorded() -> Any:
    """Around the user's own code: record the reads :func:`uses_recorded` collects (a no-op when it does not)."""
    return _READS if _READS is not None else nullcontext()


@contextmanager
def reads_paused() -> Iterator[None]:
    """Around the body's layers run from inside the user's step (the first stage): nothing of theirs to note, and
    a block compiled with ``torch.compile`` would otherwise be traced through the mode's look at every input's
    ``id``, guarding on it: recompiled for each new tensor until dynamo's limit, then run uncompiled for good."""
    reads = _READS
    if reads is None or reads.paused:
        yield
        return
    reads.paused = True
    try:
        yield
    finally:
        reads.paused = False


def unrelease(module: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer of ``module`` real, uninitialized memory on ``device``."""
    swapped: Dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in swapped:
                    swapped[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                sub._parameters[name] = swapped[id(p)]
        for name, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                sub._buffers[name] = torch.empty_like(b, device=device)


def model_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of the whole model, released ones included."""
    seen: Set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA's free bytes, or the host's MemAvailable (a large number if unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62
