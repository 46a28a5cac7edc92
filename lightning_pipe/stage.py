"""One stage's forward and backward for one microbatch, with no communication.

The stage keeps, per pending microbatch, what its backward needs: the inputs it received (leaves
whose ``.grad`` becomes the gradient to send back) and the outputs (or the loss) to backpropagate
from. It applies the checkpoint policy and counts activation memory.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from lightning_pipe.checkpoint import checkpointed, should_checkpoint
from lightning_pipe.errors import PipelineStepError
from lightning_pipe.memory import ActivationMeter


def as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def needs_grad(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad


class Stage:
    """Runs one pipeline stage's module, microbatch by microbatch.

    Args:
        module: the layers of this stage; called as ``module(*inputs)``.
        stage_index: position of this stage in the pipeline.
        num_stages: number of stages.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, checkpoint: str = "never") -> None:
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.checkpoint = checkpoint
        self.meter = ActivationMeter(module.parameters())
        self._pending: Dict[int, Tuple[tuple, tuple]] = {}

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

    def forward(
        self,
        microbatch_index: int,
        inputs: tuple,
        num_microbatches: int,
        loss_fn: Optional[Callable[[int, tuple], torch.Tensor]] = None,
    ):
        """Run the forward of one microbatch.

        Returns the outputs as a tuple; with ``loss_fn`` (last stage) returns ``(outputs, loss)``,
        where ``loss`` is what the backward starts from.
        """
        keep_graph = torch.is_grad_enabled()
        if not keep_graph:
            return self._forward_only(inputs, microbatch_index, loss_fn)
        use_checkpoint = should_checkpoint(self.checkpoint, microbatch_index, num_microbatches)
        with self.meter.record(microbatch_index, [x for x in inputs if isinstance(x, torch.Tensor)]):
            if use_checkpoint:
                outputs = checkpointed(self._call, *inputs)
            else:
                outputs = self._call(*inputs)
            outputs = as_tuple(outputs)
            loss = loss_fn(microbatch_index, outputs) if loss_fn is not None else None
        self._pending[microbatch_index] = (inputs, (loss,) if loss_fn is not None else outputs)
        return outputs if loss_fn is None else (outputs, loss)

    def _forward_only(self, inputs, microbatch_index, loss_fn):
        outputs = as_tuple(self._call(*inputs))
        if loss_fn is None:
            return outputs
        return outputs, loss_fn(microbatch_index, outputs)

    def backward(self, microbatch_index: int, grads: Optional[tuple]) -> tuple:
        """Backpropagate one microbatch; ``grads`` match the outputs that require grad (None: a loss).

        Returns the gradients of the inputs that require grad, in input order.
        """
        inputs, outputs = self._pending.pop(microbatch_index)
        tensors = [out for out in outputs if needs_grad(out)]
        if grads is None:
            grad_tensors = None
        else:
            grad_tensors = list(grads)
            if len(grad_tensors) != len(tensors):
                raise PipelineStepError(
                    f"stage {self.stage_index} got {len(grad_tensors)} gradients for {len(tensors)} outputs that require grad"
                )
        if tensors:
            torch.autograd.backward(tensors, grad_tensors)
        self.meter.release(microbatch_index)
        return tuple(
            x.grad if x.grad is not None else torch.zeros_like(x)
            for x in inputs
            if needs_grad(x) and x.is_leaf
        )

    def clear(self) -> None:
        """Drop every pending microbatch (after a failed step)."""
        for index in list(self._pending):
            self.meter.release(index)
        self._pending.clear()
