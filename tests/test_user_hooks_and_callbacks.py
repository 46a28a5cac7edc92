"""The user's own gradient code and Lightning's callbacks under PipeStrategy, against Lightning DDP.

Its ``main`` (``kind`` "pipe" or "ddp") runs in the shared launches of ``tests/lm_app.py`` (see
``APPS`` in conftest.py), a fit and a resume from its epoch-1 checkpoint in the same processes:

- ``on_before_optimizer_step`` calls ``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)`` itself
  and logs what it returns, plus ``get_total_norm`` of a subset (the body's gradients, inf-norm)
  and of every gradient (1-norm): each must be the whole model's, as under DDP;
- a ``BaseFinetuning`` callback freezes the head and the body (through an alias, ``self.backbone``,
  as ``BackboneFinetuning`` wants it) before training and adds both as a new param group at epoch 1
  (the head is released, meta, on the first stage by then);
- the checkpoint saved after that epoch holds both param groups and resumes to DDP's weights;
- ``ReduceLROnPlateau`` on a metric the last stage logs, ``LearningRateMonitor`` and
  ``GradientAccumulationScheduler`` run as under DDP (the learning rates are logged rows).

LBFGS, ZeroRedundancyOptimizer, stochastic weight averaging and pruning callbacks are refused at setup
without a launch.
"""

from __future__ import annotations

import math
import warnings
import os
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import (  # noqa: E402
    BaseFinetuning, EMAWeightAveraging, GradientAccumulationScheduler, LearningRateMonitor, ModelCheckpoint,
    ModelPruning, StochasticWeightAveraging)
from lightning.pytorch.loggers import Logger  # noqa: E402

from lightning_pipe import ConfigurationError, PipeStrategy  # noqa: E402

MAX_NORM = 0.05


class Rows(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "rows"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append({"step": step, **{k: float(v) for k, v in metrics.items()}})


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.backbone = self.body  # the same module under a second name (BackboneFinetuning's)

    def forward(self, x):
        return self.head(self.body(self.embed(x))).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), MAX_NORM)
        body_inf = torch.nn.utils.get_total_norm([p.grad for p in self.body.parameters() if p.grad is not None],
                                                 norm_type=math.inf)
        all_one = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None], 1.0)
        self.log_dict({"user_norm": norm, "body_inf_norm": body_inf, "clipped_one_norm": all_one})

    def on_save_checkpoint(self, checkpoint):
        # what a "save the trainable weights only" hook reads (LoRA-style checkpoints)
        checkpoint["trainable_seen"] = sorted(n for n, p in self.named_parameters() if p.requires_grad)
        for name, p in self.named_parameters():
            if not p.requires_grad:
                del checkpoint["state_dict"][name]  # by name: every DDP process holds every key

    def configure_optimizers(self):
        optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.2, momentum=0.9)
        # mode="max" on a falling loss: the rate halves after every epoch but the first
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss"}}


class UnfreezeHeadAndBackbone(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze([pl_module.head, pl_module.backbone])

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group([pl_module.head, pl_module.backbone], optimizer, lr=0.1)


def _loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(36, 4, generator=g)
    y = x.sum(1) * 0.5 + 0.1 * torch.randn(36, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=12)


def _fit(kind, folder, resume=None):
    pl.seed_everything(0)
    model, rows = Model(), Rows()
    strategy = PipeStrategy(num_microbatches=3, schedule="gpipe", log_pipeline_metrics=False) \
        if kind == "pipe" else "ddp"
    trainer = pl.Trainer(
        accelerator="cpu", devices=2 if kind == "pipe" else 1, strategy=strategy, max_epochs=3, logger=rows,
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder,
        callbacks=[UnfreezeHeadAndBackbone(), ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1),
                   LearningRateMonitor(logging_interval="step"), GradientAccumulationScheduler({1: 2})],
    )
    trainer.fit(model, _loader(), ckpt_path=resume)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return trainer, rows.rows, weights


