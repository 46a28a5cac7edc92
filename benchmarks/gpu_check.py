"""Checks that need a GPU, run by hand on a CUDA machine (CI has none).

1. NCCL transport: two ranks run GPipe, 1F1B and ZB-H1 and must match the unpipelined model's
   gradients; the peak CUDA memory of each is printed; ZB-H2 must be refused with a
   ConfigurationError before any communication (its grouped messages could deadlock). Needs two
   GPUs: NCCL 2.28 refuses two ranks on one device ("Duplicate GPU detected"), so on one GPU this
   check reports that error.
2. PipeStrategy on one GPU (NCCL, ``precision="bf16-mixed"``): the body runs under bf16 autocast
   and training matches Lightning's DDP with the same precision.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_pipe import ConfigurationError, GPipe, PipeDream, ZeroBubbleH1, ZeroBubbleH2, partition  # noqa: E402


def _model(width: int = 1024, depth: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


def _nccl_rank(rank: int, world: int, store_path: str, results) -> None:
    try:
        device = rank % torch.cuda.device_count()
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                device_id=torch.device("cuda", device))
        full = _model().cuda()
        reference = copy.deepcopy(full)
        x = torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        y = torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        nn.functional.mse_loss(reference(x), y).backward()
        report = {}
        for name, cls in (("gpipe", GPipe), ("1f1b", PipeDream), ("zb_h1", ZeroBubbleH1)):
            stage = partition(copy.deepcopy(full), rank, world)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            pipe = cls(stage, chunks=8, count_activations=True)
            loss, _ = pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
            torch.cuda.synchronize()
            grads = dict(reference.named_parameters())
            worst = max((p.grad - grads[n].grad).abs().max().item() for n, p in stage.named_parameters())
            report[name] = {"max_grad_diff": worst, "peak_MiB": (torch.cuda.max_memory_allocated() - base) / 2**20,
                            "meter_peak_KiB": pipe.stage.meter.peak_bytes / 1024}
        try:
            ZeroBubbleH2(partition(copy.deepcopy(full), rank, world), chunks=8)
            report["zb_h2"] = "NOT refused"
        except ConfigurationError as error:
            report["zb_h2"] = f"refused: {str(error)[:60]}..."
        results.put((rank, "ok", report))
        dist.destroy_process_group()
    except Exception:
        results.put((rank, "error", traceback.format_exc()[-1500:]))


def check_nccl() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_nccl_rank, args=(r, 2, os.path.join(tmp, "s"), results)) for r in range(2)]
        for p in procs:
            p.start()
        for _ in procs:
            try:
                print("nccl", results.get(timeout=180))
            except Exception as exc:
                print("nccl: no answer", exc)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def check_bf16_strategy() -> None:
    import lightning.pytorch as pl

    import lightning_pipe

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
            self.dtypes = set()

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.body(x)
            self.dtypes.add(out.dtype)
            loss = nn.functional.mse_loss(out.float(), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 64, generator=g), torch.randn(256, 1, generator=g))
    states = {}
    for name, strategy in (("ddp", "ddp"), ("pipe", lightning_pipe.PipeStrategy(pipe_size=1, num_microbatches=4))):
        pl.seed_everything(0)
        model = Net()
        trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_epochs=2,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=32))
        states[name] = {k: v.float().cpu() for k, v in model.state_dict().items()}
        print(name, "dtypes in step:", model.dtypes, "loss:", float(trainer.callback_metrics["loss"]))
    worst = max((states["pipe"][k] - states["ddp"][k]).abs().max().item() for k in states["ddp"])
    print("bf16 PipeStrategy vs DDP, max weight difference:", worst)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version())
    for check in (check_nccl, check_bf16_strategy):
        try:
            check()
        except Exception:
            traceback.print_exc()
