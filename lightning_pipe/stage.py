"""One stage's forward and backward for one microbatch, with no communication.

The stage keeps, per pending microbatch, what its backward needs: the inputs it received (leaves
whose ``.grad`` becomes the gradient to send back), the outputs (or the loss) to backpropagate
from, and the skip tensors it received or stashed for later stages. It applies the checkpoint
policy and counts activation memory. The backward runs whole (``B``) or in two parts (``I``, then
``W``; see :mod:`lightning_pipe.split_backward`); a microbatch's activations count until the
part that frees them.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_pipe import rng
from lightning_pipe.batchnorm import DeferredBatchNorm
from lightning_pipe.checkpoint import Recomputation, checkpointed, is_recomputing, should_checkpoint
from lightning_pipe.errors import PipelineStepError
from lightning_pipe.memory import ActivationMeter, MeterOff
from lightning_pipe.skip.skippable import Skippable
from lightning_pipe.skip.tracker import Key, SkipTracker, use_tracker
from lightning_pipe.split_backward import WeightGradients, backward_input, run_backward


def as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def needs_grad(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad


class _Pending(NamedTuple):
    inputs: tuple  # what the stage received (leaves) or was given
    roots: tuple  # what backward starts from: the outputs, or the loss on the last stage
    tracker: SkipTracker  # skip tensors of this microbatch: received ones and stashed ones
    incoming: Tuple[Key, ...]  # keys of the skip tensors received from earlier stages
    recomputation: Optional[Recomputation]  # a checkpointed forward under a split backward


class Stage:
    """Runs one pipeline stage's module, microbatch by microbatch.

    Args:
        module: the layers of this stage; called as ``module(*inputs)``.
        stage_index: position of this stage in the pipeline.
        num_stages: number of stages.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        device: the device whose generator is seeded per microbatch (besides the CPU's).
        split_backward: whether backwards run as ``I`` then ``W`` (checkpointed forwards are
            then recomputed once for both, see :class:`~lightning_pipe.checkpoint.Recomputation`).
        meter_parent: a meter that sums this stage's activation bytes with other stages'.
        count_activations: count the activation bytes each microbatch holds (``meter``); off, the
            meter is a :class:`~lightning_pipe.memory.MeterOff`.

    Each forward of microbatch ``i`` starts from the random state ``rng.derive(step_seed, i,
    stage_index)`` when ``step_seed`` is set (the pipeline sets it every step), so dropout draws
    the same numbers whatever the schedule's order.
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, checkpoint: str = "never",
                 device: torch.device = torch.device("cpu"), split_backward: bool = False,
                 meter_parent: Optional[ActivationMeter] = None, count_activations: bool = False) -> None:
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.checkpoint = checkpoint
        self.device = device
        self.split_backward = split_backward
        self.step_seed: Optional[int] = None
        self.microbatch_index = 0  # of the forward running or last run
        self.meter = ActivationMeter(module.parameters(), meter_parent) if count_activations else MeterOff()
        self._skippable = any(isinstance(m, Skippable) for m in module.modules())
        # a stage whose first layer writes into its input (nn.ReLU(inplace=True) after a cut between a convolution
        # and its activation) gets copies of what it received: those are leaves, kept for their gradients
        self._copies_inputs = stage_index > 0 and _starts_in_place(module)
        if checkpoint != "never":
            _keep_batch_norm_statistics_when_recomputing(module)
        self._pending: Dict[int, _Pending] = {}
        self._weights: Dict[int, Tuple[WeightGradients, _Pending]] = {}  # after I, until W
        # received inputs found without a gradient, warned about; none for a stage that passes on what it receives
        # whether its own layers use it or not (a layer list's extra arguments, for the blocks of later stages)
        self._warned_unused: set = set()
        self._warns_unused = not getattr(module, "passes_inputs_on", False)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _call(self, *inputs):
        if len(inputs) != 1 and type(self.module) is nn.Sequential:
            raise PipelineStepError(
                f"stage {self.stage_index} is an nn.Sequential, which takes one input, but it got "
                f"{len(inputs)} values; use lightning_pipe.SequentialModel for layers that pass several values"
            )
        return self.module(*inputs)

    def _run(self, tracker: SkipTracker, *inputs):
        if not self._skippable:  # nothing in this stage stashes or pops: no tracker to bind
            return self._call(*inputs)
        with use_tracker(tracker):
            return self._call(*inputs)

    def _run_on_copies(self, tracker: SkipTracker, *inputs):
        # copied inside what a checkpoint recomputes, so that the recomputation writes into copies too
        return self._run(tracker, *(x.clone() if needs_grad(x) and x.is_leaf else x for x in inputs))

    def forward(
        self,
        microbatch_index: int,
        inputs: tuple,
        num_microbatches: int,
        loss_fn: Optional[Callable[[int, tuple], torch.Tensor]] = None,
        skips: Optional[Dict[Key, torch.Tensor]] = None,
    ) -> tuple:
        """Run the forward of one microbatch and return its outputs as a tuple.

        ``skips`` are the skip tensors received from earlier stages. With ``loss_fn`` (last stage)
        the backward starts from ``loss_fn(microbatch_index, outputs)`` instead of the outputs.
        """
        skips = skips or {}
        i = microbatch_index
        self.microbatch_index = i
        restore_rng = self._seed(i)
        tracker = SkipTracker(skips)
        keep_graph = torch.is_grad_enabled()
        use_checkpoint = keep_graph and should_checkpoint(self.checkpoint, i, num_microbatches)
        kept = [x for x in inputs if isinstance(x, torch.Tensor)] + list(skips.values())
        recomputation = None
        run = self._run_on_copies if self._copies_inputs else self._run
        with self.meter.record(i, kept) if keep_graph else nullcontext(), _in_place_named(self.stage_index):
            if use_checkpoint and self.split_backward:
                recomputation = Recomputation(
                    lambda *args: run(tracker, *args), restore_rng,
                    lambda tensors: self.meter.add(i, tensors),
                )
                outputs = recomputation.run(*inputs)
            elif use_checkpoint:
                outputs = checkpointed(run, tracker, *inputs)
            else:
                outputs = run(tracker, *inputs)
            outputs = as_tuple(outputs)
            loss = loss_fn(i, outputs) if loss_fn is not None else None
        roots = (loss,) if loss_fn is not None else outputs
        self._pending[i] = _Pending(tuple(inputs), roots, tracker, tuple(skips), recomputation)
        return outputs

    def _seed(self, microbatch_index: int) -> Callable[[], None]:
        """Seed this microbatch's forward; return what puts the generators back in that state."""
        if self.step_seed is not None:
            seed = rng.derive(self.step_seed, microbatch_index, self.stage_index)
            rng.seed_torch(seed, self.device)
            return lambda: rng.seed_torch(seed, self.device)
        state = torch.get_rng_state()
        return lambda: torch.set_rng_state(state)

    def outgoing_skips(self, microbatch_index: int, keys: Sequence[Key]) -> tuple:
        """The tensors this microbatch stashed under ``keys``, to send to a later stage."""
        tensors = self._pending[microbatch_index].tracker.tensors
        return tuple(tensors[k] for k in keys)

    def skips_requiring_grad(self, microbatch_index: int, keys: Sequence[Key]) -> List[Key]:
        tensors = self._pending[microbatch_index].tracker.tensors
        return [k for k in keys if needs_grad(tensors[k])]

    def _roots(self, pending: _Pending, grads: Optional[tuple], skip_grads: Optional[Dict[Key, torch.Tensor]]):
        """What the backward starts from, and the gradients given for it (None: the loss's ones)."""
        tensors = [out for out in pending.roots if needs_grad(out)]
        if grads is not None and len(grads) != len(tensors):
            raise PipelineStepError(
                f"stage {self.stage_index} got {len(grads)} gradients for {len(tensors)} outputs that require grad"
            )
        grad_tensors = list(grads) if grads is not None else [None] * len(tensors)
        for key, grad in (skip_grads or {}).items():
            tensors.append(pending.tracker.tensors[key])
            grad_tensors.append(grad)
        return tensors, grad_tensors

    def backward(
        self, microbatch_index: int, grads: Optional[tuple], skip_grads: Optional[Dict[Key, torch.Tensor]] = None
    ) -> Tuple[tuple, Dict[Key, torch.Tensor]]:
        """Backpropagate one microbatch (``B``: input and weight gradients at once).

        Args:
            grads: gradients of the outputs that require grad (None on the last stage: the loss).
            skip_grads: gradients of the skip tensors this stage stashed for later stages.

        Returns:
            The gradients of the received inputs that require grad (in input order), and of the
            received skip tensors that require grad (by key).
        """
        pending = self._pending.pop(microbatch_index)
        tensors, grad_tensors = self._roots(pending, grads, skip_grads)
        if tensors:
            _backward(tensors, grad_tensors)
        self.meter.release(microbatch_index)
        received = [x for x in pending.inputs if needs_grad(x) and x.is_leaf]
        if any(x.grad is None for x in received):
            self._warn_unused([k for k, x in enumerate(received) if x.grad is None])
        input_grads = tuple(_grad_of(x) for x in received)
        incoming = {}
        for key in pending.incoming:
            tensor = pending.tracker.tensors[key]
            if needs_grad(tensor) and tensor.is_leaf:
                incoming[key] = _grad_of(tensor)
        return input_grads, incoming

    def backward_input(
        self, microbatch_index: int, grads: Optional[tuple], skip_grads: Optional[Dict[Key, torch.Tensor]] = None
    ) -> Tuple[tuple, Dict[Key, torch.Tensor]]:
        """The first part of a split backward (``I``): gradients of the received inputs only.

        Same arguments and results as :meth:`backward`; no ``.grad`` changes. What the weight
        gradients need stays until :meth:`backward_weight`. On the first stage nothing waits for
        input gradients, so the whole backward runs in ``W``.
        """
        pending = self._pending.pop(microbatch_index)
        tensors, grad_tensors = self._roots(pending, grads, skip_grads)
        received = pending.tracker.tensors
        inputs = [] if self.is_first else [x for x in pending.inputs if needs_grad(x) and x.is_leaf]
        keys = [k for k in pending.incoming if needs_grad(received[k]) and received[k].is_leaf]
        targets = inputs + [received[k] for k in keys]
        computed, weights = backward_input(tensors, grad_tensors, targets)
        self._weights[microbatch_index] = (weights, pending)
        if any(g is None for g in computed[: len(inputs)]):
            self._warn_unused([k for k, g in enumerate(computed[: len(inputs)]) if g is None])
        computed = [g if g is not None else torch.zeros_like(x) for x, g in zip(targets, computed)]
        return tuple(computed[: len(inputs)]), dict(zip(keys, computed[len(inputs):]))

    def _warn_unused(self, slots: List[int]) -> None:
        """The stage computed no gradient for received inputs ``slots`` (nothing reaching its loss or outputs uses
        them): the stage before gets zeros for them, as messages have fixed shapes, so a parameter that only feeds
        such an output gets a zero gradient where one process leaves it without one. Warned once per input."""
        new = [k for k in slots if k not in self._warned_unused]
        if not new or not self._warns_unused:
            return
        self._warned_unused.update(new)
        warnings.warn(
            f"lightning_pipe: stage {self.stage_index} computed no gradient for its input(s) {new} (of those that "
            "require grad): nothing it computes from them reaches the loss. The stage before it gets zeros for them, "
            "so a parameter that only feeds such an output gets a zero gradient where one process leaves it "
            "without one, and an optimizer with weight decay or momentum moves it. Send on only what later stages use"
        )

    def backward_weight(self, microbatch_index: int) -> None:
        """The second part of a split backward (``W``): accumulate the weight gradients; free the microbatch."""
        weights, pending = self._weights.pop(microbatch_index)
        if pending.recomputation is not None:
            pending.recomputation.on_recompute = None  # recomputed now, freed at once: not held, not counted
        weights.run()
        if pending.recomputation is not None:
            pending.recomputation.release()
        self.meter.release(microbatch_index)

    def clear(self) -> None:
        """Drop every pending microbatch (after a failed step)."""
        for index in list(self._pending) + list(self._weights):
            self.meter.release(index)
        self._pending.clear()
        self._weights.clear()