def main(kind: str, root: str, out: str) -> None:
    """The app trained under DDP (1 device, ``kind="ddp"``) and PipeStrategy (2 stages, ``kind="pipe"``)."""
    trainer, rows, weights = _fit(kind, os.path.join(root, "fit"))
    checkpoint = os.path.join(root, "fit", "epoch=1.ckpt")
    resumed_trainer, resumed_rows, resumed = _fit(kind, os.path.join(root, "resumed"), resume=checkpoint)
    if trainer.is_global_zero:
        saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
        first = torch.load(os.path.join(root, "fit", "epoch=0.ckpt"), map_location="cpu", weights_only=False)
        torch.save(dict(rows=rows, weights=weights, resumed_rows=resumed_rows, resumed=resumed,
                        checkpoint=dict(state_dict=saved["state_dict"], optimizer_states=saved["optimizer_states"]),
                        trainable_seen=[first["trainable_seen"], saved["trainable_seen"]],
                        saved_keys=[sorted(first["state_dict"]), sorted(saved["state_dict"])]), out)


# -- the tests -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(lm_runs):
    return lm_runs("world2")[0]["test_user_hooks_and_callbacks_pipe"], lm_runs("reference")[0]["test_user_hooks_and_callbacks_ddp"]


def _assert_rows(got, want):
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for g, w in zip(got, want):
        for key in w:
            torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=1e-7, msg=lambda m, k=key, s=w["step"]: f"{k} at step {s}: {m}")


def _assert_weights(got, want):
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_a_users_clip_grad_norm_and_get_total_norm_take_the_whole_models_norm(runs):
    """Regression: clip_grad_norm_(self.parameters(), ...) in a hook clipped each stage by its own norm
    (DDP 0.9777, pipe 0.8160) and returned it."""
    pipe, ddp = runs
    assert any(r.get("user_norm", 0) > MAX_NORM for r in ddp["rows"])  # it clips
    _assert_rows(pipe["rows"], ddp["rows"])
    _assert_weights(pipe["weights"], ddp["weights"])


def test_base_finetuning_adds_a_released_module_and_the_body_as_a_param_group_as_under_ddp(runs):
    """Regressions: unfreeze_and_add_param_group crashed in filter_on_optimizer (torch.equal on meta tensors);
    unfreezing the body crashed in BaseFinetuning._store (KeyError: other stages' layers have no name here)."""
    pipe, ddp = runs
    groups = [[len(g["params"]), g["lr"]] for g in ddp["checkpoint"]["optimizer_states"][0]["param_groups"]]
    assert groups == [[2, 0.2], [6, 0.1]]
    rates = {(r.get("lr-SGD"), r.get("lr-SGD/pg1"), r.get("lr-SGD/pg2")) for r in ddp["rows"]} - {(None,) * 3}
    assert rates == {(0.2, None, None), (None, 0.2, 0.1), (None, 0.1, 0.05)}  # the group added, the plateau's cut
    assert any("user_norm" in r and r["epoch"] == 2 for r in ddp["rows"])
    _assert_weights(pipe["weights"], ddp["weights"])


def test_a_checkpoint_saved_after_a_param_group_was_added_saves_and_resumes_as_under_ddp(runs):
    """Regression: the optimizer layouts recorded at setup left the added group out of the checkpoint."""
    pipe, ddp = runs
    got, want = pipe["checkpoint"], ddp["checkpoint"]
    _assert_weights(got["state_dict"], want["state_dict"])
    g_opt, w_opt = got["optimizer_states"][0], want["optimizer_states"][0]
    assert [{k: v for k, v in g.items()} for g in g_opt["param_groups"]] == w_opt["param_groups"]
    assert g_opt["state"].keys() == w_opt["state"].keys()
    for index in w_opt["state"]:
        torch.testing.assert_close(g_opt["state"][index]["momentum_buffer"], w_opt["state"][index]["momentum_buffer"],
                                   rtol=1e-5, atol=1e-7)
    _assert_rows(pipe["resumed_rows"], ddp["resumed_rows"])
    _assert_weights(pipe["resumed"], ddp["resumed"])


