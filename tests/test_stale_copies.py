"""The last stage's copies of modules the first stage trains: values computed from them.

The last stage reruns the user's step whole, with its own copy of an embedding the first stage
trains. Values that only feed the body are discarded; one that is logged, read into Python,
written into a metric's state or returned must come from an up-to-date copy, before the body or
after it (a module the loss calls under ``torch.no_grad()``). Unit tests of the
marking first; then one model trained under DDP (1 device) and PipeStrategy (2 stages) in the
shared launches of ``tests/lm_app.py`` (see ``APPS`` in conftest.py): it logs a value of its
embedding before the body every step, updates a metric with it and returns it.
"""

from __future__ import annotations

import os
import queue
import threading

import pytest
import torch
from torch import nn

from lightning_pipe import StaleValueError
from lightning_pipe.lightning.stale import Stale, StaleCopies, unmark


def _model():
    torch.manual_seed(0)
    model = nn.Module()
    model.embed, model.pos, model.head = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)
    model.pos.requires_grad_(False)
    return model


HEAD = {"head.weight", "head.bias"}  # what the last stage trains: its copy of `head` stays fresh


def _copies(model):
    return StaleCopies(model, "body", watch=True)


# -- marking and sinks -----------------------------------------------------------------------------
def test_outputs_are_marked_only_while_watched():
    model = _model()
    copies = _copies(model)
    x = torch.ones(2, 3)
    assert type(model.embed(x)) is torch.Tensor  # not watching
    with copies.watching():
        h = model.embed(x) + model.pos(x)
        assert isinstance(h, Stale) and h._sources == {"embed", "pos"}
        assert isinstance(model.head(torch.ones(2, 3)), Stale)  # until the first step tells what the last stage trains
    assert type(h * 2) is torch.Tensor  # kept past the step: stops spreading
    assert copies.noted == {}
    copies.learn([], kept=HEAD)
    with copies.watching():
        assert type(model.head(torch.ones(2, 3))) is torch.Tensor and isinstance(model.embed(x), Stale)


@pytest.mark.parametrize("use, what", [
    (lambda h, state: h.sum().item(), "read into Python (item)"),
    (lambda h, state: bool(h.isnan().any()), "read into Python (__bool__)"),
    (lambda h, state: h.tolist(), "read into Python (tolist)"),
    (lambda h, state: float(h.mean().detach()), "read into Python (__float__)"),
    (lambda h, state: torch.equal(h, h), "read into Python (equal)"),
    (lambda h, state: state.add_(h.sum()), "written into a tensor (add_)"),
    (lambda h, state: state.__iadd__(h.sum()), "written into a tensor (add_)"),  # `state += h.sum()`
    (lambda h, state: state.copy_(h.mean()), "written into a tensor (copy_)"),
    (lambda h, state: torch.mul(h.detach().sum(), 2, out=state), "written into a tensor (mul)"),
    (lambda h, state: unmark({"loss": h.sum()}, "returned by training_step"), "returned by training_step"),
])
def test_a_marked_value_reaching_a_sink_notes_its_module(use, what):
    model = _model()
    copies = _copies(model)
    state = torch.zeros(())  # a metric's state
    with copies.watching():
        use(model.embed(torch.ones(2, 3)), state)
    assert copies.noted == {"embed": what}


def test_metadata_printing_and_values_that_feed_the_body_are_no_sinks():
    model = _model()
    copies = _copies(model)
    with copies.watching():
        h = model.embed(torch.ones(2, 3))
        _ = h.shape, h.size(0), h.dim(), h.numel(), len(h), h.dtype, h.device, h.requires_grad, h.is_floating_point()
        _ = repr(h), f"{h.sum():.3f}", hash(h)
        rows = list(h)  # iteration keeps the mark
        assert all(isinstance(r, Stale) for r in rows)
        h = nn.functional.dropout(h * 2 + 1, 0.1).reshape(3, 2)
        assert isinstance(h, Stale)
    assert copies.noted == {}


