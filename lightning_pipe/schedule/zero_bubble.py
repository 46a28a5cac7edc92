"""Zero-bubble schedules: the backward split into ``I`` and ``W`` (Qi et al., 2023).

``I`` computes a stage's input gradient, which the previous stage waits for; ``W`` computes its
weight gradient, which nothing waits for, so ``W`` can move into what would be idle time. Legend:
``p`` ranks, ``m`` microbatches; costs below assume ``F = I = W`` (the paper's assumption).

* **ZB-H1** (the paper's section 2.1, Figure 3 top): 1F1B with the backward split, one stage per
  rank. Rank ``r`` runs the same warm-up and the same ``F``/``I`` order as 1F1B, and each ``W``
  ``r`` rounds after its ``I``: its last ``r`` weight gradients run at the end, where they fill
  the cool-down bubble. Makespan ``3m + p - 1`` for ``m >= p`` (bubble ``(p-1) / (3m + p - 1)``,
  a third of 1F1B's idle time); every rank holds at most ``p`` microbatches from ``F`` to ``W``,
  which is 1F1B's peak (rank 0's).
* **ZB-H2** (section 2.2, Figure 3 bottom): ZB-H1 with more forwards in the warm-up. Rank ``r``
  runs ``2(p - 1 - r)`` warm-up forwards, so ``2(p - r) - 1`` forwards come before its first
  ``I``: the time it would wait for its first output gradient is filled with forwards. It runs
  each ``W`` ``2r`` rounds after its ``I`` (``r`` for ``m < 2p - 2``). Every rank then holds up to
  ``min(2p - 1, m)`` microbatches from ``F`` to ``W`` (ZB-H1: ``p``). The paper's zero bubble
  also needs its optimizer step without synchronization (post-validation); here a step ends
  with the optimizer step after every gradient, so under free messages the makespan is ZB-H1's,
  ``3m + p - 1``. What the microbatches in flight buy is slack: each input gradient and each
  activation arrives before it is needed, so a message latency ``c`` up to one action's time
  costs ``(p - 1) c`` per step for ``m >= 2p - 1``, where ZB-H1 loses at least ``4(p - 1) c``
  (neighbouring ranks take turns, each waiting for the other's last message).
* **ZB-V** (section 6): two stages per rank in a V (rank ``r`` holds stages ``r`` and
  ``2p - 1 - r``), each stage half a rank's share of the model. Rank ``r`` runs ``2(p - r) - 1``
  forwards of its first stage, then ``r`` pairs of forwards (second stage, first stage), then
  ``p - r`` rounds of ``F I W`` on its second stage; in the steady phase each round is
  ``F I W`` on the first stage then ``F I W`` on the second; the cool-down runs ``r`` pairs of
  ``I`` (first, second stage), then ``p - r`` times ``I W`` on the first stage with the put-off
  ``W`` in the order of their ``I``. For ``m >= 2p - 1`` this is exactly the table the authors'
  scheduler (``zbv.PipelineGraph``) builds for ``F = I = W`` and free communication; with stages
  costing 1 per action, the makespan is ``6m + p - 1``: the ranks only idle in the start-up and
  drain skew of ``p - 1`` actions (bubble ``(p - 1) / (6m + p - 1)``: half of ZB-H1's idle time).
  The busiest rank holds ``2 * min(p, m)`` (stage, microbatch) pairs of half size: 1F1B's peak.
  Fewer microbatches are allowed: the table is built for ``2p - 1`` and the actions of the
  missing microbatches dropped, which stays valid with a somewhat larger bubble (never more
  than 1F1B's).
"""

from __future__ import annotations

from collections import deque

from lightning_pipe.schedule._checks import check_grid, check_positive
from lightning_pipe.schedule._gc import gc_paused
from lightning_pipe.schedule.action import F, I, W, Action


@gc_paused
def zb_h1(num_stages: int, num_microbatches: int) -> tuple:
    """Return ZB-H1's compute actions, one tuple per rank (rank ``s`` runs stage ``s``).

    Example:
        >>> for row in zb_h1(2, 2): print(" ".join(map(str, row)))
        0F0 0F1 0I0 0W0 0I1 0W1
        1F0 1I0 1F1 1I1 1W0 1W1
    """
    check_grid(num_stages, num_microbatches)
    return _split_one_f_one_b(num_stages, num_microbatches, [num_stages - s - 1 for s in range(num_stages)],
                              list(range(num_stages)))


