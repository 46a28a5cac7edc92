"""What a user's step changes besides its result: state other stages need, and side effects to refuse.

Under PipeStrategy the user's step runs once per microbatch: up to the body on the first stage,
and whole on the last one. Two consequences are handled here.

- **State built in the step** (``self.val_scores.append(...)`` after the body call) exists only on
  the last stage. :class:`StepEffects` notes which attributes of the LightningModule the last
  stage's step runs assign or grow, and :meth:`StepEffects.shared_state` hands them to the other
  stages at epoch end, so epoch-end hooks compute the same thing on every rank, as under DDP.
- **Side effects** that would happen once per microbatch instead of once per batch: a parameter
  changed in place by the step (an EMA teacher updated in ``training_step``), or a buffer
  registered on the LightningModule itself changed in place (a queue, its pointer), raise
  :class:`~lightning_pipe.errors.SideEffectError`, checked after the first run of each kind of step
  and after every whole step (an update that starts late); a number attribute changed by the step
  (a counter) or a list it appends to gets a one-time warning on the first step of each kind.
- **Optimizer settings** (a learning rate written into ``param_groups``, ``scheduler.step()``)
  changed by a training step would change once per microbatch, and only on the stages that ran
  that code, never on the middle ones: :func:`refuse_changed_settings` raises
  :class:`~lightning_pipe.errors.SideEffectError` (checked after every training step).
- **Buffers of submodules updated in their forward** (a running count, an EMA codebook as in a
  VQ-VAE) are updated once per microbatch, ``num_microbatches`` times per step instead of once:
  inherent to microbatching. :class:`BufferWatch` compares every buffer of the module this rank
  holds (``_version`` and identity) before and after the first training step that has several
  microbatches and warns once, naming the buffers that changed. Normalization running statistics
  (BatchNorm, InstanceNorm with ``track_running_stats``, DeferredBatchNorm) are left out whether or
  not ``deferred_batch_norm`` is set: with it they are updated once per batch, and without it
  their per-microbatch update is the documented behaviour of ``deferred_batch_norm=False``.
  Buffers registered on the LightningModule itself are the step's own side effects (above).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Set, Tuple

import warnings

import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_pipe.errors import SideEffectError

_OWN = {"log"}  # instance attributes lightning_pipe itself puts on the module while a step runs
_baseline: Optional[Set[str]] = None


def _lightning_attributes() -> Set[str]:
    """The instance attributes a LightningModule has before the user adds any."""
    global _baseline
    if _baseline is None:
        _baseline = set(vars(LightningModule()))
    return _baseline


def user_attributes(module: nn.Module) -> Iterator[Tuple[str, Any]]:
    baseline = _lightning_attributes()
    for name, value in vars(module).items():
        if name not in baseline and name not in _OWN and not isinstance(value, nn.Module):
            yield name, value


def _fingerprint(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, (list, dict, set, tuple)) or hasattr(value, "__len__") and hasattr(value, "append"):
        return (type(value), id(value), len(value))
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return id(value)


class Snapshot:
    """The state before one run of the user's step."""

    def __init__(self, effects: "StepEffects", check: bool) -> None:
        module = effects.module
        self.attributes = {name: _fingerprint(value) for name, value in user_attributes(module)}
        # the first run of its hook (and several microbatches): refuse in-place updates, warn about lists and counters
        self.versions = effects.versions(module.parameters()) if check else None
        self.changes: Optional[List[Tuple[str, Any, Any]]] = None  # found once, when the run has ended


