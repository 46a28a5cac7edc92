"""The per-step pieces of PipeStrategy's glue that were rewritten for speed give what they replaced."""

import inspect

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_pipe import Pipeline, partition
from lightning_pipe.lightning.logs import bind_log_call
from lightning_pipe.lightning.objects import broadcast_object, post_share, share_object
from tests.distributed import run

LOG_CALLS = [
    (("loss", 1.0), {}),
    (("loss", torch.tensor(2.0)), {"prog_bar": True, "batch_size": 3}),
    (("acc", 0.5, True, False, True, False, "sum"), {}),
    (("acc", 0.5, True), {"on_epoch": True, "sync_dist": True, "rank_zero_only": True}),
    ((), {"name": "loss", "value": 3.0, "reduce_fx": max}),
]


@pytest.mark.parametrize("args, kwargs", LOG_CALLS)
def test_a_log_call_binds_as_inspect_binds_it(args, kwargs):
    bound = inspect.signature(LightningModule.log).bind(None, *args, **kwargs)
    bound.apply_defaults()
    expected = {k: v for k, v in bound.arguments.items() if k != "self"}
    assert bind_log_call(*args, **kwargs) == expected


@pytest.mark.parametrize("args, kwargs", [(("loss", 1.0), {"prog_bars": True}), (("loss", 1.0, True), {"prog_bar": True}),
                                          (("loss", 1.0) + (False,) * 14, {}), (("loss",), {})])
def test_a_log_call_lightning_refuses_is_refused(args, kwargs):
    with pytest.raises(TypeError):
        inspect.signature(LightningModule.log).bind(None, *args, **kwargs)
    with pytest.raises(TypeError):
        bind_log_call(*args, **kwargs)


def _payload():
    grad = torch.ones(2, requires_grad=True) * 3  # torch pickles it: NumPy has no autograd
    return {
        "loss": torch.tensor(0.1, dtype=torch.float64), "ints": torch.arange(5), "flags": torch.tensor([True, False]),
        "strided": torch.arange(12.0).reshape(3, 4).t(), "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "half": torch.tensor([0.1], dtype=torch.float16), "neg": torch.arange(3.0)._neg_view(),
        "calls": [{"name": "loss", "value": torch.tensor(0.25), "reduce_fx": "mean"}], "n": 7, "none": None,
        "grad": grad.detach().requires_grad_(),
    }


def _described(obj):
    return {k: (v.dtype, v.tolist(), v.requires_grad) if isinstance(v, torch.Tensor) else v
            for k, v in obj.items() if k != "calls"}, obj["calls"][0]["value"].item()


def _broadcast(rank, world_size):
    return _described(broadcast_object(_payload() if rank == 1 else None, 1, torch.distributed.group.WORLD))


def test_broadcast_object_gives_every_rank_the_same_values_and_dtypes():
    (received, value), (sent, sent_value) = run(_broadcast, 2, timeout=60)
    assert received == sent and value == sent_value == 0.25
    assert received["bf16"][0] is torch.bfloat16 and received["neg"][1] == [-0.0, -1.0, -2.0]
    assert received["grad"][2] is True and received["strided"][1] == torch.arange(12.0).reshape(3, 4).t().tolist()


SHARES = ((1, False), (2, True), (0, False), (2, True), (1, True))  # (source, receive posted before the step)


def _share(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(world_size)])
    pipe = Pipeline(partition(model, rank, world_size), chunks=2)
    shared = []
    for step, (src, ahead) in enumerate(SHARES):  # between pipeline steps, from a middle, the last and the first rank
        posted = post_share(pipe.transport, src) if ahead else None
        pipe.forward_backward(*((torch.randn(4, 4),) if rank == 0 else ()), labels=(torch.randn(4, 4),) if rank == 2 else (),
                              criterion=nn.functional.mse_loss if rank == 2 else None)
        payload = _payload() if rank == src else None
        if payload is not None:
            payload["n"] = step
            payload["big"] = torch.arange(2000.0 * step)  # from step 1 on, longer than the first message
        shared.append(_described(share_object(payload, pipe.transport, src, posted)))
    return shared


def test_share_object_gives_every_pipeline_rank_what_the_source_sent():
    """Whether or not the receive was posted before the step, and when the data does not fit the first
    message (the big tensor from step 1 on: 8 kB against FIRST_BYTES)."""
    results = run(_share, 3, timeout=60)
    for step in range(len(SHARES)):
        (received, value), expected = results[0][step], _described({**_payload(), "n": step,
                                                                    "big": torch.arange(2000.0 * step)})
        assert received == expected[0] and value == expected[1] == 0.25
        assert all(r[step] == results[0][step] for r in results)
    assert results[1][0][0]["bf16"][0] is torch.bfloat16 and results[1][0][0]["grad"][2] is True
