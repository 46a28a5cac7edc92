"""Modules outside the body that the first training step does not train everywhere: frozen at first, used late.

Which stage owns (trains, clips, saves) a parameter outside the body is learned from the first
step: the stage that computed its gradient, or, for one no stage computed a gradient for (a head
frozen in ``__init__``), the stage that called its module. A module released after the first step
refuses to run, a gradient on a stage the first step did not learn is refused, and so is a training
loss that does not require grad: each with a named error.

Its ``main`` is the app the test against DDP trains (``kind`` "ddp" or "pipe"), run in the shared
launches of ``tests/lm_app.py`` (see ``APPS`` in conftest.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from lightning_pipe import ConfigurationError  # noqa: E402
from lightning_pipe.lightning import release  # noqa: E402
from lightning_pipe.lightning.layer_list import CallChannel  # noqa: E402
from lightning_pipe.lightning.losses import loss_of  # noqa: E402
from lightning_pipe.lightning.split import SplitModel  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 1)


def _split(rank: int, net: Net) -> SplitModel:
    return SplitModel(net, "body", net.body, [2, 2], rank, (0, 1), CallChannel(None))


# -- ownership (no launch) -----------------------------------------------------------------------
def test_a_parameter_no_stage_computed_a_gradient_for_belongs_to_the_stage_that_called_its_module():
    """Regression: the frozen head defaulted to stage 0, which had released it (meta copy saved, clip skipped it)."""
    split = _split(0, Net())
    split.learn_usage([["embed.weight", "embed.bias"], []], [["embed"], ["embed", "head"]])
    assert split.owner_of("embed.weight") == 0  # trained on the first stage
    assert split.owner_of("head.weight") == split.owner_of("head.bias") == 1  # frozen, called after the body
    assert split.owner_of("aux.weight") == 1  # never called: kept (and saved) by the last stage
    split.learn_usage([[], []], [["embed"], ["embed", "head"]])
    assert split.owner_of("embed.weight") == 0  # frozen embedding: the first stage's call counts, not the rerun
    assert split.owned_keys(["embed.weight", "head.weight"]) == {"embed.weight"}
    split.learn_usage([[], []])  # without the calls: the last stage, which runs all of the step's code
    assert split.owner_of("head.weight") == 1


def test_a_released_module_refuses_to_run_with_a_named_error_and_an_owned_one_is_kept():
    net = Net()
    net.head.requires_grad_(False)
    split = _split(0, net)
    net.embed.weight.grad = torch.zeros_like(net.embed.weight)
    net.embed.bias.grad = torch.zeros_like(net.embed.bias)
    split.learn_usage([["embed.weight", "embed.bias"], []], [["embed"], ["embed", "head"]])
    split.release_unused({id(net.embed)}, [])
    assert net.head.weight.is_meta and net.aux.weight.is_meta and not net.embed.weight.is_meta
    with pytest.raises(ConfigurationError, match=r"self\.head \(Linear\) was called on pipeline rank 0 .*released"):
        net.head(torch.zeros(1, 8))
    net.embed(torch.zeros(1, 4))  # used here: runs
    # torch's error for a released weight read as an attribute (`x * self.head.weight.sum()`), named (review)
    read = RuntimeError("Tensor on device meta is not on the expected device cpu!")
    with pytest.raises(ConfigurationError, match=r"validation_step computed with a tensor on the meta device .*"
                                                 r"released the weights of \['self\.head', 'self\.aux'\]"):
        release.explain_meta_error(read, net, "body", "validation_step")
    release.explain_meta_error(RuntimeError("shapes differ"), net, "body", "validation_step")  # another: left alone

    last = Net()
    split = _split(1, last)
    split.learn_usage([["embed.weight", "embed.bias"], []], [["embed"], ["embed", "head"]])
    split.release_unused({id(last.embed), id(last.head)}, [])
    assert not last.head.weight.is_meta and not last.aux.weight.is_meta  # aux: owned here, saved from here
    last.aux(torch.zeros(1, 8))


def test_a_module_whose_parameter_or_buffer_is_read_without_a_call_counts_as_used():
    """Regression: `self.pos.weight[:n]` (frozen) and a buffer read as an attribute were not calls, so the module
    was released after the first step and the second stopped on torch's error about meta tensors."""
    from lightning_pipe.lightning.release import reads_paused, reads_recorded, uses_recorded

    net = Net()
    net.pos = nn.Embedding(6, 8).requires_grad_(False)
    net.stats = nn.Module()
    net.stats.register_buffer("center", torch.zeros(8))
    with uses_recorded(net, "body") as used:
        with reads_recorded():  # around the user's step
            h = net.embed(torch.zeros(2, 4)) + net.pos.weight[:2]
            h = torch.cat([h, net.stats.center[None]])  # inside a list
            net.body(h)
        _ = [p.sum() for p in net.parameters()]  # the machinery around the step: not uses
        with reads_recorded(), reads_paused():  # the body's layers run from the step: not looked at
            _ = net.aux.weight.sum()
    assert used >= {id(net.embed), id(net.pos), id(net.stats)} and not used & {id(net.head), id(net.aux)}
    assert id(net.body) in used  # calls of any module are recorded, as before
    split = _split(0, net)
    split.learn_usage([[], []], [["embed", "pos", "stats"], []])
    split.release_unused(used, [])
    assert not net.pos.weight.is_meta and not net.stats.center.is_meta and net.head.weight.is_meta


