"""Replica sync overlapped with the backward: exactly the average taken after the step.

pp = 2 stages x dp = 2 replicas on 4 processes. Each replica trains on its own data; a pipeline
with ``dp_group`` averages gradients while its last backwards run, its twin (same weights, no
``dp_group``) runs the same steps and averages afterwards with ``gradients.average``. Gradients
must be equal bit for bit, after a step that only accumulates (``sync_replicas=False``) and one
that syncs, for every schedule, with a tie across ranks (1F1B) and within one rank (ZB-V).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe import Pipeline, make_subgroups, partition
from lightning_pipe.gradients import average
from lightning_pipe.replicas import _Bucket
from lightning_pipe.schedule import ALL_SCHEDULES
from tests import distributed
from tests.test_schedules_engine import MODELS, _batch


def _unique(parts) -> list:
    return list({id(p): p for part in parts for p in part.parameters()}.values())


def _parts(full, pp_rank: int, schedule: str, v):
    spec = ALL_SCHEDULES[schedule]
    return partition(full, pp_rank, 2, num_model_chunks=spec.virtual_stages(v), placement=spec.placement)


def _case(pp_rank: int, dp_rank: int, pp_group, dp_group, model: str, schedule: str, v, m: int) -> int:
    build, criterion, _ = MODELS[model]
    full = build()
    twin = copy.deepcopy(full)
    parts, twin_parts = _parts(full, pp_rank, schedule, v), _parts(twin, pp_rank, schedule, v)
    pipe = Pipeline(parts, chunks=m, process_group=pp_group, schedule=schedule, virtual_stages=v, dp_group=dp_group)
    pipe.replicas.bucket_bytes = 400  # several buckets even for these small stages
    reference = Pipeline(twin_parts, chunks=m, process_group=pp_group, schedule=schedule, virtual_stages=v)
    params, twin_params = _unique(parts), _unique(twin_parts)
    opt, twin_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(twin_params, lr=0.1)
    gen = torch.Generator().manual_seed(10 + dp_rank)  # replicas see different data
    early = 0
    for step, sync in enumerate((False, True, True)):
        x, y = _batch(model, 2 * m, gen)
        pipe.forward_backward(x, criterion=criterion, labels=(y,), sync_replicas=sync)
        early += pipe.replicas.started_early if sync else 0
        reference.forward_backward(x, criterion=criterion, labels=(y,))
        if sync:
            average(twin_params, dp_group, 2)
        for name, (a, b) in enumerate(zip(params, twin_params)):
            assert torch.equal(a.grad, b.grad), f"{model} {schedule} step {step}: parameter {name} differs"
        if sync:
            opt.step(), twin_opt.step()
            opt.zero_grad(), twin_opt.zero_grad()
    pipe.replicas.close()
    return early


def _grid(rank: int, world: int, cases) -> list:
    dp_group, pp_group = make_subgroups(2, 2)
    pp_rank, dp_rank = dist.get_rank(pp_group), dist.get_rank(dp_group)
    return [_case(pp_rank, dp_rank, pp_group, dp_group, *case) for case in cases]


def test_overlapped_replica_sync_equals_the_average_after_the_step():
    cases = [("mlp", s, v, 4) for s, v in (("gpipe", None), ("1f1b", None), ("zb_h1", None), ("zb_h2", None), ("zbv", None),
                                            ("interleaved_1f1b", 2))]
    cases += [("tied", "1f1b", None, 3), ("tied", "zbv", None, 3)]
    early = distributed.run(_grid, 4, cases, timeout=240)
    for rank, counts in enumerate(early):
        for case, count in zip(cases, counts):
            assert count > 0, f"rank {rank}, {case}: no bucket started before the step's end"


def _used_by_some_replicas(rank: int, world: int) -> list:
    results = []
    for path in ("after the step", "bucket", "bucket complete on rank 0"):
        everywhere, on_rank_0, nowhere = (nn.Parameter(torch.zeros(n)) for n in (3, 2, 2))
        frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
        everywhere.grad = torch.full((3,), rank + 1.0)
        if rank == 0:
            on_rank_0.grad = torch.full((2,), 4.0)  # an expert only replica 0's tokens reached
        params = [everywhere, on_rank_0, nowhere, frozen]
        if path == "after the step":
            half = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))  # one flat buffer of mixed dtypes: float32
            if rank == 0:
                half.grad = torch.full((2,), 4.0, dtype=torch.bfloat16)
            average(params + [half], None, world)
            assert half.grad.dtype == torch.bfloat16 and half.grad.tolist() == [2.0] * 2
        else:
            if path == "bucket complete on rank 0":  # rank 0 takes the average without reading the flags, rank 1 reads them
                params = [everywhere, on_rank_0]
            bucket = _Bucket([p for p in params if p.requires_grad])
            bucket.launch(None)
            assert bucket.missing == (rank == 1 or path == "bucket")
            bucket.settle(world)
        results.append([None if p.grad is None else p.grad.tolist() for p in params])
    return results


def test_a_parameter_some_replicas_did_not_use_is_averaged_with_zeros_and_one_none_used_keeps_no_gradient():
    """Regression: the average after the step flattened only this replica's gradients, so replicas whose steps
    used different modules (a mixture of experts) all-reduced buffers of different layouts (gloo aborted the
    process; NCCL may hang or mix values); the bucket inside the step gave a parameter no replica used a zero
    gradient, which AdamW still steps (weight decay, momentum) where one process over the whole batch skips it."""
    for rank, per_path in enumerate(distributed.run(_used_by_some_replicas, 2, timeout=120)):
        for path, grads in zip(("after the step", "bucket"), per_path):
            assert grads == [[1.5] * 3, [2.0] * 2, None, None], (rank, path, grads)
        assert per_path[2] == [[1.5] * 3, [2.0] * 2], (rank, per_path[2])