class StepEffects:
    """Watches the runs of the user's step on this stage.

    Args:
        module: the LightningModule.
        num_microbatches: microbatches per batch (side effects matter only above one).
    """

    def __init__(self, module: nn.Module, num_microbatches: int) -> None:
        self.module = module
        self.num_microbatches = num_microbatches
        self.built: Set[str] = set()
        self.warns = True  # whether this process warns about the step's lists and counters (see after)
        self._checked: Set[str] = set()
        self._warned: Set[str] = set()

    def watched(self) -> List[Tuple[str, torch.Tensor]]:
        """Every parameter, and the buffers registered on the LightningModule itself."""
        return list(self.module.named_parameters(remove_duplicate=False)) + list(self.module._buffers.items())

    def versions(self, parameters: Iterable[torch.Tensor]) -> Optional[List[Tuple[torch.Tensor, int]]]:
        """Before a step: each of the module's ``parameters`` (all of them: the caller walks them once a step
        anyway), each of its own buffers, and their versions (None with one microbatch: nothing to refuse).

        Taken around every whole step too, not only around the first run of each hook, so that an update
        that starts in a later step (an EMA from step 1000 on) is refused on that step.
        """
        if self.num_microbatches < 2:
            return None
        return [(t, t._version) for t in parameters] + [  # an inference tensor has no version
            (t, t._version) for t in self.module._buffers.values() if t is not None and not t.is_inference()]

    def refuse_updated(self, hook: str, versions: Optional[List[Tuple[torch.Tensor, int]]]) -> None:
        """After a step: refuse the watched tensors it changed in place (``versions`` from :meth:`versions`)."""
        if versions is None:
            return
        touched = {id(t) for t, version in versions if t._version != version}
        if not touched:
            return
        names = list(dict.fromkeys(name for name, t in self.watched() if id(t) in touched))
        where = (f"({self.num_microbatches} per batch): the code before the body call on the first and the last "
                 "stage, the rest on the last stage, and the body's layers on the processes that hold them")
        if hook == "training_step":
            raise SideEffectError(
                f"{hook} changed {names} in place. Under PipeStrategy the step runs once per microbatch {where}, so "
                "this update happened once per microbatch instead of once per batch. Move it to a hook that runs "
                "once per batch on every rank, e.g. on_train_batch_end or on_before_optimizer_step"
            )
        stage = hook.split("_")[0]  # an evaluation step changes weights to evaluate others (EMA weights swapped in)
        raise SideEffectError(
            f"{hook} changed {names} in place. Under PipeStrategy the step runs once per microbatch {where}, so "
            "weights swapped in around the body call reach only the layers of the processes that run that code, "
            "once per microbatch; the other stages' layers compute with their own. Swap weights in hooks every "
            f"rank runs once, on_{stage}_epoch_start and on_{stage}_epoch_end, or use Lightning's "
            "WeightAveraging callback (EMAWeightAveraging), which PipeStrategy supports"
        )

    def before(self, hook: str, whole: bool = True) -> Optional[Snapshot]:
        """The state before a run of ``hook``; None for a run that stops at the body (``whole=False``) once the
        hook's side effects were checked: nothing of such a run is noted after that."""
        check = hook not in self._checked and self.num_microbatches > 1
        return Snapshot(self, check) if whole or check else None

    def after(self, hook: str, snapshot: Optional[Snapshot], last_stage: bool) -> None:
        """Note what the run changed; refuse or warn about side effects (first run of ``hook`` only)."""
        if snapshot is None:
            return
        changed = [name for name, _, _ in self._changes(snapshot)]
        if last_stage:
            self.built.update(changed)
        if snapshot.versions is None:
            return
        if last_stage or not self.warns:  # a process that also runs the step whole (ZB-V's process 0) checks that run
            self._checked.add(hook)
        self.refuse_updated(hook, snapshot.versions)  # before the rest of the first step, which may fail otherwise
        if not (last_stage and self.warns):
            return  # warned where the step runs whole (the last stage: not global rank 0, so not rank_zero_warn)
        lists = [n for n in self.grown(snapshot) if isinstance(getattr(self.module, n), list) and n not in self._warned]
        if lists:
            self._warned.update(lists)
            warnings.warn(
                f"{hook} appended to `self.{', self.'.join(lists)}`: under PipeStrategy the step runs once per "
                f"microbatch ({self.num_microbatches} per batch), so such a list gets one entry per microbatch. "
                "Per-sample values concatenate to the batch's, but a mean over per-step values (a loss) then weighs "
                "microbatches, which differ in size on a short batch, instead of batches. To keep one entry per batch, "
                "append the `outputs` that on_train_batch_end / on_validation_batch_end receive (the whole batch's, on "
                "every rank)"
            )
        counters = [n for n in changed if isinstance(getattr(self.module, n), (int, float)) and n not in self._warned]
        if counters:
            self._warned.update(counters)
            warnings.warn(
                f"{hook} changed `self.{', self.'.join(counters)}`: under PipeStrategy the step runs once per microbatch "
                f"({self.num_microbatches} per batch), so a counter grows {self.num_microbatches} times per batch (one "
                "that adds the batch size still sums to it). Count in on_train_batch_end to count batches"
            )

    def _changes(self, snapshot: Snapshot) -> List[Tuple[str, Any, Any]]:
        """``(name, value, before)`` per attribute the run changed; ``before`` is the object's fingerprint before
        the run where the run changed the same object in place (a list appended to, a tensor written), else None.

        Called once the run has ended (by :meth:`after`, :meth:`grown` and :meth:`new_values`, every microbatch),
        so found once and kept on the snapshot.
        """
        if snapshot.changes is None:
            snapshot.changes = []
            for name, value in user_attributes(self.module):
                before, now = snapshot.attributes.get(name, _MISSING), _fingerprint(value)
                if before != now:
                    in_place = isinstance(before, tuple) and isinstance(now, tuple) and before[:2] == now[:2]
                    snapshot.changes.append((name, value, before if in_place else None))
        return snapshot.changes

    def grown(self, snapshot: Snapshot) -> List[str]:
        """The attributes whose own object the run changed in place (a list appended to, a tensor written)."""
        return [name for name, _, before in self._changes(snapshot) if before is not None]

    def new_values(self, snapshot: Snapshot) -> Iterator[Tuple[str, Any]]:
        """What the run stored in attributes: the entries appended to a list, else the attribute's new value."""
        for name, value, before in self._changes(snapshot):
            yield name, value[before[2]:] if before is not None and type(value) is list else value

    def shared_state(self) -> Dict[str, Any]:
        """The attributes the last stage's step built, to give to the other stages."""
        return {name: getattr(self.module, name) for name in sorted(self.built) if hasattr(self.module, name)}

    def load_shared_state(self, state: Dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self.module, name, value)


