"""Runs one rank's lowered schedule row: one small handler per action kind.

The executor follows the row and nothing else. Communication actions that follow one another are
issued together; receives are posted ahead of need when the transport allows it (``lookahead``
per direction), so data is in flight while the stage computes. A failing action is reported to
every rank and re-raised as ``[pp_rank 1 | step 7 | 1B3] ...``.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from lightning_pipe.errors import PipelineAbortedError, PipelineStepError
from lightning_pipe.schedule.action import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action
from lightning_pipe.stage import Stage
from lightning_pipe.transport import PendingRecv, Transport


class StepResult:
    """What one rank produced in one step: the last stage's outputs per microbatch, and timings."""

    def __init__(self) -> None:
        self.outputs: Dict[int, tuple] = {}
        self.compute_seconds = 0.0
        self.wall_seconds = 0.0


class Executor:
    """Executes lowered rows for one stage.

    Args:
        stage: the local stage.
        transport: its transport.
        pp_rank: this rank's index in the pipeline (for messages).
        lookahead: receives posted ahead of need, per direction.
    """

    def __init__(self, stage: Stage, transport: Transport, pp_rank: int, lookahead: int = 2) -> None:
        self.stage = stage
        self.transport = transport
        self.pp_rank = pp_rank
        self.lookahead = lookahead
        self._handlers = {F: self._forward, B: self._backward}

    def run(
        self,
        row: Sequence[Action],
        step: int,
        num_microbatches: int,
        inputs: Optional[List[tuple]] = None,
        loss_fn: Optional[Callable[[int, tuple], torch.Tensor]] = None,
        keep_outputs: bool = False,
    ) -> StepResult:
        """Run ``row``; ``inputs`` are stage 0's microbatches, ``loss_fn`` is the last stage's criterion."""
        self._step = step
        self._current: Optional[Action] = None
        self._num_microbatches = num_microbatches
        self._inputs = inputs
        self._loss_fn = loss_fn
        self._keep_outputs = keep_outputs
        self._received: Dict[tuple, tuple] = {}
        self._posted: Dict[tuple, PendingRecv] = {}
        self._outputs: Dict[int, tuple] = {}
        self._grads: Dict[int, tuple] = {}
        self._result = StepResult()
        self._recv_queue = {RECV_F: [a for a in row if a.kind == RECV_F], RECV_B: [a for a in row if a.kind == RECV_B]}
        self._recv_next = {RECV_F: 0, RECV_B: 0}
        start = time.perf_counter()
        try:
            self._post_ahead()
            position = 0
            while position < len(row):
                if row[position].is_compute:
                    self._run_compute(row[position])
                    position += 1
                else:
                    end = position
                    while end < len(row) and not row[end].is_compute:
                        end += 1
                    self._run_comm(row[position:end])
                    position = end
            self.transport.finish()
        except PipelineAbortedError:
            self.stage.clear()
            raise
        except Exception as exc:
            self.stage.clear()
            message = f"[pp_rank {self.pp_rank} | step {step} | {self._current}] {type(exc).__name__}: {exc}"
            self.transport.errors.report(message)
            raise PipelineStepError(message) from exc
        self._result.wall_seconds = time.perf_counter() - start
        return self._result

    # -- compute ---------------------------------------------------------------------------------
    def _run_compute(self, action: Action) -> None:
        self._current = action
        begin = time.perf_counter()
        self._handlers[action.kind](action.microbatch_index)
        self._result.compute_seconds += time.perf_counter() - begin

    def _forward(self, i: int) -> None:
        inputs = self._inputs[i] if self.stage.is_first else self._take((RECV_F, i))
        if self.stage.is_last and self._loss_fn is not None:
            outputs, _ = self.stage.forward(i, inputs, self._num_microbatches, self._loss_fn)
        else:
            outputs = self.stage.forward(i, inputs, self._num_microbatches)
        if self.stage.is_last:
            if self._keep_outputs:
                self._result.outputs[i] = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
        else:
            self._outputs[i] = outputs

    def _backward(self, i: int) -> None:
        grads = None if self.stage.is_last else self._take((RECV_B, i))
        self._grads[i] = self.stage.backward(i, grads)

    # -- communication ---------------------------------------------------------------------------
    def _run_comm(self, actions: Sequence[Action]) -> None:
        ops, pending = [], []
        for action in actions:
            self._current = action
            i = action.microbatch_index
            if action.kind == SEND_F:
                ops.extend(self.transport.send_activations(i, self._outputs.pop(i)))
            elif action.kind == SEND_B:
                ops.extend(self.transport.send_grads(self._grads.pop(i)))
            else:
                key = (action.kind, i)
                if key not in self._posted:
                    recv = self._prepare(action)
                    self._posted[key] = recv
                    ops.extend(recv.ops)
                    pending.append(recv)
                self._recv_next[action.kind] += 1
        self.transport.issue(ops, pending)
        self._post_ahead()

    def _prepare(self, action: Action) -> PendingRecv:
        if action.kind == RECV_F:
            return self.transport.recv_activations(action.microbatch_index)
        return self.transport.recv_grads(action.microbatch_index)

    def _post_ahead(self) -> None:
        """Post the next receives of each direction whose shapes are known, up to ``lookahead``."""
        for kind, can_post in ((RECV_F, self.transport.can_post_activations), (RECV_B, self.transport.can_post_grads)):
            queue = self._recv_queue[kind]
            start = self._recv_next[kind]
            for action in queue[start : start + self.lookahead]:
                key = (kind, action.microbatch_index)
                if key in self._posted:
                    continue
                if not can_post(action.microbatch_index):
                    break
                recv = self._prepare(action)
                self._posted[key] = recv
                self.transport.issue(recv.ops, [recv])

    def _take(self, key: tuple) -> tuple:
        recv = self._posted.pop(key)
        kind, i = key
        peer = self.stage.stage_index + (-1 if kind == RECV_F else 1)
        what = f"{'activations' if kind == RECV_F else 'gradients'} of microbatch {i} from stage {peer}"
        return self.transport.take(recv, what)
