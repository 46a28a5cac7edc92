"""Averaging a rank's gradients over its data-parallel replicas while the backward still runs.

Each parameter gets a post-accumulate-grad hook. The executor *arms* a stage just before that
stage's last backward of the step (its last ``B``, or its last ``W`` when backwards are split),
so a hook that fires then sees the parameter's final gradient of the step. Parameters are put in
buckets per stage, in the order the stages finish and, within a stage, in reverse registration
order (roughly the order a backward finishes them); a bucket whose parameters are all final is
copied into one flat buffer and all-reduced asynchronously while the backward goes on, as DDP
does. Buckets start strictly in order, so every replica issues the same collectives in the same
order. When the step ends, buckets not started yet (a parameter unused in the last microbatch
never fires) start, every bucket is waited for and divided by the number of replicas, and the
averages are copied back into ``.grad`` (a parameter without a gradient gets the average of the
others', zeros included, as under DDP; one without a gradient on every replica keeps none, as on
one process over the whole batch: a flag per parameter rides in the bucket).

Exactness: the all-reduce sums the same values as an all-reduce after the step would, so the
result equals that of :func:`lightning_pipe.gradients.average` after the step. Gradients
accumulated in earlier steps must still be in ``.grad`` when the last backward runs (an
accumulated gradient set aside and added back later would miss the average). Tied parameters
are left out of the buckets: the pipeline sums their gradients over the stages after the step,
then averages them here in :meth:`ReplicaSync.finish` (sums and averages commute; doing the tie
sum first keeps gradients accumulated in earlier steps out of the tie sum).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.schedule.action import B, W

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


class _Bucket:
    """Parameters all-reduced together through one flat buffer: their gradients, then a flag per parameter
    (1 where this replica has a gradient), so that one no replica's step used keeps no gradient."""

    __slots__ = ("params", "flat", "final", "work", "missing")

    def __init__(self, params: List[nn.Parameter]) -> None:
        self.params = params
        size = sum(p.numel() for p in params) + len(params)
        self.flat = torch.empty(size, dtype=params[0].dtype, device=params[0].device)
        self.final = 0  # parameters whose gradient is final this step
        self.work = None
        self.missing = False  # whether a parameter of this bucket had no gradient here at the launch

    def launch(self, group) -> None:
        offset, flags = 0, self.flat[-len(self.params):]
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                self.flat[offset : offset + n].zero_()
            else:
                self.flat[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n
        present = [p.grad is not None for p in self.params]
        self.missing = not all(present)
        # from pinned memory without blocking: this runs in the backward's hooks, which must not wait for the GPU
        flags.copy_(torch.tensor(present, dtype=flags.dtype, pin_memory=flags.is_cuda), non_blocking=True)
        self.work = dist.all_reduce(self.flat, group=group, async_op=True)

    def settle(self, size: int) -> None:
        """Wait for the sum and copy the average back into ``.grad`` (of the parameters some replica used)."""
        self.work.wait()
        self.work = None
        self.flat.div_(size)
        # the flags are read (on a GPU, a wait for it) only where this replica lacked a gradient: one it has is used
        used = self.flat[-len(self.params):].tolist() if self.missing else None
        offset = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            average = self.flat[offset : offset + n].view_as(p)
            offset += n
            if used is not None and not used[i]:
                continue
            if p.grad is None:
                p.grad = average.clone()
            else:
                p.grad.copy_(average)


class _Plan:
    """The buckets of one schedule row, and where in the row each stage is armed."""

    def __init__(self, buckets: List[_Bucket], bucket_of: Dict[nn.Parameter, _Bucket], arm_at: Dict[int, int],
                 owned: Dict[int, set]) -> None:
        self.buckets = buckets
        self.bucket_of = bucket_of
        self.arm_at = arm_at  # row position -> stage armed just before it
        self.owned = owned  # stage -> the parameters whose gradient is final in its last backward


class ReplicaSync:
    """Averages gradients over ``group`` with bucketed all-reduces overlapped with the backward.

    Args:
        stages: per local stage, ``(stage_index, its parameters)``.
        group: the data-parallel group of this rank's stages (the replicas).
        exclude: parameters averaged at the end instead (tied parameters).
        bucket_bytes: the largest bucket (a parameter larger than it gets its own).
    """

    def __init__(self, stages: Sequence[Tuple[int, Sequence[nn.Parameter]]], group, exclude: Sequence = (),
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.bucket_bytes = bucket_bytes
        excluded = {id(p) for p in exclude}
        self.excluded = [p for p in dict.fromkeys(exclude) if p.requires_grad]
        self.params_of = {s: [p for p in dict.fromkeys(params) if p.requires_grad and id(p) not in excluded]
                          for s, params in stages}
        self._plans: Dict[object, _Plan] = {}
        self._plan: Optional[_Plan] = None
        self._armed: set = set()
        self._next = 0
        self.started_early = 0  # buckets of the last step started while its backward ran
        self._handles = [p.register_post_accumulate_grad_hook(self._on_final)
                         for p in dict.fromkeys(p for params in self.params_of.values() for p in params)]

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def begin(self, key: object, row: Sequence) -> Dict[int, Callable[[], None]]:
        """Start a step that runs ``row``; returns the executor's ``before`` map (arming stages)."""
        if key not in self._plans:
            self._plans[key] = self._make_plan(row)
        plan = self._plan = self._plans[key]
        for bucket in plan.buckets:
            bucket.final = 0
        self._armed = set()
        self._next = 0
        self.started_early = 0
        return {position: (lambda s=s: self._armed.update(plan.owned[s])) for position, s in plan.arm_at.items()}

    def _make_plan(self, row: Sequence) -> _Plan:
        last: Dict[int, int] = {}
        for position, action in enumerate(row):
            if action[0] in (B, W) and action[1] in self.params_of:
                last[action[1]] = position
        stages = sorted(last, key=last.get)  # in the order they finish
        owner_stage = {}
        for s in stages:
            for p in self.params_of[s]:
                owner_stage[p] = s  # a parameter on several local stages is final when the last one is
        buckets: List[_Bucket] = []
        bucket_of: Dict[nn.Parameter, _Bucket] = {}
        for s in stages:
            for group in self._split([p for p in reversed(self.params_of[s]) if owner_stage[p] == s]):
                bucket = _Bucket(group)
                buckets.append(bucket)
                bucket_of.update((p, bucket) for p in group)
        owned = {s: {p for p, o in owner_stage.items() if o == s} for s in stages}
        return _Plan(buckets, bucket_of, {last[s]: s for s in stages}, owned)

    def _split(self, params: List[nn.Parameter]) -> List[List[nn.Parameter]]:
        groups: List[List[nn.Parameter]] = []
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            fits = groups and groups[-1][0].dtype == p.dtype and groups[-1][0].device == p.device
            if not fits or size + nbytes > self.bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        return groups

    def _on_final(self, p: nn.Parameter) -> None:
        if p not in self._armed or self._plan is None:
            return
        self._armed.discard(p)
        bucket = self._plan.bucket_of[p]
        bucket.final += 1
        buckets = self._plan.buckets
        while self._next < len(buckets) and buckets[self._next].final == len(buckets[self._next].params):
            buckets[self._next].launch(self.group)
            self._next += 1
            self.started_early += 1

    def finish(self) -> None:
        """Start what is left, wait for everything, and put the averages in ``.grad``."""
        plan, self._plan = self._plan, None
        if plan is None:
            return
        for bucket in plan.buckets[self._next:]:
            bucket.launch(self.group)
        for bucket in plan.buckets:
            bucket.settle(self.size)
        self._armed = set()
        tied = [_Bucket(group) for group in self._split(self.excluded)]
        for bucket in tied:
            bucket.launch(self.group)
        for bucket in tied:
            bucket.settle(self.size)


def broadcast_from_replica_zero(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """What DDP's ``broadcast_buffers`` (and its parameter sync at wrap time) does: ``tensors`` take the values of the
    group's rank 0, in buckets. Every replica of a stage holds the same tensors (meta ones, released, left out).
    Through torch's own coalesced broadcast, the one DDP uses."""
    held = [t.detach() for t in tensors if not t.is_meta]
    if held:
        dist._broadcast_coalesced(group, held, BUCKET_BYTES, 0)
