"""Recording what each rank does in pipeline steps, gathering it with aligned clocks, and its metrics.

A :class:`Recorder` set on an executor keeps one :class:`StepRecord` per recorded step: the span of
every compute action (``F``, ``B`` and any later kind), of every receive wait, of every block of
communication the executor issued (sends, and receives posted), and of the wait for the step's
sends to leave. Nothing is recorded, and nothing allocated, unless a recorder is set.

Clocks. Spans are ``time.perf_counter()`` seconds, which on Linux is ``CLOCK_MONOTONIC``: one clock
for every process of a host, so ranks on one host need no alignment at all. Ranks on other hosts
(told apart by the kernel's boot id) are aligned to the gathering rank by a ping-pong over the
pipeline group (NTP's estimate: the round trip with the smallest delay of a few, the offset its
midpoint; the error is at most half that round trip, tens of microseconds on a LAN). Wall-clock
time is not used: it jumps when NTP corrects it, and hosts agree on it only to milliseconds.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.schedule.action import Action

Span = Tuple[Action, float, float]  # an action and its begin and end, in seconds


class StepRecord:
    """What one rank did in one step.

    Attributes:
        step: the pipeline's step counter (every ``forward_backward`` and ``forward`` is a step).
        pp_rank: the rank in the pipeline group.
        row: the lowered row of actions the rank ran; its compute actions are the plan.
        begin, end: the step's span on this rank (from the executor's start to its sends' end).
        compute: ``(action, begin, end)`` per compute action in run order; ``begin`` is when its
            inputs had arrived, so the span holds compute only.
        waits: ``(receive action, begin, end)``: the time blocked until a message had arrived.
        issued: ``(actions, begin, end)``: sends and newly posted receives issued together (on a
            step whose shapes changed this includes receiving the shapes).
        finish: ``(begin, end)`` of waiting for the step's sends to leave.
    """

    __slots__ = ("step", "pp_rank", "row", "begin", "end", "compute", "waits", "issued", "finish", "_ready", "_posted")
    _STATE = ("step", "pp_rank", "row", "begin", "end", "compute", "waits", "issued", "finish")

    def __init__(self, step: int, pp_rank: int, row: Sequence[Action]) -> None:
        self.step, self.pp_rank, self.row = step, pp_rank, tuple(row)
        self.begin = self.end = 0.0
        self.compute: List[Span] = []
        self.waits: List[Span] = []
        self.issued: List[Tuple[tuple, float, float]] = []
        self.finish = (0.0, 0.0)
        self._ready = 0.0  # when the last wait ended: a compute action starts after its inputs came
        self._posted: set = set()  # receives already posted ahead, which a later block only names

    # -- called by the executor while it runs the step --------------------------------------------
    def on_compute(self, action: Action, begin: float, end: float) -> None:
        self.compute.append((action, max(begin, self._ready), end))

    def on_wait(self, action: Action, begin: float, end: float) -> None:
        self.waits.append((action, begin, end))
        self._ready = end

    def on_issued(self, actions: Sequence[Action], begin: float, end: float) -> None:
        new = tuple(a for a in actions if not a.is_recv or a not in self._posted)
        self._posted.update(a for a in new if a.is_recv)
        if new:
            self.issued.append((new, begin, end))

    # -- reading ---------------------------------------------------------------------------------
    def busy_seconds(self) -> float:
        """Time spent computing."""
        return sum(end - begin for _, begin, end in self.compute)

    def communication(self) -> List[Tuple[float, float]]:
        """The spans spent in communication: receive waits, issued blocks, the sends' final wait."""
        return [(b, e) for _, b, e in self.waits] + [(b, e) for _, b, e in self.issued] + [self.finish]

    def wait_seconds(self) -> float:
        """Time spent in communication (the sum of :meth:`communication`)."""
        return sum(end - begin for begin, end in self.communication())

    def plan(self) -> Tuple[Action, ...]:
        """The compute actions of the row, in the order the schedule gave them."""
        return tuple(a for a in self.row if a.is_compute)

    def shifted(self, offset: float) -> "StepRecord":
        """The same record on a clock ``offset`` seconds ahead."""
        other = StepRecord(self.step, self.pp_rank, self.row)
        other.begin, other.end = self.begin + offset, self.end + offset
        other.compute = [(a, b + offset, e + offset) for a, b, e in self.compute]
        other.waits = [(a, b + offset, e + offset) for a, b, e in self.waits]
        other.issued = [(a, b + offset, e + offset) for a, b, e in self.issued]
        other.finish = (self.finish[0] + offset, self.finish[1] + offset)
        return other

    def __getstate__(self):
        return {name: getattr(self, name) for name in self._STATE}

    def __setstate__(self, state) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._ready, self._posted = 0.0, set()

    def __repr__(self) -> str:
        return (f"StepRecord(step={self.step}, pp_rank={self.pp_rank}, {len(self.compute)} compute actions, "
                f"{(self.end - self.begin) * 1e3:.3f} ms)")


