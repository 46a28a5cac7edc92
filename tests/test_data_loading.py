"""What every stage of a pipeline loads, and a step that stops the fit, under PipeStrategy against DDP.

- Random transforms in DataLoader workers under ``seed_everything(seed, workers=True)``: Lightning
  seeds each worker from the global rank, so the first stage (which feeds the body) and the last
  (which computes the loss) drew different label noise; the workers are now seeded by replica.
- ``self.trainer.should_stop = True`` in ``training_step`` (stop on a NaN loss, a step budget):
  with 3 stages the middle one never runs the step, went on alone and waited for the next step.
- A fit that trains no step (``max_steps=0``): the whole model is back in the module afterwards.
- The logger used after the body call (on the last stage's process, where it writes nothing) warns there.
- Data sharded by global rank (an ``IterableDataset``): the stages load different batches, which
  nothing can tell from correct code; the batches are compared every step and the fit stops
  with ``BatchMismatchError``.
- A step that writes into its batch in place (``x.mul_(0.5)``): the microbatches are views of the
  batch, so the write into one changed what the others saved for backward, and autograd stopped
  the step; each run of the first step now gets its own copy, and every later run once a write was
  seen. The first stage, which reads its fingerprint's values where it first waits in a step, reads
  them before the first step.

The app (``main``) runs in the shared launches of ``tests/lm_app.py`` (see ``APPS`` in conftest.py).
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from torch import nn

from lightning_pipe import BatchMismatchError
from lightning_pipe.lightning import batches
from tests import distributed
from tests.conftest import launch_lm_app, stop_reasons

STOP_AT = 5  # the step whose training_step sets trainer.should_stop (in epoch 0, which has 8 steps with 2 replicas)


def main(kind: str, root: str, out: str) -> None:
    """Trained under DDP (``"ddp"``, ``"ddp2"``: 1 or 2 devices), PipeStrategy on 2 or 3 stages (``"pipe"``,
    ``"pipe3"``) or 2 stages x 2 replicas (``"pipe2x2"``), or on 2 stages with the data sharded by global rank
    (``"sharded"``, which fails; ``"sharded_later"``: after one batch alike on both, which fails at step 1)."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_pipe
    from lightning_pipe.lightning import loggers

    class NoisyLabels(torch.utils.data.Dataset):
        """Label noise drawn in the loader's worker, from the generator Lightning seeds there."""

        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(192, 4, generator=g), torch.randn(192, 1, generator=g)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], self.y[i] + 0.5 * torch.randn(1)

    class ShardedByProcess(torch.utils.data.IterableDataset):
        def __iter__(self):
            data = NoisyLabels()
            first = 12 if kind == "sharded_later" else 0  # one batch alike on every process first
            for i in range(first):
                yield data.x[i], data.y[i]
            for i in range(first + dist.get_rank(), len(data), dist.get_world_size()):
                yield data.x[i], data.y[i]

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.body = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
            self.head = nn.Linear(8, 1)
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            x.mul_(0.5)  # writes into its batch from the first step on: every run gets a copy
            if batch_idx == 0:
                self.logger.experiment  # before the body: global rank 0 runs this too, and it writes
            loss = nn.functional.mse_loss(self.head(self.body(self.embed(x))), y)
            if self.global_step == STOP_AT:
                self.trainer.should_stop = True
            if batch_idx == 0:  # after the body: the last stage's process, where the logger writes nothing
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    self.logger.experiment
                with open(os.path.join(root, f"logger_warnings_{self.global_rank}.txt"), "a") as f:  # not an attribute:
                    f.writelines(f"{w.message}\n" for w in caught if "used the logger" in str(w.message))  # shared
            self.log("train_loss", loss)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.head(self.body(self.embed(x))), y))

        def configure_optimizers(self):
            # Adagrad builds its state when constructed: on pipe3's middle process, some for other stages'
            # (meta) parameters, which stopped setup (regression, review VV: "Cannot copy out of meta tensor")
            return torch.optim.Adagrad(self.parameters(), lr=0.1)

    def make_trainer(**limits):
        devices = {"ddp": 1, "ddp2": 2, "pipe": 2, "pipe3": 3, "pipe2x2": 4, "sharded": 2, "sharded_later": 2,
                   "uneven_val": 2}[kind]
        strategy = DDPStrategy() if kind.startswith("ddp") else lightning_pipe.PipeStrategy(
            pipe_size=2 if kind == "pipe2x2" else None, num_microbatches=3, log_pipeline_metrics=False)
        return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=CSVLogger(root),
                          enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                          default_root_dir=root, **limits)

    pl.seed_everything(0, workers=True)
    model = Model()
    sharded = kind.startswith("sharded")
    data = ShardedByProcess() if sharded else NoisyLabels()
    loader = torch.utils.data.DataLoader(data, batch_size=12, num_workers=0 if sharded else 1)
    idle = {}
    if not sharded:  # a fit that trains no step leaves the whole model in the module, as any fit does
        make_trainer(max_steps=0).fit(model, loader)
        idle["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
        idle["output"] = model.head(model.body(model.embed(torch.ones(2, 4)))).detach()
    trainer = make_trainer(max_epochs=2)
    if kind == "uneven_val":  # the first stage's process loads no validation batch, the last stage's one
        val = torch.utils.data.Subset(NoisyLabels(), range(12 * trainer.global_rank))
        trainer.fit(model, loader, torch.utils.data.DataLoader(val, batch_size=12))
        return
    loggers._warned["done"] = False  # once per process, and the launch's other runs share the process
    open(os.path.join(root, f"logger_warnings_{trainer.global_rank}.txt"), "w").close()
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        torch.save({"global_step": trainer.global_step, "losses": model.losses, "idle": idle,
                    "copies_batch": getattr(getattr(trainer.strategy, "_runner", None), "copies_batch", None),
                    "state_dict": {k: v.cpu() for k, v in model.state_dict().items()}}, out)


@pytest.mark.parametrize("launch, name, reference", [
    ("world2", "test_data_loading_pipe", ("reference", "test_data_loading_ddp")),
    ("world3", "test_data_loading_pipe3", ("reference", "test_data_loading_ddp")),
    ("world4", "test_data_loading_pipe2x2", ("world2", "test_data_loading_ddp2")),  # replica 1's workers: rank 1's
])
def test_worker_transforms_seeded_by_lightning_and_a_step_that_stops_the_fit_match_ddp(lm_runs, launch, name,
                                                                                       reference):
    """Regressions: the last stage's label noise differed from the first's (weights 0.03 away from DDP's after 4
    steps); with 3 stages the middle one went on after a step set should_stop, and the fit timed out; a fit with
    max_steps=0 (Lightning then skips on_train_end) left each rank its stage only: the module's state_dict lacked
    the other stages' layers and its body refused to run."""
    want = lm_runs(reference[0])[0][reference[1]]
    got = lm_runs(launch)[0][name]
    assert got["idle"]["state_dict"].keys() == want["idle"]["state_dict"].keys()
    for key, value in want["idle"]["state_dict"].items():
        torch.testing.assert_close(got["idle"]["state_dict"][key], value, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(got["idle"]["output"], want["idle"]["output"])
    assert want["global_step"] == got["global_step"] == STOP_AT + 1
    assert got["copies_batch"] is True and want["copies_batch"] is None  # the step writes into its batch
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]))
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("launch, name, devices, warned", [
    ("reference", "test_data_loading_ddp", 1, []),
    ("world2", "test_data_loading_pipe", 2, [1]),
    ("world3", "test_data_loading_pipe3", 3, [2]),
    ("world4", "test_data_loading_pipe2x2", 4, [2]),  # the last stage of replica 0 only, where DDP's rank 0 would log
])
def test_the_logger_used_after_the_body_warns_on_the_last_stage_of_replica_0_only(lm_runs, launch, name, devices,
                                                                                 warned):
    root = lm_runs(launch)[1] / name
    for rank in range(devices):
        messages = (root / f"logger_warnings_{rank}.txt").read_text().splitlines()
        assert len(messages) == (rank in warned), (rank, messages)
        if messages:
            assert messages[0].startswith(f"training_step used the logger's `experiment` after the body call. Under "
                                          f"PipeStrategy that code runs on the last stage's process (global rank {rank})")