def test_marked_values_keep_their_graph_and_unmark_gives_plain_tensors():
    model = _model()
    copies = _copies(model)
    with copies.watching():
        loss = unmark(model.embed(torch.ones(2, 3)).pow(2).sum(), "returned by training_step")
    assert type(loss) is torch.Tensor
    loss.backward()
    expected = torch.autograd.grad(model.embed(torch.ones(2, 3)).pow(2).sum(), model.embed.weight)[0]
    torch.testing.assert_close(model.embed.weight.grad, expected)


def test_parameters_read_as_attributes_are_marked_and_keep_their_gradients():
    """Regression: `x @ self.embed.weight.T` passes through no module call, so its value reached a log unnoticed."""
    model = _model()
    copies = _copies(model)
    weight = model.embed.weight
    with copies.watching():
        assert isinstance(model.embed.weight, Stale) and model.embed.weight._sources == {"embed"}
        h = torch.ones(2, 3) @ model.embed.weight.T + model.pos.bias[:3]
        assert isinstance(h, Stale) and h._sources == {"embed", "pos"}
        loss = unmark(h.pow(2).sum(), "returned by training_step")
    assert model.embed.weight is weight and type(weight) is nn.Parameter  # the parameter is back after the step
    assert copies.noted == {"embed": "returned by training_step", "pos": "returned by training_step"}
    loss.backward()
    torch.testing.assert_close(weight.grad, 2 * (torch.ones(2, 3) @ weight.T + model.pos.bias).T @ torch.ones(2, 3))
    copies.learn(sorted(copies.noted), kept=HEAD)
    model.extra = nn.Linear(3, 3)
    copies = _copies(model)
    copies.learn([], kept=HEAD)
    with copies.watching():
        with pytest.raises(StaleValueError, match=r"`self\.extra` and it was read into Python"):
            model.extra.weight.sum().item()
    assert type(model.extra.weight) is nn.Parameter


def test_the_marked_aliases_are_made_once_per_parameter_and_grad_mode():
    """Made anew on every microbatch, they added about 0.02 to glue_vs_plain (benchmarks/glue_cost.py, alternating
    runs against the code before them)."""
    model = _model()
    copies = _copies(model)
    with copies.watching():
        first = model.embed.weight
    with copies.watching():
        assert model.embed.weight is first and isinstance(first, Stale)
    model.embed.weight.requires_grad_(False)  # frozen later (BaseFinetuning)
    with copies.watching():
        frozen = model.embed.weight
        assert frozen is not first and not frozen.requires_grad
    model.embed.weight = nn.Parameter(torch.zeros(3, 3))  # another parameter object (a resume, a release)
    with copies.watching():
        assert model.embed.weight is not frozen and not model.embed.weight.any()


def test_reusing_a_marked_alias_runs_no_torch_function(monkeypatch):
    """Telling whether an alias is still current read its own ``requires_grad``, through Stale's
    ``__torch_function__`` (a pytree walk): 0.4 ms a step on the last stage of benchmarks/glue_cost.py."""
    model = _model()
    copies = _copies(model)
    with copies.watching():
        pass
    calls = []
    original = Stale.__torch_function__.__func__
    monkeypatch.setattr(Stale, "__torch_function__",
                        classmethod(lambda cls, *args, **kwargs: calls.append(args[0]) or original(cls, *args, **kwargs)))
    with copies.watching():
        assert isinstance(model.embed.weight, Stale)
    assert calls == []


# -- after the first step ---------------------------------------------------------------------------
def test_after_the_first_step_noted_copies_are_synced_and_a_late_use_of_another_is_refused():
    model = _model()
    model.extra = nn.Linear(3, 3)
    copies = _copies(model)
    with copies.watching():
        model.embed(torch.ones(2, 3)).sum().item()
    assert copies.learn(sorted(copies.noted), kept=HEAD) == ["embed"]
    with copies.watching():
        assert type(model.embed(torch.ones(2, 3))) is torch.Tensor  # synced: no longer followed
        model.pos(torch.ones(2, 3)).sum().item()  # frozen: its copy cannot be out of date
        h = model.extra(torch.ones(2, 3))
        h = h * 2  # feeding the body: fine
        late = r"`self\.extra` and it was read into Python \(item\), a use the first training step did not make"
        with pytest.raises(StaleValueError, match=late):
            h.sum().item()