def test_on_save_checkpoint_sees_the_whole_model_as_under_ddp(runs):
    """Regression (review): `self.named_parameters()` in on_save_checkpoint listed this stage's parameters only, so a
    "keep the trainable weights" filter over the checkpoint dropped the other stages' trained layers from the file
    and a resume restarted them from their initial values. The body and head frozen in epoch 0, unfrozen after."""
    pipe, ddp = runs
    frozen, unfrozen = ddp["trainable_seen"]
    assert frozen == ["embed.bias", "embed.weight"] and len(unfrozen) == 8
    assert pipe["trainable_seen"] == ddp["trainable_seen"]
    # and a hook deleting the frozen ones by name leaves the file DDP writes (regression: KeyError on the
    # processes that do not hold them)
    assert "head.weight" not in ddp["saved_keys"][0] and "head.weight" in ddp["saved_keys"][1]
    assert pipe["saved_keys"] == ddp["saved_keys"]


# -- refused at setup, on every rank, before any collective ----------------------------------------
def _strategy(rank):
    from lightning.fabric.plugins.environments import LightningEnvironment

    environment = LightningEnvironment()
    environment.set_world_size(2)
    environment.set_global_rank(rank)
    return PipeStrategy(parallel_devices=[torch.device("cpu")] * 2, cluster_environment=environment)


def _setup(strategy, module, callbacks=()):
    from lightning.pytorch.trainer.states import TrainerFn

    strategy.accelerator = mock.Mock()
    strategy.connect(module)
    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), callbacks=list(callbacks))
    strategy.setup_optimizers = lambda trainer: setattr(strategy, "optimizers", [module.configure_optimizers()])
    strategy.setup(trainer)


@pytest.mark.parametrize("rank", [0, 1])
def test_lbfgs_and_zero_are_refused_right_after_the_optimizer_is_built(rank):
    """setup calls this check on every rank right after setup_optimizers, before the collectives that follow."""
    model = Model()
    strategy = _strategy(rank)
    strategy.optimizers = [torch.optim.LBFGS(model.parameters(), lr=0.5)]
    with pytest.raises(ConfigurationError, match=r"PipeStrategy does not support LBFGS: its step calls the closure "
                                                 r"several times .* Use a first-order optimizer"):
        strategy._refuse_unsupported_optimizers()
    # regression (review VV): it trained, each process broadcasting stale copies of the other stages' layers
    from torch.distributed.optim import ZeroRedundancyOptimizer

    strategy.optimizers = [ZeroRedundancyOptimizer.__new__(ZeroRedundancyOptimizer)]  # no group here: its type only
    with pytest.raises(ConfigurationError, match=r"PipeStrategy does not support ZeroRedundancyOptimizer: it shards "
                                                 r".* use the optimizer ZeroRedundancyOptimizer wraps"):
        strategy._refuse_unsupported_optimizers()
    strategy.optimizers = [torch.optim.SGD(model.parameters(), lr=0.5)]
    strategy._refuse_unsupported_optimizers()


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("callback, name", [
    (lambda: StochasticWeightAveraging(swa_lrs=0.05), "StochasticWeightAveraging"),
    # regression: these stopped the first step with torch's errors about meta tensors
    (lambda: ModelPruning("l1_unstructured", amount=0.3), "ModelPruning"),
])
def test_callbacks_that_need_the_whole_model_in_one_process_are_refused_at_setup_before_any_collective(
        rank, callback, name):
    strategy = _strategy(rank)
    with mock.patch("torch.distributed.all_gather_object", side_effect=AssertionError("a collective")), \
            mock.patch("torch.distributed.broadcast", side_effect=AssertionError("a collective")):
        with pytest.raises(ConfigurationError,
                           match=rf"does not support the {name} callback: it .* or train with pipe_size=1$"):
            _setup(strategy, Model(), [callback()])


def test_clip_grad_norm_is_torchs_own_outside_the_gradient_hooks():
    from torch.nn.utils import clip_grad

    from lightning_pipe.lightning import hooks

    before = (clip_grad._get_total_norm, torch.nn.utils.get_total_norm)
    norm = hooks.StageNorms(SimpleNamespace())
    with pytest.raises(RuntimeError):
        with hooks.total_norms_over_stages(norm):
            assert clip_grad._get_total_norm is norm and torch.nn.utils.get_total_norm is norm
            raise RuntimeError
    assert (clip_grad._get_total_norm, torch.nn.utils.get_total_norm) == before


