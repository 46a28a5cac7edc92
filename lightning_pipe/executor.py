"""Runs one rank's lowered schedule row: one small handler per action kind.

The executor follows the row and nothing else. Communication actions that follow one another are
issued together; receives are posted ahead of need when the transport allows it (``lookahead``
per direction), so data is in flight while the stage computes. A failing action is reported to
every rank and re-raised as ``[pp_rank 1 | step 7 | 1B3] ...``.

When a :class:`~lightning_pipe.trace.Recorder` is set on ``recorder``, the spans of the step's
compute actions, receive waits and issued communication are kept for a timeline; when none is set
the only cost is one ``is not None`` test per action. Compute actions are ``torch.profiler``
ranges named ``pipe/1F3`` while a profiler runs (entered only then: a range costs ~15 µs even with
no profiler).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.autograd import _profiler_enabled  # the C++ profiler's state: ~0.2 µs to ask
from torch.autograd.profiler import record_function

from lightning_pipe.errors import PipelineAbortedError, PipelineStepError
from lightning_pipe.schedule.action import (
    RECV_B, RECV_F, RECV_SKIP, RECV_SKIP_GRAD, SEND_B, SEND_F, SEND_SKIP, SEND_SKIP_GRAD, Action, B, F,
)
from lightning_pipe.skip.layout import SkipLayout
from lightning_pipe.stage import Stage
from lightning_pipe.transport import ACTIVATIONS, GRADIENTS, SKIP_GRADIENTS, SKIPS, PendingRecv, Transport


class StepResult:
    """What one rank produced in one step: the last stage's outputs per microbatch, and timings.

    ``compute_seconds`` is the time spent in forward and backward, ``wait_seconds`` the time spent
    waiting for messages, ``wall_seconds`` the whole step on this rank.
    """

    def __init__(self) -> None:
        self.outputs: Dict[int, tuple] = {}
        self.compute_seconds = 0.0
        self.wait_seconds = 0.0
        self.wall_seconds = 0.0


_TAG = {
    SEND_F: ACTIVATIONS, RECV_F: ACTIVATIONS, SEND_B: GRADIENTS, RECV_B: GRADIENTS,
    SEND_SKIP: SKIPS, RECV_SKIP: SKIPS, SEND_SKIP_GRAD: SKIP_GRADIENTS, RECV_SKIP_GRAD: SKIP_GRADIENTS,
}
_WHAT = {RECV_F: "activations", RECV_B: "gradients", RECV_SKIP: "skip tensors", RECV_SKIP_GRAD: "skip gradients"}


class Executor:
    """Executes lowered rows for one stage.

    Args:
        stage: the local stage.
        transport: its transport.
        pp_rank: this rank's index in the pipeline (for messages).
        layout: the skip layout (which skip names cross from which stage to which).
        lookahead: receives posted ahead of need, per kind of message and peer.
    """

    def __init__(self, stage: Stage, transport: Transport, pp_rank: int, layout: Optional[SkipLayout] = None,
                 lookahead: int = 2) -> None:
        self.stage = stage
        self.transport = transport
        self.pp_rank = pp_rank
        self.layout = layout
        self.lookahead = lookahead
        self._handlers = {F: self._forward, B: self._backward}
        self.recorder = None  # a lightning_pipe.trace.Recorder to keep timelines of steps
        self._rec = None  # the current step's StepRecord while recording

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
        self._current: Optional[Action] = None
        self._num_microbatches = num_microbatches
        self._inputs = inputs
        self._loss_fn = loss_fn
        self._keep_outputs = keep_outputs
        self._posted: Dict[tuple, PendingRecv] = {}
        self._outgoing: Dict[tuple, tuple] = {}  # (send kind, peer, microbatch) -> tensors to send
        self._result = StepResult()
        self._recv_queues: Dict[tuple, List[Action]] = {}
        for a in row:
            if a.is_recv:
                self._recv_queues.setdefault((a.kind, a.peer), []).append(a)
        self._recv_next = {key: 0 for key in self._recv_queues}
        start = time.perf_counter()
        self._rec = self.recorder.start(step, row, self.pp_rank) if self.recorder is not None else None
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
            finishing = time.perf_counter()
            self.transport.finish()
        except PipelineAbortedError:
            self.stage.clear()
            raise
        except Exception as exc:
            self.stage.clear()
            message = f"[pp_rank {self.pp_rank} | step {step} | {self._current}] {type(exc).__name__}: {exc}"
            self.transport.errors.report(message)
            raise PipelineStepError(message) from exc
        end = time.perf_counter()
        self._result.wall_seconds = end - start
        if self._rec is not None:
            self.recorder.close(self._rec, start, finishing, end)
        return self._result

    # -- compute ---------------------------------------------------------------------------------
    def _run_compute(self, action: Action) -> None:
        self._current = action
        begin, waited = time.perf_counter(), self._result.wait_seconds
        if _profiler_enabled():
            with record_function(f"pipe/{action}"):
                self._handlers[action.kind](action.microbatch_index)
        else:
            self._handlers[action.kind](action.microbatch_index)
        end = time.perf_counter()
        self._result.compute_seconds += end - begin - (self._result.wait_seconds - waited)
        if self._rec is not None:
            self._rec.on_compute(action, begin, end)

    def _skip_keys(self, source: int, target: int) -> list:
        return self.layout.crossing[(source, target)] if self.layout is not None else []

    def _forward(self, i: int) -> None:
        s = self.stage.stage_index
        inputs = self._inputs[i] if self.stage.is_first else self._take(RECV_F, s - 1, i)
        skips = {}
        for peer in self._peers(RECV_SKIP):
            skips.update(zip(self._skip_keys(peer, s), self._take(RECV_SKIP, peer, i)))
        outputs = self.stage.forward(i, inputs, self._num_microbatches, self._loss_fn, skips)
        if self.stage.is_last:
            if self._keep_outputs:
                self._result.outputs[i] = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
        else:
            self._outgoing[(SEND_F, s + 1, i)] = outputs
        for peer in self._peers(SEND_SKIP):
            self._outgoing[(SEND_SKIP, peer, i)] = self.stage.outgoing_skips(i, self._skip_keys(s, peer))

    def _backward(self, i: int) -> None:
        s = self.stage.stage_index
        grads = None if self.stage.is_last else self._take(RECV_B, s + 1, i)
        skip_grads = {}
        for peer in self._peers(RECV_SKIP_GRAD):
            keys = self.stage.skips_requiring_grad(i, self._skip_keys(s, peer))
            skip_grads.update(zip(keys, self._take(RECV_SKIP_GRAD, peer, i)))
        input_grads, incoming_skip_grads = self.stage.backward(i, grads, skip_grads)
        if not self.stage.is_first:
            self._outgoing[(SEND_B, s - 1, i)] = input_grads
        for peer in self._peers(SEND_SKIP_GRAD):
            keys = self._skip_keys(peer, s)
            self._outgoing[(SEND_SKIP_GRAD, peer, i)] = tuple(
                incoming_skip_grads[k] for k in keys if k in incoming_skip_grads
            )

    def _peers(self, kind: str) -> list:
        """The peers this stage exchanges ``kind`` messages with (from the skip layout)."""
        if self.layout is None:
            return []
        s = self.stage.stage_index
        if kind in (RECV_SKIP, SEND_SKIP_GRAD):
            return sorted(self.layout.incoming(s))
        return sorted(self.layout.outgoing(s))

    # -- communication ---------------------------------------------------------------------------
    def _run_comm(self, actions: Sequence[Action]) -> None:
        begin = time.perf_counter() if self._rec is not None else 0.0
        ops, pending = [], []
        for action in actions:
            self._current = action
            kind, i, peer = action.kind, action.microbatch_index, action.peer
            if action.is_send:
                ops.extend(self.transport.send(_TAG[kind], peer, i, self._outgoing.pop((kind, peer, i))))
            else:
                key = (kind, peer, i)
                if key not in self._posted:
                    recv = self.transport.recv(_TAG[kind], peer, i)
                    self._posted[key] = recv
                    ops.extend(recv.ops)
                    pending.append(recv)
                self._recv_next[(kind, peer)] += 1
        self.transport.issue(ops, pending)
        if self._rec is not None:
            self._rec.on_issued(actions, begin, time.perf_counter())
        self._post_ahead()

    def _post_ahead(self) -> None:
        """Post the next receives of each kind and peer whose shapes are known, up to ``lookahead``."""
        for (kind, peer), queue in self._recv_queues.items():
            start = self._recv_next[(kind, peer)]
            for action in queue[start : start + self.lookahead]:
                key = (kind, peer, action.microbatch_index)
                if key in self._posted:
                    continue
                if not self.transport.can_post(_TAG[kind], peer, action.microbatch_index):
                    break
                begin = time.perf_counter() if self._rec is not None else 0.0
                recv = self.transport.recv(_TAG[kind], peer, action.microbatch_index)
                self._posted[key] = recv
                self.transport.issue(recv.ops, [recv])
                if self._rec is not None:
                    self._rec.on_issued((action,), begin, time.perf_counter())

    def _take(self, kind: str, peer: int, i: int) -> tuple:
        recv = self._posted.pop((kind, peer, i))
        begin = time.perf_counter()
        tensors = self.transport.take(recv, f"{_WHAT[kind]} of microbatch {i} from stage {peer}")
        end = time.perf_counter()
        self._result.wait_seconds += end - begin
        if self._rec is not None:
            self._rec.on_wait(Action(kind, self.stage.stage_index, i, peer), begin, end)
        return tensors