def test_modules_left_unwatched_lose_their_hooks():
    model = _model()
    model.custom = nn.Bilinear(3, 3, 3)  # watched, and not of a kind known to be pure: keeps its marking hook
    copies = _copies(model)
    copies.learn(["pos"], kept=HEAD)
    assert set(copies._handles) == {"custom"} and not model.pos._forward_hooks and not model.head._forward_hooks
    assert not model.embed._forward_hooks  # watched, but it skips its computation and marks its output itself


def test_after_the_first_step_a_watched_pure_module_skips_its_computation_on_the_last_stage():
    """Its output can only feed the body (any other use raises), so after one real call per input shape the last
    stage hands back zeros of the output's shape, marked; outside a watched step, and for a deep copy (an EMA
    teacher), the module computes."""
    import copy

    model = _model()
    model.custom = nn.Bilinear(3, 3, 3)  # not of a kind known to be pure: never skipped
    copies = _copies(model)
    copies.learn([], kept=HEAD)
    assert set(copies._skipped) == {id(model.embed), id(model.pos)}
    x = torch.randn(4, 3)
    teacher = copy.deepcopy(model)
    with copies.watching():
        first, again, other = model.embed(x), model.embed(x * 2), model.embed(torch.randn(2, 5, 3))
        from_copy = teacher.embed(x)
        with pytest.raises(StaleValueError):
            again.sum().item()
    assert isinstance(again, Stale) and again._sources == {"embed"}
    assert again.shape == (4, 3) and again.requires_grad and not again.any()  # skipped
    torch.testing.assert_close(first.as_subclass(torch.Tensor), nn.functional.linear(x, model.embed.weight,
                                                                                  model.embed.bias))
    assert other.shape == (2, 5, 3) and other.any()  # a new input shape: computed once
    assert type(from_copy) is torch.Tensor and from_copy.any()  # a deep copy (an EMA teacher) computes, unmarked
    assert model.embed(x).any()  # not watching: computes
    copies.remove()
    assert "forward" not in model.embed.__dict__ and not model.embed._forward_hooks


def test_a_skipping_module_hands_back_the_same_zeros_until_a_step_writes_into_them():
    """Made once per input shape (a new tensor, its mark and the marking hook every microbatch cost 0.06 ms after
    the step's matrix products); after a step wrote into them, the next call gets new zeros, not what was written."""
    model = _model()
    copies = _copies(model)
    copies.learn([], kept=HEAD)
    x = torch.randn(4, 3)
    with copies.watching():
        model.embed(x)  # the one real call for this shape
        first, again = model.embed(x), model.embed(x)
        assert first is again
        with torch.no_grad():  # (without it torch refuses to write into a tensor requiring grad)
            first.add_(1.0)  # a step writing into them: they now hold ones
        fresh = model.embed(x)
        assert fresh is not first and isinstance(fresh, Stale) and fresh._sources == {"embed"}
        assert fresh.requires_grad
        with torch._C.DisableTorchFunctionSubclass():
            assert not fresh.any()
        assert model.embed(x) is fresh
    copies.remove()
    assert "forward" not in model.embed.__dict__ and not model.embed._forward_hooks