def test_a_loggers_writing_use_in_the_last_stages_step_warns_once_and_the_loggers_come_back(tmp_path):
    """The code after the body runs on the last stage's process, where Lightning's loggers write nothing: a step
    that logs media there (``self.logger.experiment.add_image``) did nothing, silently."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_pipe.lightning import loggers

    logger = CSVLogger(tmp_path)
    trainer = SimpleNamespace(_loggers=[logger])
    body = SimpleNamespace(called=False)
    loggers._warned["done"] = False
    with loggers.watched(trainer, "validation_step", 1, lambda: body.called):
        seen = trainer._loggers[0]
        assert isinstance(seen, CSVLogger) and seen is not logger
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            seen.experiment  # before the body: the first stage (global rank 0) runs this code too, and writes
            body.called = True
            assert seen.save_dir == logger.save_dir and seen.log_dir == logger.log_dir  # reading writes nothing
        with pytest.warns(UserWarning, match=r"validation_step used the logger's `log_metrics` after the body call\. "
                                             r"Under PipeStrategy that code runs on the last stage's process \(global "
                                             r"rank 1\)"):
            seen.log_metrics({"x": 1.0})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            seen.experiment  # once per process
    assert trainer._loggers == [logger]


def test_the_users_read_of_the_rank_after_the_body_on_the_last_stage_warns_once():
    """``if self.trainer.is_global_zero:`` after the body ran on no process (the last stage is not global rank 0),
    silently. Lightning's and our own reads do not warn; neither does a read before the body, nor one of
    ``global_rank`` (a file named by rank)."""
    from lightning.pytorch.strategies import Strategy

    from lightning_pipe.lightning import loggers

    strategy = _strategy(1)
    body = SimpleNamespace(called=False)
    loggers._warned["rank"] = False
    with loggers.watched(SimpleNamespace(_loggers=[]), "training_step", 1, lambda: body.called):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not strategy.is_global_zero  # before the body: the first stage (global rank 0) runs this code too
            body.called = True
            assert strategy.global_rank == 1 and strategy.stage_index == 1
            Strategy.remove_checkpoint(strategy, "unused.ckpt")  # Lightning's own read: on global rank 0 only
        with pytest.warns(UserWarning, match=r"training_step read `is_global_zero` after the body call\. Under "
                                             r"PipeStrategy that code runs on the last stage's process \(global rank 1\)") as caught:
            assert not strategy.is_global_zero
        assert caught[0].filename == __file__  # the user's line
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not strategy.is_global_zero  # once per process
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loggers._warned["rank"] = False
        assert not strategy.is_global_zero  # not watched: outside the last stage's step


def test_throughput_monitor_multiplies_its_global_rates_by_the_replicas_not_the_stages():
    """Regression (review II): under 2 stages x 1 replica ThroughputMonitor logged train/samples_per_sec at twice
    the samples any process saw (trainer.world_size counts every stage; each stage sees the same samples)."""
    from lightning.fabric.utilities.throughput import Throughput
    from lightning.pytorch.callbacks import ThroughputMonitor

    from lightning_pipe.lightning.hooks import count_replicas_in_throughput

    monitor = ThroughputMonitor(batch_size_fn=len)
    monitor._throughputs = {"train": Throughput(world_size=4, window_size=2), "validate": Throughput(world_size=4)}
    count_replicas_in_throughput([monitor], dp_size=2)  # 2 stages x 2 replicas
    assert [t.world_size for t in monitor._throughputs.values()] == [2, 2]
    for t, samples in zip(range(1, 4), (8, 16, 24)):
        monitor._throughputs["train"].update(time=t, batches=t, samples=samples)
    metrics = monitor._throughputs["train"].compute()
    assert metrics["samples_per_sec"] == 2 * metrics["device/samples_per_sec"] == 16