class Recorder:
    """Keeps :class:`StepRecord` s of the steps it is asked for, on one rank.

    Args:
        steps: the step numbers to record (e.g. ``range(10, 13)``), or None for every step.
        keep: how many of the latest records to keep; older ones are dropped.

    Example:
        >>> from lightning_pipe.schedule import gpipe, lower
        >>> recorder = Recorder(steps=[1])
        >>> recorder.start(0, (), 0) is None  # step 0 is not recorded
        True
        >>> row = lower(gpipe(1, 1))[0]
        >>> record = recorder.start(1, row, 0)
        >>> record.on_compute(row[0], 0.0, 0.5); record.on_compute(row[1], 0.5, 1.5)
        >>> recorder.close(record, 0.0, 1.5, 1.5)
        >>> recorder.records, record.busy_seconds()
        ([StepRecord(step=1, pp_rank=0, 2 compute actions, 1500.000 ms)], 1.5)
    """

    def __init__(self, steps: Optional[Iterable[int]] = None, keep: int = 64) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ConfigurationError(f"keep (the number of step records kept) must be a positive integer, got {keep!r}")
        self.steps = steps if steps is None or isinstance(steps, range) else frozenset(steps)
        self._records: deque = deque(maxlen=keep)

    def start(self, step: int, row: Sequence[Action], pp_rank: int) -> Optional[StepRecord]:
        """A fresh record for ``step``, or None when this step is not recorded."""
        if self.steps is not None and step not in self.steps:
            return None
        return StepRecord(step, pp_rank, row)

    def close(self, record: StepRecord, begin: float, finishing: float, end: float) -> None:
        """The step ran from ``begin`` to ``end``; its sends were waited for from ``finishing``."""
        record.begin, record.end, record.finish = begin, end, (finishing, end)
        self._records.append(record)

    @property
    def records(self) -> List[StepRecord]:
        """The records kept, oldest first."""
        return list(self._records)

    def clear(self) -> None:
        self._records.clear()