_MISSING = object()


def _stateful_buffers(module: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The buffers of ``module``'s submodules that a forward could update, held on this rank.

    Left out: normalization running statistics (see the module docstring), released (meta) buffers
    and the LightningModule's own buffers (checked as the step's side effects by :class:`StepEffects`).
    """
    out = []
    for prefix, sub in module.named_modules():
        if not prefix or isinstance(sub, nn.modules.batchnorm._NormBase):
            continue
        for name, buffer in sub._buffers.items():
            if buffer is not None and not buffer.is_meta:
                out.append((f"{prefix}.{name}", buffer))
    return out


class BufferWatch:
    """Warns once when the first training step updated submodules' buffers more than once.

    A buffer a module's forward updates (a running count, an EMA, spectral_norm's power-iteration
    vectors) is updated once per microbatch, and again for each microbatch whose forward activation
    checkpointing recomputes in backward. Call :meth:`before` before the pipeline runs the step and
    :meth:`after` once it has (on every stage: the body's layers update their buffers in the
    pipeline's forward, which on a middle stage runs no user code). Both do nothing after the first
    check.

    Args:
        module: the LightningModule (its body being this rank's stand-in).
        checkpoint: PipeStrategy's ``checkpoint`` mode.
        body: the body's attribute path: only its layers are recomputed (never the code around them).
    """

    def __init__(self, module: nn.Module, checkpoint: str = "never", body: str = "body") -> None:
        self.module = module
        self.checkpoint = checkpoint
        self.body = body + "."
        self.done = False

    def before(self) -> Optional[Dict[str, Tuple[int, int]]]:
        if self.done:
            return None
        return {name: (id(b), b._version) for name, b in _stateful_buffers(self.module)}

    def after(self, snapshot: Optional[Dict[str, Tuple[int, int]]], num_microbatches: int) -> List[str]:
        """Warn about the buffers changed since ``snapshot``; return their names (empty when none or not checked).

        Example:
            >>> body = nn.utils.spectral_norm(nn.Linear(2, 2))
            >>> watch = BufferWatch(nn.ModuleDict({"body": body}), checkpoint="always")
            >>> snapshot = watch.before()
            >>> _ = body(torch.ones(1, 2))
            >>> with warnings.catch_warnings(record=True) as caught:
            ...     warnings.simplefilter("always")
            ...     watch.after(snapshot, num_microbatches=1)
            ['body.weight_u', 'body.weight_v']
            >>> "recomputes" in str(caught[0].message)
            True
        """
        recomputes = self.checkpoint == "always" or (self.checkpoint == "except_last" and num_microbatches > 1)
        if snapshot is None or (num_microbatches < 2 and not recomputes):
            return []  # one forward per step, as without PipeStrategy
        self.done = True
        changed = [name for name, b in _stateful_buffers(self.module)
                   if name in snapshot and snapshot[name] != (id(b), b._version)]
        recomputed = recomputes and any(name.startswith(self.body) for name in changed)
        if num_microbatches < 2:
            changed = [name for name in changed if name.startswith(self.body)]  # the rest ran once, as in one process
        if not changed:
            return changed
        names = f"buffer{'s' if len(changed) > 1 else ''} `{'`, `'.join(changed)}`"
        if num_microbatches > 1:
            again = " (and again when activation checkpointing recomputes the forward in backward)" if recomputed else ""
            warnings.warn(
                f"PipeStrategy: the {names} changed in the training step. A module's forward runs once per "
                f"microbatch, so such a buffer (a running count, an EMA) is updated once per microbatch, "
                f"{num_microbatches} times per step instead of once{again}: inherent to microbatching. Account for it "
                "in the update (e.g. a momentum per microbatch), update the buffer once per batch in "
                "on_train_batch_end, or use num_microbatches=1. (BatchNorm running statistics are left out here: "
                "PipeStrategy(deferred_batch_norm=True) updates them once per batch.)",
            )
        else:
            warnings.warn(
                f"PipeStrategy: the {names} changed in the training step, and checkpoint={self.checkpoint!r} "
                "recomputes the forward in backward: such a buffer (a running count, an EMA, spectral_norm's "
                "power-iteration vectors) is updated twice per step instead of once, and the gradients come from the "
                "recomputed forward, which sees the updated value (as torch.utils.checkpoint does in one process). "
                "Use checkpoint='never' for such a model, or update the buffer once per batch in on_train_batch_end.",
            )
        return changed


def optimizer_settings(trainer: Any) -> List[Tuple[str, Dict[str, Any]]]:
    """What a training step must leave alone: each param group's settings (``lr``, ``momentum``, ...) of each
    optimizer, and each learning-rate scheduler's step count, as ``(where, settings)`` pairs."""
    settings = [(f"optimizer {i} param group {j}", {k: _kept(v) for k, v in group.items() if k != "params"})
                for i, optimizer in enumerate(trainer.optimizers) for j, group in enumerate(optimizer.param_groups)]
    settings += [(f"lr scheduler {i}", {k: getattr(config.scheduler, k) for k in ("last_epoch", "_step_count")
                                        if hasattr(config.scheduler, k)})
                 for i, config in enumerate(trainer.lr_scheduler_configs)]
    return settings


def refuse_changed_settings(hook: str, before: List[Tuple[str, Dict[str, Any]]], trainer: Any) -> None:
    """After a step: refuse a change of :func:`optimizer_settings` since ``before``.

    Example:
        >>> from types import SimpleNamespace
        >>> optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> trainer = SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=[])
        >>> before = optimizer_settings(trainer)
        >>> optimizer.param_groups[0]["lr"] = 0.05
        >>> refuse_changed_settings("training_step", before, trainer)
        Traceback (most recent call last):
        ...
        lightning_pipe.errors.SideEffectError: training_step changed optimizer 0 param group 0: lr 0.1 -> 0.05. ...
    """
    after = dict(optimizer_settings(trainer))
    changes = []
    for where, settings in before:
        now = after.get(where, {})
        changes += [f"{where}: {key} {value} -> {now.get(key)}" for key, value in settings.items()
                    if not _same(value, now.get(key))]
    if changes or len(after) != len(before):
        raise SideEffectError(
            f"{hook} changed {'; '.join(changes) or 'the optimizers'}. Under PipeStrategy the step runs once per "
            "microbatch: the code before the body call on the first and the last stage, the rest on the last stage "
            "only, and none of it on the stages between, so their optimizers would keep the old settings and a "
            "scheduler would step once per microbatch. Set them where Lightning does it once per batch on every "
            "rank: a learning-rate scheduler from configure_optimizers (interval='step' for a warm-up), or the "
            "optimizer_step or on_train_batch_start hook"
        )


def _kept(value: Any) -> Any:
    """A setting as :func:`optimizer_settings` keeps it: a tensor (a capturable optimizer's lr) by its version, no
    copy and no device sync to compare; an inference tensor, which has no version, as a copy."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.clone() if value.is_inference() else _Version(value, value._version)


class _Version(NamedTuple):
    tensor: torch.Tensor
    version: int

    def __repr__(self) -> str:  # the tensor's value now, before and after a write in place
        return f"{self.tensor!r} (version {self.version})"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, _Version) or isinstance(b, _Version):
        return isinstance(a, _Version) and isinstance(b, _Version) and a.tensor is b.tensor and a.version == b.version
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return a is b or bool(a == b)
    except Exception:  # a value with no truth to its comparison (a NumPy array): not checked
        return True