@pytest.mark.parametrize("kind, step", [("sharded", 0), ("sharded_later", 1)])
def test_data_sharded_by_process_stops_the_fit_with_a_named_error(tmp_path_factory, kind, step):
    """From step 1 on, the first stage reads its fingerprint where it first waits in the step (step 0 is read
    before it runs): ``sharded_later`` loads one batch alike on both processes first."""
    code, seconds, survivors, output = launch_lm_app(
        tmp_path_factory, kind, [dict(name=kind, app="test_data_loading", strategy=kind, devices=2)],
        expect_failure=True, timeout=120,
    )
    assert code != 0 and not survivors, (survivors, output[-4000:])
    reasons = stop_reasons(output)
    if step == 0:  # regression (review WW): the last stage went on alone, into a collective the others never reached
        assert sorted(reasons) == [0, 1], output[-4000:]
        for reason in reasons.values():
            assert reason.startswith("BatchMismatchError: training_step at step 0: the batches the processes of global "
                                     "ranks [0] loaded differ from the one the last stage's process (global rank 1) "
                                     "loaded"), reason
    else:
        assert reasons[0].startswith(f"BatchMismatchError: training_step at step {step}: the batch this process "
                                     "(global rank 0) loaded differs from the one the last stage's process (global "
                                     "rank 1) loaded"), reasons
    assert "trainer.strategy.dp_rank" in reasons[0]