def _clock_id() -> str:
    """Processes with the same id read the same CLOCK_MONOTONIC (one kernel since one boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_offsets(
    group: Optional[dist.ProcessGroup] = None, dst: int = 0, device: Optional[torch.device] = None,
    estimate: Optional[bool] = None, rounds: int = 8,
) -> Optional[List[Tuple[float, float]]]:
    """Per group rank, ``(offset, error)``: seconds to add to its clock to read ``dst``'s clock.

    A collective over ``group``: every rank calls it. Ranks sharing ``dst``'s clock get ``(0, 0)``;
    others (or all, with ``estimate=True``) are measured by ``rounds`` ping-pongs with ``dst``.

    Returns:
        The list on group rank ``dst``, None elsewhere.
    """
    group = group if group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = device if device is not None else torch.device("cpu")
    ids: List[Optional[str]] = [None] * size
    dist.all_gather_object(ids, _clock_id(), group=group)
    measured = [r for r in range(size) if r != dst and (estimate or ids[r] != ids[dst])]
    offsets = [(0.0, 0.0)] * size
    buffer = torch.zeros(1, dtype=torch.float64, device=device)
    for r in measured:
        if rank == dst:
            offsets[r] = _ping(buffer, dist.get_global_rank(group, r), group, rounds, device)
        elif rank == r:
            _pong(buffer, dist.get_global_rank(group, dst), group, rounds, device)
    return offsets if rank == dst else None


def _ping(buffer: torch.Tensor, peer: int, group, rounds: int, device: torch.device) -> Tuple[float, float]:
    best = (float("inf"), 0.0)
    for _ in range(rounds):
        sent = time.perf_counter()
        dist.send(buffer, peer, group=group)
        dist.recv(buffer, peer, group=group)
        _synchronize(device)
        their = buffer.item()
        came = time.perf_counter()
        best = min(best, (came - sent, (sent + came) / 2 - their))
    return best[1], best[0] / 2


def _pong(buffer: torch.Tensor, peer: int, group, rounds: int, device: torch.device) -> None:
    for _ in range(rounds):
        dist.recv(buffer, peer, group=group)
        _synchronize(device)
        buffer.fill_(time.perf_counter())
        dist.send(buffer, peer, group=group)


def gather_records(
    records: Sequence[StepRecord], group: Optional[dist.ProcessGroup] = None, dst: int = 0,
    device: Optional[torch.device] = None,
) -> Optional[List[StepRecord]]:
    """Collect every rank's records on group rank ``dst``, on ``dst``'s clock.

    A collective over ``group`` (the pipeline's): every rank calls it, with its own records.
    ``device`` is where the clock ping-pong's tensor lives (the current GPU on NCCL).

    Returns:
        All ranks' records, ordered by rank then step, on ``dst``; None elsewhere.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(records)
    offsets = clock_offsets(group, dst, device)
    rank = dist.get_rank(group)
    gathered: Optional[list] = [None] * dist.get_world_size(group) if rank == dst else None
    dist.gather_object(list(records), gathered, dst=dist.get_global_rank(group or dist.group.WORLD, dst), group=group)
    if rank != dst:
        return None
    return [record.shifted(offsets[r][0]) for r, per_rank in enumerate(gathered) for record in per_rank]


def by_step(records: Iterable[StepRecord]) -> Dict[int, Dict[int, StepRecord]]:
    """``{step: {pp_rank: record}}`` (the last record wins if a rank recorded a step twice)."""
    out: Dict[int, Dict[int, StepRecord]] = {}
    for record in records:
        out.setdefault(record.step, {})[record.pp_rank] = record
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class PipelineMetrics:
    """How a pipeline spent its steps, measured (see :func:`pipeline_metrics` for the definitions).

    Attributes:
        num_steps: the steps measured.
        step_seconds: mean makespan of a step.
        bubble_fraction: share of rank-time not spent computing.
        busy_fraction: per pipeline rank, share of the makespan spent computing.
        wait_seconds: per pipeline rank, mean time per step spent in communication.
        samples_per_second: batch size × steps / total makespan (None without a batch size).
    """

    num_steps: int
    step_seconds: float
    bubble_fraction: float
    busy_fraction: Tuple[float, ...]
    wait_seconds: Tuple[float, ...]
    samples_per_second: Optional[float]


def pipeline_metrics(records: Iterable[StepRecord], batch_size: Optional[int] = None) -> PipelineMetrics:
    """Measure bubble, load and throughput from the records of one or more steps of all ranks.

    With ``R`` pipeline ranks and, for each step ``n`` recorded by all of them, the makespan
    ``T_n = max_r end(r, n) - min_r begin(r, n)`` (clocks aligned, e.g. by :func:`gather_records`)
    and ``busy(r, n)`` the sum of rank ``r``'s compute spans:

    * ``busy_fraction[r] = sum_n busy(r, n) / sum_n T_n``
    * ``bubble_fraction = 1 - sum_r sum_n busy(r, n) / (R * sum_n T_n)`` (``1 - mean busy_fraction``,
      the definition :func:`~lightning_pipe.schedule.simulate` uses for the plan)
    * ``wait_seconds[r]``: mean per step of the time rank ``r`` spent in communication calls:
      blocked in receives, issuing sends and receives, waiting for its sends to leave
    * ``samples_per_second = batch_size * N / sum_n T_n``
    * ``step_seconds = sum_n T_n / N``

    Steps that some rank did not record are left out.

    Raises:
        ConfigurationError: no step was recorded by every rank.

    Example:
        >>> from lightning_pipe.schedule import gpipe, lower
        >>> rows = lower(gpipe(2, 1))
        >>> records = [StepRecord(0, 0, rows[0]), StepRecord(0, 1, rows[1])]
        >>> records[0].compute = [(Action("F", 0, 0), 0.0, 1.0), (Action("B", 0, 0), 3.0, 4.0)]
        >>> records[1].compute = [(Action("F", 1, 0), 1.0, 2.0), (Action("B", 1, 0), 2.0, 3.0)]
        >>> records[0].begin, records[0].end, records[1].begin, records[1].end = 0.0, 4.0, 0.0, 3.0
        >>> metrics = pipeline_metrics(records, batch_size=8)
        >>> metrics.bubble_fraction, metrics.busy_fraction, metrics.samples_per_second
        (0.5, (0.5, 0.5), 2.0)
    """
    steps = by_step(records)
    num_ranks = max((len(per_rank) for per_rank in steps.values()), default=0)
    complete = [per_rank for per_rank in steps.values() if len(per_rank) == num_ranks]
    if not complete:
        raise ConfigurationError("no step was recorded by every rank: record steps with Pipeline.trace_steps first")
    total = sum(max(r.end for r in per_rank.values()) - min(r.begin for r in per_rank.values()) for per_rank in complete)
    ranks = sorted(complete[0])
    busy = [sum(per_rank[r].busy_seconds() for per_rank in complete) for r in ranks]
    waits = [sum(per_rank[r].wait_seconds() for per_rank in complete) / len(complete) for r in ranks]
    return PipelineMetrics(
        num_steps=len(complete),
        step_seconds=total / len(complete),
        bubble_fraction=1.0 - sum(busy) / (len(ranks) * total) if total > 0 else 0.0,
        busy_fraction=tuple(b / total if total > 0 else 0.0 for b in busy),
        wait_seconds=tuple(waits),
        samples_per_second=batch_size * len(complete) / total if batch_size is not None and total > 0 else None,
    )