def test_a_skipping_module_frozen_or_under_inference_mode_hands_back_zeros_a_step_can_use():
    """Regressions of the zeros handed back again: a frozen module's written by ``h += pos`` (a trainable operand)
    came back requiring grad, and the next ``h += pos`` was refused as a write into a leaf requiring grad; under
    ``torch.inference_mode()`` reading their version raised."""
    model = _model()
    model.embed.requires_grad_(False)
    copies = _copies(model)
    copies.learn([], kept=HEAD)
    x, pos = torch.randn(4, 3), nn.Parameter(torch.ones(3))
    with copies.watching():
        for _ in range(3):
            h = model.embed(x)
            h += pos  # feeds the body
        assert not model.embed(x).requires_grad
        with torch.inference_mode():
            first, again = model.embed(x), model.embed(x)
    assert isinstance(again, Stale) and again.shape == (4, 3) and again is not first
    with torch._C.DisableTorchFunctionSubclass():
        assert not again.any()
    copies.remove()
    assert copies._shapes == {} and copies._zeros == {}


class _Transport:
    """A rank of a two-rank pipeline run in a thread of this process: what send_bytes sends, recv_bytes returns."""

    def __init__(self, pp_rank, queues):
        self.pp_rank, self.queues, self.batched = pp_rank, queues, False

    def send_bytes(self, data, peers):
        assert peers == [1 - self.pp_rank]
        self.queues[self.pp_rank].put(data)

    def recv_bytes(self, peer, what):
        assert peer == 1 - self.pp_rank
        return self.queues[peer].get(timeout=10)