_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def _keep_batch_norm_statistics_when_recomputing(module: nn.Module) -> None:
    """A checkpointed forward runs again in backward: a BatchNorm in training mode would update its running
    statistics twice per microbatch (``num_batches_tracked`` twice one process's). Hooks put them back after the
    recomputation, which then normalizes as the first forward did (with the batch's statistics). A
    :class:`~lightning_pipe.batchnorm.DeferredBatchNorm` skips its own update then; torch has no switch for it."""
    for bn in module.modules():
        if not isinstance(bn, _BatchNorm) or isinstance(bn, DeferredBatchNorm) or getattr(bn, "_pipe_kept", False):
            continue
        bn._pipe_kept = True  # once per module, however many stages hold it
        bn.register_forward_pre_hook(_save_statistics)  # module-level functions: a module with them still pickles
        # always_call: torch's checkpoint stops a recomputation by raising once it has what backward needs, maybe
        # inside this module's forward after the statistics moved
        bn.register_forward_hook(_restore_statistics, always_call=True)


def _save_statistics(bn: nn.Module, args: tuple) -> None:
    if is_recomputing() and bn.training:
        bn._pipe_saved = [None if getattr(bn, name) is None else getattr(bn, name).clone() for name in _STATISTICS]


def _restore_statistics(bn: nn.Module, args: tuple, output: object) -> None:
    saved = bn.__dict__.pop("_pipe_saved", None)
    if saved is not None:
        for name, value in zip(_STATISTICS, saved):
            if value is not None:
                # through .data, as BatchNorm's own update writes them: no version bump, which would break the
                # backward of a microbatch whose forward (not checkpointed) saved them, still to run (1F1B, except_last)
                getattr(bn, name).data.copy_(value)


def _starts_in_place(module: nn.Module) -> bool:
    """Whether the first layer ``module`` runs (its first child, recursively) writes into its input."""
    while True:
        first = next(iter(module.children()), None)
        if first is None:
            return getattr(module, "inplace", False) is True
        module = first


@contextmanager
def _in_place_named(stage_index: int) -> Iterator[None]:
    """Name the stage boundary in autograd's error about an in-place write into a leaf (a stage's first layer
    other than an ``inplace=True`` module writing into what the stage received)."""
    try:
        yield
    except RuntimeError as error:
        if "leaf Variable that requires grad is being used in an in-place operation" not in str(error):
            raise
        raise PipelineStepError(
            f"stage {stage_index} writes into its input in place ({error}): what a stage receives is a leaf that "
            "collects its gradient for the stage before it, so its first operation cannot be in place. Write out of "
            "place there (`x = x.relu()`, not `x.relu_()`), or move the cut between stages (balance=[...])"
        ) from error


def _backward(tensors: List[torch.Tensor], grads: List[Optional[torch.Tensor]]) -> None:
    """``torch.autograd.backward(tensors, grads)`` without its checks (see :func:`run_backward`)."""
    run_backward(tensors, [torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads)])


def _grad_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