def test_a_gradient_on_a_stage_the_first_step_did_not_learn_is_refused():
    """A module called on both stages, frozen at the first step (owned by the first stage), then unfrozen:
    a gradient on the last stage would be neither summed with the first stage's nor saved."""
    net = Net()
    net.embed.requires_grad_(False)
    split = _split(1, net)
    split.learn_usage([[], ["head.weight", "head.bias"]], [["embed"], ["embed", "head"]])
    split.release_unused({id(net.embed), id(net.head)}, [])
    net.head(torch.ones(2, 8)).sum().backward()  # learned here: fine
    net.embed(torch.ones(2, 4)).sum()  # frozen: nothing to refuse
    net.embed.requires_grad_(True)
    with pytest.raises(ConfigurationError, match=r"`embed\.(weight|bias)` .* got a gradient on pipeline rank 1"):
        net.embed(torch.ones(2, 4)).sum().backward()


def test_the_lightning_modules_own_frozen_parameters_belong_to_the_stage_that_read_each_and_are_watched():
    """Regression (review): a frozen `temp` used after the body belonged to the first stage because it read
    `pos` (before the body), another parameter of the same LightningModule; unfrozen later, the last stage
    trained it, and before every step it was reset to the first stage's copy, silently. Its own reads decide
    now; and a gradient on a stage that does not own it is refused, as for a module's (no step calls the
    LightningModule, whose forward pre-hook watched for the unfreezing)."""
    def net_with_own():
        net = Net()
        net.pos, net.temp = nn.Parameter(torch.zeros(8)), nn.Parameter(torch.ones(()), requires_grad=False)
        return net

    split = _split(0, net_with_own())
    split.learn_usage([["pos"], []], [[""], ["", "head"]], [["pos"], ["pos", "temp"]])
    assert split.owner_of("pos") == 0 and split.owner_of("temp") == 1
    assert "temp" in split.trained_on_last(set())  # never overwritten on the last stage
    split.learn_usage([["pos"], []], [[""], ["", "head"]], [["pos", "temp"], ["pos", "temp"]])
    assert split.owner_of("temp") == 0  # read before the body (the last stage's rerun of that code is discarded)
    net = net_with_own()
    last = _split(1, net)
    last.learn_usage([["pos"], []], [[""], ["", "head"]], [["pos", "temp"], ["pos", "temp"]])
    last.release_unused({id(net.head)}, [])
    assert [name for name, _ in last.pending_own] == ["temp"]
    last.hook_unfrozen()  # still frozen: still pending
    assert [name for name, _ in last.pending_own] == ["temp"]
    net.temp.requires_grad_(True)
    last.hook_unfrozen()
    assert last.pending_own == []
    with pytest.raises(ConfigurationError, match=r"`temp` .* got a gradient on pipeline rank 1"):
        (net.temp * 2).backward()


