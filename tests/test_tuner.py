"""Lightning's learning rate finder (``Tuner(trainer).lr_find``) under PipeStrategy, against DDP.

The finder trains inside its ``on_fit_start``, then restores the checkpoint it saved before; the
fit that follows starts from the restored weights with the rate found. The app (its ``main`` runs
in the shared launches of ``tests/lm_app.py``, see ``APPS`` in conftest.py) runs both.
"""

from __future__ import annotations

import torch
from torch import nn


def main(kind: str, root: str, out: str) -> None:
    """The app tuned and trained under DDP (1 device, ``kind="ddp"``) and PipeStrategy (2 stages, ``kind="pipe"``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.tuner import Tuner

    import lightning_pipe
    from tests.models import regression_data

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lr = 0.1
            self.embed = nn.Linear(4, 8)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.head(self.body(self.embed(x))).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    pl.seed_everything(0)
    data = regression_data(160)
    strategy = lightning_pipe.PipeStrategy(num_microbatches=2, log_pipeline_metrics=False) if kind == "pipe" \
        else DDPStrategy()
    trainer = pl.Trainer(accelerator="cpu", devices=2 if kind == "pipe" else 1, strategy=strategy, max_epochs=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=root)
    model = Model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    loader = torch.utils.data.DataLoader(data, batch_size=8)  # 20 batches: one epoch holds the search
    found = Tuner(trainer).lr_find(model, train_dataloaders=loader, num_training=20, early_stop_threshold=None)
    restored = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        torch.save({"losses": torch.tensor(found.results["loss"]), "lrs": torch.tensor(found.results["lr"]),
                    "lr": model.lr, "initial": initial, "restored": restored,
                    "state_dict": {k: v.cpu() for k, v in model.state_dict().items()}}, out)


def test_the_learning_rate_finder_and_the_fit_after_it_match_ddp(lm_runs):
    """Regression: the finder trained while the unsplit body was installed (its on_fit_start ran before the split
    was put back), and restoring its checkpoint then stopped on meta tensors."""
    want = lm_runs("reference")[0]["test_tuner_ddp"]
    got = lm_runs("world2")[0]["test_tuner_pipe"]
    assert len(want["losses"]) == 20
    torch.testing.assert_close(got["losses"], want["losses"])
    torch.testing.assert_close(got["lrs"], want["lrs"])
    assert got["lr"] == want["lr"] != 0.1  # the suggestion was applied
    for key, value in want["initial"].items():
        torch.testing.assert_close(want["restored"][key], value)  # the finder restores what it trained from
        torch.testing.assert_close(got["restored"][key], value)
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, msg=lambda m: f"{key}: {m}")