@gc_paused
def zb_h2(num_stages: int, num_microbatches: int) -> tuple:
    """Return ZB-H2's compute actions, one tuple per rank (rank ``s`` runs stage ``s``).

    Example:
        >>> for row in zb_h2(2, 4): print(" ".join(map(str, row)))
        0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
        1F0 1I0 1F1 1I1 1F2 1I2 1W0 1F3 1I3 1W1 1W2 1W3
    """
    check_grid(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    put_off = 2 if m >= 2 * p - 2 else 1  # with fewer microbatches, twice ZB-H1's put-off W only lengthen the step
    return _split_one_f_one_b(p, m, [2 * (p - s - 1) for s in range(p)], [put_off * s for s in range(p)])


def _split_one_f_one_b(num_stages: int, num_microbatches: int, warmups: list, put_off: list) -> tuple:
    """1F1B with the backward split: stage ``s`` runs ``warmups[s]`` forwards, then rounds of ``F I W``
    (no ``F`` once every forward ran), each ``W`` ``put_off[s]`` rounds after its ``I`` (the last
    ``put_off[s]`` at the end of the row)."""
    m = num_microbatches
    tables = []
    for s in range(num_stages):
        warmup = min(warmups[s], m)
        row = [Action(F, s, i) for i in range(warmup)]
        done = 0  # weight gradients run so far
        for i in range(m):
            if warmup + i < m:
                row.append(Action(F, s, warmup + i))
            row.append(Action(I, s, i))
            if i >= put_off[s]:
                row.append(Action(W, s, done))
                done += 1
        row.extend(Action(W, s, j) for j in range(done, m))
        tables.append(tuple(row))
    return tuple(tables)


_new = tuple.__new__  # Action(...) without NamedTuple's argument handling: generation is hot


class _Rank:
    """One rank's ZB-V row as it is built: counters per stage, and the ``W`` put off so far."""

    def __init__(self, first: int, second: int, num_microbatches: int) -> None:
        self.stages = (first, second)
        self.num_microbatches = num_microbatches
        self.forwards = [0, 0]
        self.inputs = [0, 0]
        self.pending: deque = deque()
        self.row: list = []

    def forward(self, chunk: int) -> None:
        i = self.forwards[chunk]
        self.forwards[chunk] = i + 1
        self._emit(F, self.stages[chunk], i)

    def input(self, chunk: int) -> None:
        i = self.inputs[chunk]
        self.inputs[chunk] = i + 1
        self._emit(I, self.stages[chunk], i)
        self.pending.append((self.stages[chunk], i))

    def weight(self) -> None:
        self._emit(W, *self.pending.popleft())

    def _emit(self, kind: str, stage_index: int, microbatch_index: int) -> None:
        if microbatch_index < self.num_microbatches:  # the microbatches past it only shape the table
            self.row.append(_new(Action, (kind, stage_index, microbatch_index, None)))


@gc_paused
def zbv(num_ranks: int, num_microbatches: int) -> tuple:
    """Return ZB-V's compute actions, one tuple per rank (rank ``r`` runs stages ``r`` and ``2p-1-r``).

    Example:
        >>> for row in zbv(2, 3): print(" ".join(map(str, row)))
        0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 0I1 3W2 0I2 0W1 0W2
        1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 1I1 2I2 1I2 2W1 1W1 2W2 1W2
    """
    check_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p = num_ranks
    n = max(2 * p - 1, num_microbatches)  # microbatches the table is built for; the extra are dropped
    tables = []
    for r in range(p):
        rank = _Rank(r, 2 * p - 1 - r, num_microbatches)
        for _ in range(2 * (p - r) - 1):
            rank.forward(0)
        for _ in range(r):
            rank.forward(1)
            rank.forward(0)
        for _ in range(p - r):
            _second_stage_round(rank, n)
        while rank.forwards[1] < n:
            if rank.forwards[0] < n:
                rank.forward(0)
            rank.input(0)
            rank.weight()
            _second_stage_round(rank, n)
        _cool_down(rank, r, p)
        tables.append(tuple(rank.row))
    return tuple(tables)


def _second_stage_round(rank: _Rank, n: int) -> None:
    rank.forward(1)
    rank.input(1)
    if rank.forwards[1] < n:  # the last round puts its W off to the cool-down
        rank.weight()


def _cool_down(rank: _Rank, r: int, p: int) -> None:
    for _ in range(r):
        rank.input(0)
        rank.input(1)
    for _ in range(p - r):
        rank.input(0)
        rank.weight()
    while rank.pending:
        rank.weight()