def test_processes_of_a_pipeline_loading_different_numbers_of_evaluation_batches_stop_with_a_named_error(
        tmp_path_factory):
    """Regression (review L): the last stage's process ran a validation batch that the first stage's never loaded,
    and waited for it until the process group's timeout (under DDP, evaluation has no collective). An empty loader
    skips the loop before its start hooks (review M), so the lengths are compared as the loaders are set up."""
    code, seconds, survivors, output = launch_lm_app(
        tmp_path_factory, "uneven_val", [dict(name="uneven_val", app="test_data_loading", strategy="uneven_val",
                                              devices=2)],
        expect_failure=True, timeout=120,
    )
    assert code != 0 and not survivors and seconds < 90, (seconds, survivors, output[-4000:])
    reasons = stop_reasons(output)
    assert sorted(reasons) == [0, 1], output[-4000:]
    for reason in reasons.values():
        assert reason.startswith("BatchMismatchError: the processes of this pipeline load val dataloaders of "
                                 "different lengths: [0, 1] batches (per pipeline rank)"), reason


def _check_lengths(rank, world_size, lengths):
    from types import SimpleNamespace

    import torch.distributed as dist
    from lightning.pytorch.trainer.states import RunningStage

    from lightning_pipe import PipeStrategy

    class Loader:
        def __len__(self):
            if isinstance(lengths[rank], type):
                raise lengths[rank]("no length here")
            return lengths[rank]

    strategy = SimpleNamespace(pp_size=world_size, pp_group=dist.group.WORLD, lightning_module=SimpleNamespace(
        trainer=SimpleNamespace(state=SimpleNamespace(stage=RunningStage.VALIDATING))))
    try:
        PipeStrategy._check_lengths(strategy, Loader())
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:80]
    return "ok"


@pytest.mark.parametrize("lengths, outcome", [
    ([3, 3], "ok"),
    ([NotImplementedError, TypeError], "ok"),  # no length on either (a streaming dataset): Lightning's inf too
    ([2, 3], "BatchMismatchError: the processes of this pipeline load val dataloaders of different lengths: [2, 3]"),
    # regression (review N): an error of one process's len() stopped it alone, the other waited in the exchange
    ([3, ValueError], "ConfigurationError: len() of a dataloader failed on a process of this pipeline: ValueError: n"),
])
def test_loader_lengths_are_compared_over_the_pipeline_and_fail_on_every_rank(lengths, outcome):
    assert distributed.run(_check_lengths, 2, lengths, timeout=60) == [outcome[:80]] * 2


# -- the fingerprint ------------------------------------------------------------------------------
def _value(batch):
    return batches.fingerprint(batch).value()


def test_the_fingerprint_tells_equal_batches_from_different_ones():
    x = torch.randn(64, 3, 8, 8)
    tokens = torch.randint(0, 50_000, (64, 128))
    batch = {"pixels": x, "tokens": tokens, "ids": ["a", "b"], "n": 3}
    copy = {"pixels": x.clone(), "tokens": tokens.clone(), "ids": ["a", "b"], "n": 3}
    assert batches.same(_value(batch), _value(copy))
    one_token = tokens.clone()
    one_token[16, 0] += 1  # one of the 1024 tokens in 8192 the fingerprint reads
    masked = tokens.masked_fill(torch.rand(tokens.shape) < 0.15, 0)  # masked-token labels drawn per process
    changes = [
        dict(copy, pixels=x[torch.randperm(64)]),  # the same samples in another order
        dict(copy, pixels=x + 1e-3 * torch.randn_like(x)),  # another draw of a transform
        dict(copy, tokens=one_token),
        dict(copy, tokens=masked),
        dict(copy, ids=["a", "c"]),
        dict(copy, n=4),
        dict(copy, tokens=tokens[:32]),
        {"pixels": x, "tokens": tokens},
    ]
    for changed in changes:
        assert not batches.same(_value(batch), _value(changed))


