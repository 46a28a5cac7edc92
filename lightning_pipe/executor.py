"""Runs one rank's lowered schedule row: one small handler per action kind.

The executor follows the row and nothing else. A rank may hold several stages (interleaved and
V placements); every compute action names its stage, and the handler runs that stage. Messages
between two stages on this rank are not in the row (see :mod:`lightning_pipe.schedule.lower`):
the producer leaves its outputs (or input gradients) here, detached as a received tensor would
be, so each stage's backward stays its own, and the consumer takes them. Communication actions
that follow one another are issued together; receives are posted ahead of need when the
transport allows it (``lookahead`` per kind of message and peer rank, in the order the row
receives them, which is the order each link carries them), so data is in flight while the
stage computes. A failing action is reported to every rank and re-raised as
``[pp_rank 1 | step 7 | 1B3] ...``.

When a :class:`~lightning_pipe.trace.Recorder` is set on ``recorder``, the spans of the step's
compute actions, receive waits and issued communication are kept for a timeline; when none is set
the only cost is one ``is not None`` test per action. Compute actions are ``torch.profiler``
ranges named ``pipe/1F3`` while a profiler runs (entered only then: a range costs ~15 µs even with
no profiler).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch.autograd import _profiler_enabled  # the C++ profiler's state: ~0.2 µs to ask
from torch.autograd.profiler import record_function

from lightning_pipe.errors import PipelineAbortedError, step_error
from lightning_pipe.faults import note_failed_group
from lightning_pipe.schedule.action import (
    RECV_B, RECV_F, RECV_KINDS, RECV_SKIP, RECV_SKIP_GRAD, SEND_B, SEND_F, SEND_KINDS, SEND_SKIP, SEND_SKIP_GRAD,
    Action, B, F, I, W,
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
_SENDS = frozenset(SEND_KINDS)
_RECVS = frozenset(RECV_KINDS)


class _Routes(NamedTuple):
    """Where one local stage's messages come from and go: ``(peer stage, skip keys, same rank)``."""

    previous_local: bool  # stage s - 1 runs on this rank
    next_local: bool  # stage s + 1 runs on this rank
    skips_in: Tuple[Tuple[int, list, bool], ...]  # skip tensors this stage pops, by stashing stage
    skips_out: Tuple[Tuple[int, list, bool], ...]  # skip tensors this stage stashes, by popping stage


def _detached(tensors: Sequence) -> tuple:
    """What a same-rank consumer gets: the tensors as a receive would give them (new leaves)."""
    return tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in tensors)