def test_a_training_loss_that_does_not_require_grad_is_refused():
    with pytest.raises(ConfigurationError, match="training_step returned a tensor that does not require grad"):
        loss_of(torch.zeros(()), "training_step")
    w = nn.Parameter(torch.ones(()))
    with pytest.raises(ConfigurationError, match="a dict whose 'loss'"):
        loss_of({"loss": (w * 2).detach()}, "training_step")
    frozen = nn.Linear(2, 1).requires_grad_(False)
    activation = torch.ones(1, 2, requires_grad=True)  # received from the previous stage
    assert loss_of(frozen(activation).sum(), "training_step").requires_grad  # frozen last stage: fine
    with torch.no_grad():
        loss_of(w * 2, "training_step")  # no backward here (e.g. a forward under checkpointing)
    assert loss_of(torch.zeros(()), "validation_step", required=False) is not None


# -- against DDP (in the shared launches) -----------------------------------------------------------
def main(kind: str, root: str, out: str) -> None:
    """The app trained under DDP (1 device, ``kind="ddp"``) and PipeStrategy (2 stages, ``kind="pipe"``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_pipe
    from tests.models import regression_data

    class Model(pl.LightningModule):
        """Embedding and head frozen in __init__, unfrozen at epoch 1; an aux head used from step 2 on."""

        def __init__(self) -> None:
            super().__init__()
            net = Net()
            self.embed, self.body, self.head, self.aux = net.embed, net.body, net.head, net.aux
            self.embed.requires_grad_(False)
            self.head.requires_grad_(False)

        def on_train_epoch_start(self):
            if self.current_epoch == 1:
                self.embed.requires_grad_(True)
                self.head.requires_grad_(True)

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.body(self.embed(x))
            loss = nn.functional.mse_loss(self.head(h).squeeze(-1), y)
            if self.global_step >= 2:
                loss = loss + 0.5 * nn.functional.mse_loss(self.aux(h).squeeze(-1), y)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

    class Losses(pl.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].detach().cpu())

    pl.seed_everything(0)
    data = regression_data(24)
    strategy = lightning_pipe.PipeStrategy(num_microbatches=3, log_pipeline_metrics=False) if kind == "pipe" \
        else DDPStrategy(find_unused_parameters=True)
    losses = Losses()
    checkpoint = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=2 if kind == "pipe" else 1, strategy=strategy, max_epochs=3,
                         gradient_clip_val=0.05, callbacks=[losses, checkpoint], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root)
    model = Model()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=12))
    if trainer.is_global_zero:
        saved = torch.load(checkpoint.best_model_path, map_location="cpu", weights_only=False)["state_dict"]
        torch.save({"state_dict": {k: v.cpu() for k, v in model.state_dict().items()}, "losses": losses.losses,
                    "checkpoint": saved}, out)


def test_a_head_frozen_at_first_then_unfrozen_with_clipping_and_checkpoints_trains_as_under_ddp(lm_runs):
    """Regression: the frozen head was owned by stage 0, which had released it: the checkpoint save failed
    ('Cannot copy out of meta tensor') and, unfrozen, it was left out of the global clip norm."""
    want = lm_runs("reference")[0]["test_outside_body_usage_ddp"]
    got = lm_runs("world2")[0]["test_outside_body_usage_pipe"]
    assert len(got["losses"]) == len(want["losses"]) == 6
    torch.testing.assert_close(torch.stack(got["losses"]), torch.stack(want["losses"]))
    for what in ("state_dict", "checkpoint"):
        assert got[what].keys() == want[what].keys()
        for key, value in want[what].items():
            torch.testing.assert_close(got[what][key], value, msg=lambda m: f"{what} {key}: {m}")
    assert not torch.equal(want["state_dict"]["head.weight"], Net().head.weight.detach())  # unfrozen, trained