def test_the_fingerprint_reads_a_sample_and_handles_odd_tensors():
    assert batches.same(_value(torch.full((3,), math.nan)), _value(torch.full((3,), math.nan)))
    assert not batches.same(_value(torch.full((3,), math.nan)), _value(torch.zeros(3)))
    assert batches.same(_value(torch.full((2000,), math.inf)), _value(torch.full((2000,), math.inf)))
    transposed = torch.randn(40, 30).t()
    assert batches.same(_value(transposed), _value(transposed.contiguous()))
    assert batches.same(_value(torch.zeros(0, 4)), _value(torch.zeros(0, 4)))
    assert not batches.same(_value(torch.zeros(0, 4)), _value(torch.zeros(0, 5)))
    assert batches.same(_value(torch.ones(2, dtype=torch.complex64)), _value(torch.ones(2, dtype=torch.complex64)))
    assert _value(object())[0] == ()  # not compared: its repr holds an address
    conjugate = torch.randn(3, dtype=torch.complex64).conj()
    assert batches.same(_value(conjugate), _value(conjugate.resolve_conj()))
    lowest = torch.full((4,), torch.finfo(torch.float64).min, dtype=torch.float64)  # a float64 attention mask's fill
    assert batches.same(_value(lowest), _value(lowest.clone()))
    mask = torch.rand(8, 1, 1, 64).expand(8, 16, 64, 64)  # read in place: a copy would be 16 x 64 times larger
    assert batches.same(_value(mask), _value(mask.contiguous()))
    assert not batches.same(_value(mask), _value(mask.flip(-1).contiguous()))
    images = torch.rand(16, 3, 32, 32)
    assert batches.same(_value(images.to(memory_format=torch.channels_last)), _value(images))
    many = [torch.full((2,), float(i)) for i in range(batches.TENSORS + 5)]
    assert len(_value(many)[0]) == batches.TENSORS  # past that, shapes and dtypes only
    sparse = torch.eye(3).to_sparse()
    assert batches.same(_value(sparse), _value(sparse.clone()))  # its shape only
    assert not batches.same(_value(sparse), _value(torch.eye(4).to_sparse()))


def test_values_rounded_otherwise_on_another_process_compare_equal_and_other_draws_do_not():
    """A transform computed with another algorithm (cuDNN's choice under benchmark=True) differs in the last bits:
    the same batch. Regression: the first tolerance was absolute in float64 terms and stopped such a run."""
    x = torch.randn(64, 3, 32, 32)
    one_ulp = torch.nextafter(x, torch.full_like(x, math.inf))
    assert batches.same(_value(x), _value(one_ulp))
    assert not batches.same(_value(x), _value(x + 1e-4 * torch.randn_like(x)))
    ids = torch.randint(0, 1000, (8, 64))
    assert not batches.same(_value(ids), _value(ids.roll(1, 0)))  # integers compare exactly


def test_check_raises_only_on_a_different_batch():
    batch = (torch.arange(12.0).reshape(6, 2), torch.ones(6))
    mine = batches.fingerprint(batch)
    batches.check(mine, _value(batch), "training_step", 3, 0, 1)
    batches.check(mine, None, "training_step", 3, 0, 1)  # one stage: nothing to compare
    with pytest.raises(BatchMismatchError, match="validation_step at step 3: .*global rank 0.*global rank 1"):
        batches.check(mine, _value((batch[0] + 1, batch[1])), "validation_step", 3, 0, 1)


def _check_together(rank, world_size, shifted_ranks):
    batch = (torch.arange(12.0).reshape(6, 2) + (rank in shifted_ranks), torch.ones(6))
    try:
        batches.check_together(batches.fingerprint(batch), None, world_size - 1, "validation_step", 4,
                               [10 + r for r in range(world_size)])
    except BatchMismatchError as error:
        return str(error)[:140]
    return "ok"


@pytest.mark.parametrize("shifted, outcome", [
    ([], "ok"),
    ([1], "validation_step at step 4: the batches the processes of global ranks [11] loaded differ from the one the "
          "last stage's process (global rank 12) loaded"),
    ([2], "validation_step at step 4: the batches the processes of global ranks [10, 11] loaded differ from the one "
          "the last stage's process (global rank 12) loaded"),
])
def test_the_first_batch_is_compared_by_every_rank_and_a_difference_stops_them_all(shifted, outcome):
    assert distributed.run(_check_together, 3, shifted, timeout=60) == [outcome[:140]] * 3


def test_a_deferred_fingerprint_reads_the_values_when_computed_unless_the_batch_was_written_into():
    """The first stage reads its fingerprint's values where it first waits in the step, after its first
    microbatches ran the user's step: a step that writes into its batch must not look like another batch."""
    batch = (torch.arange(12.0).reshape(6, 2), torch.ones(6))
    eager = batches.fingerprint(batch).value()
    later = batches.fingerprint(batch, deferred=True)
    batch[1][:3].add_(1)  # through a view (a microbatch): counted on the batch's tensor
    assert later.value() is None and later.written
    batches.check(later, eager, "training_step", 3, 0, 1)  # not compared: no false mismatch
    untouched = batches.fingerprint(batch, deferred=True)
    torch.add(batch[0], 1, out=torch.empty(6, 2))  # reading is not writing
    assert batches.same(untouched.value(), _value(batch)) and not untouched.written
    with torch.inference_mode():
        frozen = torch.ones(3)
    read_now = batches.fingerprint([frozen], deferred=True)  # no version to tell a write by: read at once
    with torch.inference_mode():
        frozen.add_(1)
    assert batches.same(read_now.value(), _value([torch.ones(3)]))