class Executor:
    """Executes lowered rows for the stages of one rank.

    Args:
        stages: the local stages (one :class:`~lightning_pipe.stage.Stage`, or several).
        transport: the rank's transport.
        pp_rank: this rank's index in the pipeline (for messages).
        layout: the skip layout (which skip names cross from which stage to which).
        lookahead: receives posted ahead of need, per kind of message and peer rank.
    """

    def __init__(self, stages: Union[Stage, Sequence[Stage]], transport: Transport, pp_rank: int,
                 layout: Optional[SkipLayout] = None, lookahead: int = 2) -> None:
        stages = [stages] if isinstance(stages, Stage) else list(stages)
        self.stages = {stage.stage_index: stage for stage in stages}
        self.stage = stages[0]  # the stage of the compute action running, or run last
        self.transport = transport
        self.pp_rank = pp_rank
        self.layout = layout
        self.lookahead = lookahead
        self._routes = {s: self._routes_of(s) for s in self.stages}
        self._handlers = {F: self._forward, B: self._backward, I: self._backward, W: self._weight}
        self.recorder = None  # a lightning_pipe.trace.Recorder to keep timelines of steps
        self._rec = None  # the current step's StepRecord while recording

    def _routes_of(self, s: int) -> _Routes:
        local = self.stages
        incoming = self.layout.incoming(s) if self.layout is not None else {}
        outgoing = self.layout.outgoing(s) if self.layout is not None else {}
        return _Routes(
            s - 1 in local, s + 1 in local,
            tuple((a, keys, a in local) for a, keys in sorted(incoming.items())),
            tuple((b, keys, b in local) for b, keys in sorted(outgoing.items())),
        )

    def run(
        self,
        row: Sequence[Action],
        step: int,
        num_microbatches: int,
        inputs: Optional[List[tuple]] = None,
        loss_fn: Optional[Callable[[int, tuple], torch.Tensor]] = None,
        keep_outputs: bool = False,
        before: Optional[Mapping[int, Callable[[], None]]] = None,
        when_idle: Sequence[Callable[[], None]] = (),
    ) -> StepResult:
        """Run ``row``; ``inputs`` are the first stage's microbatches, ``loss_fn`` the last stage's criterion.

        ``before`` maps positions in ``row`` to callables run just before that action (the
        replica sync arms a stage's gradient hooks before the stage's last backward).
        ``when_idle`` are run, in order, the first time the row takes a message that has not
        arrived (under NCCL, its first message), or once the row's actions have run if it never
        does; the waits before the row (the step header, and the shapes of a step whose shapes
        are new) do not count.
        """
        self._current: Optional[Action] = None
        self._num_microbatches = num_microbatches
        self._inputs = inputs
        self._loss_fn = loss_fn
        self._keep_outputs = keep_outputs
        self._posted: Dict[tuple, PendingRecv] = {}
        self._outgoing: Dict[tuple, tuple] = {}  # (send kind, stage, peer, microbatch) -> tensors to send
        self._handoff: Dict[tuple, object] = {}  # (message, consumer, producer, microbatch) -> same-rank data
        self._idle = list(when_idle)
        self._result = StepResult()
        self._queue_rows(row)
        start = time.perf_counter()
        self._rec = self.recorder.start(step, row, self.pp_rank) if self.recorder is not None else None
        try:
            self._post_ahead()
            self._follow(row, before or {})
            self._run_idle()
            finishing = time.perf_counter()
            self.transport.finish()
        except PipelineAbortedError:
            self._clear()
            note_failed_group(self.transport._process_group)
            raise
        except Exception as exc:
            self._clear()
            note_failed_group(self.transport._process_group)
            message = f"[pp_rank {self.pp_rank} | step {step} | {self._current}] {type(exc).__name__}: {exc}"
            self.transport.errors.report(message)
            raise step_error(exc, message) from exc
        end = time.perf_counter()
        self._result.wall_seconds = end - start
        if self._rec is not None:
            self.recorder.close(self._rec, start, finishing, end)
        return self._result

    def _queue_rows(self, row: Sequence[Action]) -> None:
        """Per kind of receive and peer rank (one FIFO link), the receives in row order."""
        ranks = self.transport.stage_ranks
        self._recv_queues: Dict[tuple, List[Action]] = {}
        for a in row:
            if a[0] in _RECVS:
                self._recv_queues.setdefault((a[0], ranks[a[3]]), []).append(a)
        self._recv_next = {key: 0 for key in self._recv_queues}

    def _follow(self, row: Sequence[Action], before: Mapping[int, Callable[[], None]]) -> None:
        position, n = 0, len(row)
        while position < n:
            action = row[position]
            if action[0] in _SENDS or action[0] in _RECVS:
                end = position + 1
                while end < n and (row[end][0] in _SENDS or row[end][0] in _RECVS):
                    end += 1
                self._run_comm(row[position:end])
                position = end
                continue
            if position in before:
                before[position]()
            self._run_compute(action)
            position += 1

    def _clear(self) -> None:
        self._idle = []  # nor the failed step's batch kept alive by them
        for stage in self.stages.values():
            stage.clear()

    # -- compute ---------------------------------------------------------------------------------
    def _run_compute(self, action: Action) -> None:
        self._current = action
        begin, waited = time.perf_counter(), self._result.wait_seconds
        if _profiler_enabled():
            with record_function(f"pipe/{action}"):
                self._handlers[action[0]](action)
        else:
            self._handlers[action[0]](action)
        end = time.perf_counter()
        self._result.compute_seconds += end - begin - (self._result.wait_seconds - waited)
        if self._rec is not None:
            self._rec.on_compute(action, begin, end)

    def _forward(self, action: Action) -> None:
        _, s, i, _ = action
        stage = self.stage = self.stages[s]
        routes = self._routes[s]
        if stage.is_first:
            inputs = self._inputs[i]
        elif routes.previous_local:
            inputs = self._handoff.pop((F, s, s - 1, i))
        else:
            inputs = self._take(RECV_F, s, s - 1, i)
        skips = {}
        for peer, keys, local in routes.skips_in:
            tensors = self._handoff.pop(("S", s, peer, i)) if local else self._take(RECV_SKIP, s, peer, i)
            skips.update(zip(keys, tensors))
        outputs = stage.forward(i, inputs, self._num_microbatches, self._loss_fn if stage.is_last else None, skips)
        if stage.is_last:
            if self._keep_outputs:
                self._result.outputs[i] = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs)
        elif routes.next_local:
            self._handoff[(F, s + 1, s, i)] = _detached(outputs)
        else:
            self._outgoing[(SEND_F, s, s + 1, i)] = outputs
        for peer, keys, local in routes.skips_out:
            tensors = stage.outgoing_skips(i, keys)
            if local:
                self._handoff[("S", peer, s, i)] = _detached(tensors)
            else:
                self._outgoing[(SEND_SKIP, s, peer, i)] = tensors

    def _backward(self, action: Action) -> None:
        kind, s, i, _ = action
        stage = self.stage = self.stages[s]
        routes = self._routes[s]
        if stage.is_last:
            grads = None
        elif routes.next_local:
            grads = self._handoff.pop((B, s, s + 1, i))
        else:
            grads = self._take(RECV_B, s, s + 1, i)
        skip_grads: dict = {}
        for peer, keys, local in routes.skips_out:
            if local:
                skip_grads.update(self._handoff.pop(("G", s, peer, i)))
            else:
                wanted = stage.skips_requiring_grad(i, keys)
                skip_grads.update(zip(wanted, self._take(RECV_SKIP_GRAD, s, peer, i)))
        run = stage.backward if kind == B else stage.backward_input
        input_grads, incoming = run(i, grads, skip_grads)
        if not stage.is_first:
            if routes.previous_local:
                self._handoff[(B, s - 1, s, i)] = input_grads
            else:
                self._outgoing[(SEND_B, s, s - 1, i)] = input_grads
        for peer, keys, local in routes.skips_in:
            if local:
                self._handoff[("G", peer, s, i)] = {k: incoming[k] for k in keys if k in incoming}
            else:
                self._outgoing[(SEND_SKIP_GRAD, s, peer, i)] = tuple(incoming[k] for k in keys if k in incoming)

    def _weight(self, action: Action) -> None:
        _, s, i, _ = action
        self.stage = self.stages[s]
        self.stage.backward_weight(i)

    # -- communication ---------------------------------------------------------------------------
    def _run_comm(self, actions: Sequence[Action]) -> None:
        """Issue a block of sends and receives; the sends go first (see below)."""
        begin = time.perf_counter() if self._rec is not None else 0.0
        transport, ranks = self.transport, self.transport.stage_ranks
        ops, pending = [], []
        for action in actions:
            kind, s, i, peer = action
            if kind in _SENDS:
                self._current = action
                ops.extend(transport.send(_TAG[kind], s, peer, i, self._outgoing.pop((kind, s, peer, i))))
        if not transport.batched:
            # On a step whose shapes are new, preparing a receive waits for its shapes; a peer may
            # be waiting for this block's sends at the same time (two stages per rank make such
            # cycles), so the sends leave first, as the schedule's simulation assumes.
            transport.issue(ops)
            ops = []
        for action in actions:
            kind, s, i, peer = action
            if kind in _RECVS:
                self._current = action
                key = (kind, s, peer, i)
                if key not in self._posted:
                    recv = transport.recv(_TAG[kind], s, peer, i)
                    self._posted[key] = recv
                    ops.extend(recv.ops)
                    pending.append(recv)
                self._recv_next[(kind, ranks[peer])] += 1
        transport.issue(ops, pending)
        if self._rec is not None:
            self._rec.on_issued(actions, begin, time.perf_counter())
        self._post_ahead()

    def _run_idle(self) -> None:
        tasks, self._idle = self._idle, []
        for task in tasks:
            task()

    def _post_ahead(self) -> None:
        """Post the next receives of each kind and peer rank whose shapes are known, up to ``lookahead``."""
        transport = self.transport
        for link, queue in self._recv_queues.items():
            start = self._recv_next[link]
            for action in queue[start : start + self.lookahead]:
                kind, s, i, peer = action
                key = (kind, s, peer, i)
                if key in self._posted:
                    continue
                if not transport.can_post(_TAG[kind], s, peer, i):
                    break
                begin = time.perf_counter() if self._rec is not None else 0.0
                recv = transport.recv(_TAG[kind], s, peer, i)
                self._posted[key] = recv
                transport.issue(recv.ops, [recv])
                if self._rec is not None:
                    self._rec.on_issued((action,), begin, time.perf_counter())

    def _take(self, kind: str, stage: int, peer: int, i: int) -> tuple:
        recv = self._posted.pop((kind, stage, peer, i))
        begin = time.perf_counter()
        if self._idle and (recv.arrival is None or not recv.arrival.done):
            self._run_idle()  # counted as waiting: the rank would have waited meanwhile
        tensors = self.transport.take(recv, f"{_WHAT[kind]} of microbatch {i} from stage {peer}")
        end = time.perf_counter()
        self._result.wait_seconds += end - begin
        if self._rec is not None:
            self._rec.on_wait(Action(kind, stage, i, peer), begin, end)
        return tensors
