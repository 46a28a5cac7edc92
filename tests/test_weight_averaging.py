"""Lightning's weight averaging callbacks (``EMAWeightAveraging``) under PipeStrategy, against DDP.

Each stage averages its own tensors (see ``lightning_pipe.lightning.averaging``). The app (its
``main`` runs in the shared launches of ``tests/lm_app.py``, see ``APPS`` in conftest.py) trains
with an EMA for 2 epochs, validating each epoch with the averaged weights, saves checkpoints, then
resumes from the last one for a third epoch. Unit tests of the per-stage copy first.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lightning_pipe.lightning.averaging import StageAverage


def test_the_stage_copy_holds_real_tensors_only_where_the_module_does():
    module = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1, device="meta"))
    copy = StageAverage(module, torch.device("cpu"))
    shapes = [(tuple(t.shape), t.is_meta) for t in list(copy.parameters()) + list(copy.buffers())]
    assert shapes == [((3, 2), False), ((3,), False), ((3,), False), ((3,), False), ((1, 3), True), ((1,), True),
                      ((3,), False), ((3,), False), ((), False)]
    module[0].weight.data.fill_(2.0)
    copy.copy_from(module)
    assert torch.equal(copy.weight_0, module[0].weight) and copy.weight_0 is not module[0].weight
    module[1].weight = nn.Parameter(torch.empty(3, device="meta"))  # released after the first step
    copy.follow_releases(module)
    assert copy.weight_2.is_meta and not copy.weight_0.is_meta and not copy.buffer_0.is_meta


# -- against DDP (in the shared launches) -----------------------------------------------------------
def main(kind: str, root: str, out: str) -> None:
    """The app trained under DDP (1 device, ``kind="ddp"``; 2: ``"ddp2"``) and PipeStrategy (2 stages, ``"pipe"``,
    or with sharded checkpoints ``"pipe_sharded"``; 2 stages x 2 replicas: ``"pipe2x2"``; 1 stage x 2 replicas:
    ``"pipe1x2"``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_pipe
    from lightning_pipe.consolidate import consolidate
    from tests.models import regression_data

    filtered = kind.endswith("_filtered")  # one fit whose checkpoint hook deletes an entry by name (no resume)
    kind = kind.removesuffix("_filtered")

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Linear(4, 8)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.embed(x)
            self.log("h_mean", h.mean())  # the last stage's copy of `embed`: refreshed after validation swapped it
            return nn.functional.mse_loss(self.head(self.body(h)).squeeze(-1), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            h = self.embed(x)
            self.log("val_h", h.mean())
            self.log("val_loss", nn.functional.mse_loss(self.head(self.body(h)).squeeze(-1), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

        def on_save_checkpoint(self, checkpoint):
            if filtered:  # after the callback put its averages there: deleted from them, as under DDP
                del checkpoint["state_dict"]["head.bias"]

    class Seen(pl.Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.rows.append(torch.stack([outputs["loss"].detach(), trainer.callback_metrics["h_mean"]]))

        def on_validation_epoch_end(self, trainer, module):
            self.rows.append(torch.stack([trainer.callback_metrics["val_loss"], trainer.callback_metrics["val_h"]]))

    data = regression_data(24)
    results = {}
    phases = (("first", 2, None), ("resumed", 3, os.path.join(root, "ckpt", "last.ckpt")))
    for phase, epochs, resume in phases[:1] if filtered else phases:
        pl.seed_everything(0)
        strategy = DDPStrategy() if kind.startswith("ddp") else \
            lightning_pipe.PipeStrategy(pipe_size=1 if kind == "pipe1x2" else 2, num_microbatches=1,
                                        log_pipeline_metrics=False,
                                        state_dict_type="sharded" if kind == "pipe_sharded" else "full")
        seen = Seen()
        devices = {"ddp": 1, "pipe": 2, "pipe_sharded": 2, "ddp2": 2, "pipe2x2": 4, "pipe1x2": 2}[kind]
        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                             max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[EMAWeightAveraging(decay=0.5), seen,
                                        ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_last=True)],
                             num_sanity_val_steps=0, default_root_dir=root)
        model = Model()
        loader = torch.utils.data.DataLoader(data, batch_size=6)
        trainer.fit(model, loader, loader, ckpt_path=resume)
        after = trainer.validate(model, loader, verbose=False)[0]  # the averaged weights, whole
        if trainer.is_global_zero:
            last = os.path.join(root, "ckpt", "last.ckpt")
            saved = consolidate(last) if os.path.isdir(last) else torch.load(last, map_location="cpu", weights_only=False)
            results[phase] = {
                "rows": torch.stack(seen.rows).cpu(), "after": after,
                "state_dict": {k: v.cpu() for k, v in model.state_dict().items()},
                "checkpoint": {key: saved[key] for key in ("state_dict", "current_model_state", "averaging_state")},
            }
    if results:
        torch.save(results, out)


def test_a_checkpoint_hook_deletes_an_averaged_entry_by_name_as_under_ddp(lm_runs):
    """Regression: the hook got the callback's per-stage copy (`weight_0`, ...), so deleting `head.bias` raised
    KeyError, and a filter over it was undone by the whole averaged state put in afterwards; a sharded save then
    refused current weights with more keys than the averaged ones."""
    want = lm_runs("reference")[0]["test_weight_averaging_ddp_filtered"]["first"]["checkpoint"]
    got = lm_runs("world2")[0]["test_weight_averaging_pipe_sharded_filtered"]["first"]["checkpoint"]
    assert "head.bias" not in want["state_dict"] and "head.bias" in want["current_model_state"]
    for part in ("state_dict", "current_model_state"):
        assert got[part].keys() == want[part].keys()
        for key, value in want[part].items():
            torch.testing.assert_close(got[part][key], value, msg=lambda m: f"{part} {key}: {m}")


@pytest.mark.parametrize("layout", ["p2", "p2_sharded", "2x2", "1x2"])
@pytest.mark.parametrize("phase", ["first", "resumed"])
def test_an_ema_trained_validated_saved_and_resumed_matches_ddp(lm_runs, phase, layout):
    """Regression: EMAWeightAveraging stopped the first step ('Cannot copy out of meta tensor'): its copy of the
    whole module was zipped with a stage's tensors. Validation sees the averaged weights, the checkpoint holds them
    with the current ones beside, and a resumed fit continues both; with replicas too (against DDP on 2). Regression
    (1x2): with one stage the callback keeps its own copy, which the strategy took for a per-stage one (AttributeError
    'follow_releases' after the first step). With sharded checkpoints (refused before), the current weights are
    sharded beside the averaged ones and come back on resume."""
    if layout.startswith("p2"):
        want = lm_runs("reference")[0]["test_weight_averaging_ddp"][phase]
        got = lm_runs("world2")[0]["test_weight_averaging_pipe" + layout[2:]][phase]
    else:
        want = lm_runs("world2")[0]["test_weight_averaging_ddp2"][phase]
        got = lm_runs("world4")[0]["test_weight_averaging_2x2"][phase] if layout == "2x2" else \
            lm_runs("world2")[0]["test_weight_averaging_1x2"][phase]
    steps = 4 if layout.startswith("p2") else 2  # per epoch (replicas share the 4 batches)
    epochs = 2 if phase == "first" else 1
    assert want["rows"].shape == (steps * epochs + epochs + 1, 2)  # steps, validations and the one after fit
    torch.testing.assert_close(got["rows"], want["rows"])
    assert got["after"] == pytest.approx(want["after"], rel=1e-5)
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, msg=lambda m: f"{key}: {m}")
    for part, state in want["checkpoint"].items():
        assert got["checkpoint"][part].keys() == state.keys()
        for key, value in state.items():
            torch.testing.assert_close(got["checkpoint"][part][key], value, msg=lambda m: f"{part} {key}: {m}")
    averaged, current = want["checkpoint"]["state_dict"], want["checkpoint"]["current_model_state"]
    assert any(not torch.equal(averaged[k], current[k]) for k in averaged)  # the test can tell them apart