def test_refresh_sends_what_the_step_needs_once_per_optimizer_step():
    """Training steps: the synced modules' trainable parameters and buffers; evaluation steps: every stale module's.
    The other way, the parameters only the last stage trains that the first stage reads."""
    first, last = _model(), _model()
    queues = [queue.Queue(), queue.Queue()]  # what rank 0 sent, what rank 1 sent
    first.extra, last.extra = nn.Linear(3, 3), nn.Linear(3, 3)
    first.embed.register_buffer("running", torch.ones(3))
    last.embed.register_buffer("running", torch.zeros(3))
    first.offset, last.offset = nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(3))  # the module's own
    first.temp, last.temp = nn.Parameter(torch.ones(())), nn.Parameter(torch.zeros(()))  # its own, used after the body
    first.scale, last.scale = nn.Parameter(torch.ones(())), nn.Parameter(torch.zeros(()))  # its own, after the body
    with torch.no_grad():
        for p in first.parameters():
            p.add_(1.0)  # the first stage trained its copies
        last.head.weight.add_(2.0)  # and the last stage its own
    ranks = [StaleCopies(first, "body", watch=False), StaleCopies(last, "body", watch=True)]

    def refresh(training):
        threads = [threading.Thread(target=copies.refresh, args=(_Transport(rank, queues), 0, 1, training))
                   for rank, copies in enumerate(ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert queues[0].empty() and queues[1].empty()

    for copies in ranks:
        # the last stage trains `temp`, `scale` and `embed.bias` itself (a parameter read after the body)
        kept = {"head.weight", "head.bias", "temp", "scale", "embed.bias"}
        # the first stage's code reads `temp` in training steps (`embed(x) * temp.detach()`), may read any of its
        # own and the head's in evaluation steps
        assert copies.learn(["embed", "pos", "head"], kept=kept, behind=["temp"],
                            behind_in_evaluation=["temp", "scale", "head.weight", "head.bias"]) == ["", "embed", "pos"]
        assert copies.stale == ["", "embed", "extra", "pos"]
    refresh(training=True)  # no optimizer step yet: nothing sent
    assert not torch.equal(last.embed.weight, first.embed.weight) and first.temp.item() == 2.0
    for copies in ranks:
        copies.stepped()
    refresh(training=True)
    torch.testing.assert_close(last.embed.weight, first.embed.weight)
    torch.testing.assert_close(last.embed.running, first.embed.running)  # buffers too (running statistics)
    torch.testing.assert_close(last.offset, first.offset)  # read as an attribute: always kept in sync
    # trained on the last stage: never overwritten, though their modules are refreshed (regression: the trained
    # `temp` was reset to the first stage's untrained copy before every step)
    assert last.temp.item() == 0.0 and torch.equal(last.embed.bias, _model().embed.bias)
    # and sent the other way when the first stage reads it (regression: the first stage computed with its own copy)
    assert first.temp.item() == 0.0 and first.scale.item() == 2.0
    assert not torch.equal(last.pos.weight, first.pos.weight)  # frozen: not sent
    assert not torch.equal(last.extra.weight, first.extra.weight)  # not used beyond the body in training
    assert not torch.equal(last.head.weight, first.head.weight)  # trained on the last stage, not read on the first
    refresh(training=False)
    torch.testing.assert_close(last.extra.weight, first.extra.weight)  # evaluation: every stale copy
    torch.testing.assert_close(first.head.weight, last.head.weight)  # and what the first stage may read
    assert first.scale.item() == 0.0
    with torch.no_grad():
        first.extra.weight.add_(1.0)
    refresh(training=False)  # no optimizer step since: nothing sent
    assert not torch.equal(last.extra.weight, first.extra.weight)


# -- against DDP (in the shared launches) -----------------------------------------------------------
def main(kind: str, root: str, out: str) -> None:
    """The app trained under DDP (1 device, ``kind="ddp"``) and PipeStrategy (2 stages, ``kind="pipe"``)."""
    import lightning.pytorch as pl
    import torchmetrics
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_pipe
    from tests.models import regression_data

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.shift, self.probe = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(4, 8)
            self.keep = nn.Linear(4, 1)
            self.direct = nn.Linear(4, 8)  # its weight is read as an attribute, through no call
            self.table = nn.Embedding(5, 8).requires_grad_(False)  # read as an attribute too, frozen
            self.stats = nn.Module()
            self.stats.register_buffer("center", torch.linspace(-1, 1, 8))  # a buffer read as an attribute
            self.offset = nn.Parameter(torch.zeros(8))  # the LightningModule's own, used before the body
            self.temp = nn.Parameter(torch.ones(()))  # its own too, used after the body: trained on the last stage
            self.scale = nn.Parameter(torch.ones(()), requires_grad=False)  # after the body, unfrozen in epoch 1
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 1)
            self.norms = torchmetrics.MeanMetric()
            self.kept, self.epoch_end_reads = [], []

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.embed(x) + self.offset
            self.log("h_mean", h.mean())  # before the body, from the embedding the first stage trains
            d = x @ self.direct.weight.T + self.direct.bias
            self.log("direct_mean", d.mean())
            h = h + d + self.shift(x) + self.probe(x)  # `shift` only feeds the body in training
            h = h + self.table.weight.mean(0) - self.stats.center
            self.norms.update(h.norm(dim=1))
            self.log("h_norm", self.norms, on_step=False, on_epoch=True)
            scale = h.detach().abs().mean()
            k = self.keep(x)
            self.kept.append(k.detach().mean())  # only here: one entry per microbatch, of equal sizes here
            h = h + k
            with torch.no_grad():  # before the body, values of what the last stage trains: read on the first stage
                gate = self.temp.detach() + self.head(h)
            h = h * gate
            loss = nn.functional.mse_loss(self.head(self.body(h)).squeeze(-1) * self.temp * self.scale, y)
            with torch.no_grad():
                self.log("probe_mean", self.probe(x).mean())  # after the body, without a gradient
            return {"loss": loss, "scale": scale}

        def on_train_epoch_start(self):
            self.scale.requires_grad_(self.current_epoch > 0)  # a warm-up freeze

        def on_train_epoch_end(self):
            self.log("kept_mean", torch.stack(self.kept).mean())  # the last stage's list, handed to every stage
            self.kept.clear()
            # what a monitor reads on every rank (EarlyStopping on a weight), with no validation just before
            self.epoch_end_reads.append(torch.stack([self.embed.weight.sum(), self.temp, self.head.weight.sum()])
                                        .detach().cpu())

        def validation_step(self, batch, batch_idx):
            x, y = batch
            h = self.embed(x) + self.offset + self.shift(x) + self.probe(x) + self.keep(x)
            h = h * (self.temp + self.head(h))
            self.log("val_h_mean", h.mean())  # `shift` logged in evaluation only
            self.log("val_loss", nn.functional.mse_loss(self.head(self.body(h)).squeeze(-1), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.3)

    class Seen(pl.Callback):
        def __init__(self):
            self.steps = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            metrics = trainer.callback_metrics
            self.steps.append(torch.stack([outputs["loss"].detach().cpu(), outputs["scale"].cpu(),
                                           metrics["h_mean"].cpu(), metrics["probe_mean"].cpu(),
                                           metrics["direct_mean"].cpu()]))

    pl.seed_everything(0)
    data = regression_data(24)
    strategy = lightning_pipe.PipeStrategy(num_microbatches=3, log_pipeline_metrics=False) if kind == "pipe" \
        else DDPStrategy()
    seen = Seen()
    trainer = pl.Trainer(accelerator="cpu", devices=2 if kind == "pipe" else 1, strategy=strategy, max_epochs=2,
                         callbacks=[seen], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=root,
                         check_val_every_n_epoch=2)
    model = Model()
    loader = torch.utils.data.DataLoader(data, batch_size=6)
    trainer.fit(model, loader, torch.utils.data.DataLoader(data, batch_size=12))
    torch.save(torch.stack(model.epoch_end_reads), os.path.join(root, f"epoch_end_reads_{trainer.global_rank}.pt"))
    if trainer.is_global_zero:
        metrics = {k: v.cpu() for k, v in trainer.callback_metrics.items()}
        torch.save({"steps": torch.stack(seen.steps), "metrics": metrics,
                    "state_dict": {k: v.cpu() for k, v in model.state_dict().items()}}, out)


def test_values_of_the_embedding_logged_and_returned_before_the_body_match_ddp(lm_runs):
    """Regression: from the second step on the last stage logged `h_mean` computed with its own, untrained copy
    of `embed` (0.0249 against DDP's 0.0242 at step 2); losses and weights matched, the logs did not. The same for
    `direct_mean`, computed from a weight read as an attribute. And a frozen weight and a buffer read as
    attributes (no module called) were released after the first step: the second step stopped on meta tensors.
    And the LightningModule's own `temp`, trained on the last stage, was reset to the first stage's untrained copy
    before every step, because its own `offset` (used before the body) is refreshed from there. And the other way:
    the first stage read its own, never-trained copies of `temp` and `head` before the body, without a gradient
    (0.11 in the loss by step 8). And `scale`, frozen in epoch 0, belonged to the first stage, which read `offset`
    beside it: unfrozen, it was reset to the first stage's copy before every step (review)."""
    want = lm_runs("reference")[0]["test_stale_copies_ddp"]
    got = lm_runs("world2")[0]["test_stale_copies_pipe"]
    assert want["steps"].shape == (8, 5)
    torch.testing.assert_close(got["steps"], want["steps"])
    assert set(want["metrics"]) == {"h_mean", "h_norm", "kept_mean", "probe_mean", "direct_mean", "val_h_mean",
                                    "val_loss"}
    for key, value in want["metrics"].items():
        torch.testing.assert_close(got["metrics"][key], value, msg=lambda m: f"{key}: {m}")
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, msg=lambda m: f"{key}: {m}")


def test_epoch_end_hooks_read_every_stages_trained_values(lm_runs):
    """Regression (review): with no validation before on_train_epoch_end, each stage read its own copies of what
    another stage trains (the last stage its untrained `embed`, the first its untrained `temp` and `head`), so an
    EarlyStopping on such a value stopped at epoch 2 instead of 4."""
    _, reference_root, _ = lm_runs("reference")
    _, root, _ = lm_runs("world2")
    want = torch.load(os.path.join(reference_root, "test_stale_copies_ddp", "epoch_end_reads_0.pt"))
    assert want.shape == (2, 3)
    for rank in range(2):
        torch.testing.assert_close(torch.load(os.path.join(root, "test_stale_copies_pipe", f"epoch_end_reads_{rank}.pt")),
                                   want, msg=lambda m: f"rank {rank}: {m}")
