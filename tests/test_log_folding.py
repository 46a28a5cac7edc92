"""How the last stage's per-microbatch ``self.log`` calls fold into the calls one step over the batch makes.

Each case records the calls a step would make on microbatches of sizes 4, 3, 3 (a batch of 10)
and checks the folded calls against what Lightning would be given by one step over the batch.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torchmetrics.classification import BinaryF1Score
from torchmetrics.aggregation import SumMetric

from lightning_pipe import ConfigurationError
from lightning_pipe.lightning.effects import StepEffects
from lightning_pipe.lightning.logs import LogRecorder
from lightning_pipe.lightning.losses import merge
from tests import distributed

SIZES = [4, 3, 3]


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.f1 = BinaryF1Score()
        self.total = SumMetric()


def _record(module, step, sizes=SIZES, weights=None, on_step_by_default=True):
    """Run ``step(module, i, size)`` per microbatch under a recorder; return the folded calls."""
    recorder = LogRecorder(module, "body")
    with recorder.recording():
        for i, size in enumerate(sizes):
            recorder.start_microbatch()
            loss = step(module, i, size)
            recorder.mark_loss(loss)
        return recorder.fold(sizes, weights if weights is not None else list(sizes), on_step_by_default)


def _loss(i):
    return torch.tensor([0.7, 0.8, 0.9][i])


def test_a_logged_loss_folds_like_the_loss_whatever_its_reduce_fx():
    """Regression: reduce_fx="max" logged the largest microbatch loss, "sum" their sum, not the batch's loss."""
    def step(module, i, size):
        loss = _loss(i)
        module.log("loss_max", loss, reduce_fx="max")
        module.log("loss_sum", loss, reduce_fx="sum")
        module.log("loss_mean", loss)
        return loss

    calls = {c["name"]: c for c in _record(Module(), step)}
    batch_loss = torch.tensor((0.7 * 4 + 0.8 * 3 + 0.9 * 3) / 10)
    for name, reduce_fx in (("loss_max", "max"), ("loss_sum", "sum"), ("loss_mean", "mean")):
        torch.testing.assert_close(calls[name]["value"], batch_loss)
        assert calls[name]["reduce_fx"] == reduce_fx  # Lightning still reduces the steps with it


def test_a_constant_batch_size_keeps_the_microbatch_sizes_as_weights():
    """Regression: batch_size=10 in every microbatch weighed microbatches of 4, 3 and 3 equally."""
    values = [0.25, 0.5, 1.0]

    def step(module, i, size):
        module.log("acc", torch.tensor(values[i]), batch_size=10)
        module.log("token_acc", torch.tensor(values[i]), batch_size=size * 5)  # a count per microbatch
        return _loss(i)

    calls = {c["name"]: c for c in _record(Module(), step)}
    torch.testing.assert_close(calls["acc"]["value"], torch.tensor((0.25 * 4 + 0.5 * 3 + 1.0 * 3) / 10))
    assert calls["acc"]["batch_size"] == 10
    torch.testing.assert_close(calls["token_acc"]["value"], torch.tensor((0.25 * 20 + 0.5 * 15 + 1.0 * 15) / 50))
    assert calls["token_acc"]["batch_size"] == 50

    # a short batch: the constant is not the batch's size, but the microbatch sizes differ, so it is no count
    calls = {c["name"]: c for c in _record(Module(), step, sizes=[2, 1, 1])}
    torch.testing.assert_close(calls["acc"]["value"], torch.tensor((0.25 * 2 + 0.5 + 1.0) / 4))
    assert calls["acc"]["batch_size"] == 10

    # a short batch split evenly cannot tell; an earlier step showed the number is the batch's size
    recorder = LogRecorder(Module(), "body")
    for sizes in (SIZES, [2, 2, 2]):
        with recorder.recording():
            for i in range(3):
                recorder.start_microbatch()
                step(recorder.module, i, sizes[i])
                recorder.mark_loss(None)
            calls = {c["name"]: c for c in recorder.fold(sizes, sizes)}
    assert calls["acc"]["batch_size"] == 10 and calls["token_acc"]["batch_size"] == 30


def test_a_name_logged_twice_in_a_step_is_replayed_twice_in_order():
    """Regression: both calls of every microbatch were averaged into one; Lightning's step value is the last."""
    def step(module, i, size):
        module.log("twice", torch.tensor(float(i)))
        module.log("other", torch.tensor(1.0))
        module.log("twice", torch.tensor(10.0 + i))
        return _loss(i)

    calls = _record(Module(), step)
    assert [c["name"] for c in calls] == ["twice", "other", "twice"]
    torch.testing.assert_close(calls[0]["value"], torch.tensor((0 * 4 + 1 * 3 + 2 * 3) / 10))
    torch.testing.assert_close(calls[2]["value"], torch.tensor((10 * 4 + 11 * 3 + 12 * 3) / 10))


def test_reduce_fx_names_are_read_as_lightning_reads_them():
    """Regression: reduce_fx="Max" raised TypeError: 'str' object is not callable on the last stage."""
    def step(module, i, size):
        module.log("m", torch.tensor(float(i)), reduce_fx="Max")
        module.log("a", torch.tensor(float(i)), reduce_fx="AVG")
        return _loss(i)

    calls = {c["name"]: c for c in _record(Module(), step)}
    torch.testing.assert_close(calls["m"]["value"], torch.tensor(2.0))
    torch.testing.assert_close(calls["a"]["value"], torch.tensor(0.9))
    with pytest.raises(ConfigurationError, match="reduce_fx"):
        _record(Module(), lambda module, i, size: module.log("x", torch.tensor(1.0), reduce_fx="median"))


def test_a_metric_logged_on_step_logs_its_value_over_the_whole_batch():
    """Regression: a Metric's step value was the size-weighted mean of its per-microbatch values (F1 0.444
    where DDP logs 0.417; a SumMetric 6 where DDP logs 2)."""
    torch.manual_seed(0)
    preds, target = torch.rand(10), torch.randint(0, 2, (10,))
    bounds = [0, 4, 7, 10]

    def step(module, i, size):
        part = slice(bounds[i], bounds[i + 1])
        module.f1(preds[part], target[part])
        module.total(torch.ones(size) / 5)
        module.log("f1", module.f1)
        module.log("total", module.total)
        module.log("f1_epoch_only", module.f1, on_step=False, on_epoch=True)
        return _loss(i)

    module = Module()
    calls = {c["name"]: c for c in _record(module, step)}
    torch.testing.assert_close(calls["f1"]["value"][2], BinaryF1Score()(preds, target))
    torch.testing.assert_close(calls["total"]["value"][2], torch.tensor(2.0))
    assert calls["f1"]["value"][1] == "f1"
    # the metric itself saw every microbatch once, as it would have seen the batch
    torch.testing.assert_close(module.f1.compute(), BinaryF1Score()(preds, target))
    torch.testing.assert_close(module.total.compute(), torch.tensor(2.0))

    # logged on epoch only (validation's default), the step value is not computed
    calls = {c["name"]: c for c in _record(Module(), step, on_step_by_default=False)}
    assert calls["f1"]["value"][2] is not None


def test_a_list_appended_to_in_the_step_is_warned_about_once():
    module = nn.Module()
    module.scores = []
    effects = StepEffects(module, 3)
    with pytest.warns(UserWarning, match=r"appended to `self.scores`.*one entry per microbatch"):
        snapshot = effects.before("training_step")
        module.scores.append(1.0)
        effects.after("training_step", snapshot, last_stage=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snapshot = effects.before("training_step")
        module.scores.append(1.0)
        effects.after("training_step", snapshot, last_stage=True)


def test_lists_and_counters_are_warned_about_where_the_step_runs_whole():
    """Regression: the warning was rank_zero_warn'ed by the process that saw the change, but code after the body
    runs on the last stage only, never global rank 0: a list appended to after the body was never warned about.
    Now the process holding the last stage of the first replica warns (``warns``), after a run of the whole
    step, also where it runs the step up to the body first (ZB-V's process 0); other runs stay quiet."""
    module = nn.Module()
    module.scores = []
    effects = StepEffects(module, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snapshot = effects.before("training_step", whole=False)  # the run up to the body
        effects.after("training_step", snapshot, last_stage=False)
    with pytest.warns(UserWarning, match=r"appended to `self.scores`"):
        snapshot = effects.before("training_step")
        module.scores.append(1.0)
        effects.after("training_step", snapshot, last_stage=True)
    quiet = StepEffects(module, 3)
    quiet.warns = False  # the last stage of another replica
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snapshot = quiet.before("validation_step")
        module.scores.append(1.0)
        quiet.after("validation_step", snapshot, last_stage=True)


def test_a_metric_seen_logged_only_on_epoch_gets_no_step_state_after_the_first_step():
    """The step state costs one more update per call: it is kept only for Metrics that may be logged on step."""
    module = Module()
    updates = []
    update = module.f1.update

    def counted(*args, **kwargs):
        updates.append(1)
        return update(*args, **kwargs)

    module.f1.update = counted
    recorder = LogRecorder(module, "body")

    def step(i):
        module.f1(torch.rand(3), torch.randint(0, 2, (3,)))
        module.log("f1", module.f1)

    for expected in (2, 1, 1):  # per call: the metric's own update, and the step state's while followed
        updates.clear()
        with recorder.recording():
            for i in range(3):
                recorder.start_microbatch()
                step(i)
                recorder.mark_loss(None)
            recorder.fold(SIZES, SIZES, on_step_by_default=False)
        assert len(updates) == 3 * expected


def test_a_microbatch_that_averaged_over_nothing_adds_nothing_to_the_logged_mean():
    """Regression: a microbatch whose cross_entropy targets were all ignore_index has a 0/0 (NaN) mean and a
    weight of 0; the fold multiplied the two and logged NaN, where one step over the batch logs the mean over
    the targets there are. A batch with no target at all logs NaN, as one step does."""
    nan = float("nan")

    def step(values, counts):
        def run(module, i, size):
            loss = torch.tensor(values[i])
            module.log("ce", loss.clone(), batch_size=counts[i])
            module.log("loss", loss)
            return loss  # the step's loss, weighted by its targets (the loss weights below)
        return run

    calls = {c["name"]: c for c in _record(Module(), step([0.5, nan, 2.0], [3, 0, 2]), weights=[3.0, 0.0, 2.0])}
    for name in ("ce", "loss"):
        torch.testing.assert_close(calls[name]["value"], torch.tensor((0.5 * 3 + 2.0 * 2) / 5))
    assert calls["ce"]["batch_size"] == 5
    calls = {c["name"]: c for c in _record(Module(), step([nan] * 3, [0, 0, 0]), weights=[0.0] * 3)}
    assert all(torch.isnan(calls[name]["value"]) for name in ("ce", "loss"))

    assert merge([{"ce": 0.5}, {"ce": nan}, {"ce": 2.0}], [3.0, 0.0, 2.0], [4, 3, 3]) == {"ce": (0.5 * 3 + 2.0 * 2) / 5}
    torch.testing.assert_close(merge([torch.tensor(0.5), torch.tensor(nan)], [1.0, 0.0], [4, 3]), torch.tensor(0.5))


def test_a_mean_over_a_selection_empty_in_a_microbatch_is_warned_about_and_folds_by_its_size():
    """Regression (review): `acc[labels != -100].mean()` logged without batch_size over a microbatch of padding
    only is NaN there, and the size-weighted fold made the batch's value NaN with no word, where one step over
    the batch logs a number. It warns now, with the fix, which folds it as one step would."""
    nan = float("nan")
    correct, counts = [2.0, nan, 1.0], [4, 0, 2]  # accuracy over each microbatch's kept tokens

    def step(batch_size):
        def run(module, i, size):
            module.log("acc", torch.tensor(correct[i] / counts[i] if counts[i] else nan),
                       **({"batch_size": counts[i]} if batch_size else {}))
            return _loss(i)
        return run

    with pytest.warns(UserWarning, match=r"self\.log\('acc', \.\.\.\) was NaN in some microbatches of a step.*"
                                         r"`self\.log\(\.\.\., batch_size=count\)`"):
        calls = {c["name"]: c for c in _record(Module(), step(batch_size=False))}
    assert torch.isnan(calls["acc"]["value"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calls = {c["name"]: c for c in _record(Module(), step(batch_size=True))}
        torch.testing.assert_close(calls["acc"]["value"], torch.tensor((2.0 + 1.0) / 6))  # as over the whole batch
        _record(Module(), lambda module, i, size: module.log("nan", torch.tensor(nan)) or _loss(i))  # NaN everywhere


def test_a_metric_value_logged_as_a_tensor_logs_the_metric_over_the_whole_batch():
    """Regression (review): `self.log("f1", self.f1(preds, y))` logs the value the Metric's forward returned
    for the microbatch; their size-weighted mean is no F1 score over the batch, which one step logs."""
    torch.manual_seed(0)
    preds, target = torch.rand(10), torch.randint(0, 2, (10,))
    bounds = [0, 4, 7, 10]

    def step(module, i, size):
        part = slice(bounds[i], bounds[i + 1])
        f1 = module.f1(preds[part], target[part])
        module.log("f1", f1)
        module.log("f1_scaled", f1 * 100)  # no Metric's value: folded as a number
        return _loss(i)

    module = Module()
    calls = {c["name"]: c for c in _record(module, step)}
    whole = BinaryF1Score()(preds, target)
    torch.testing.assert_close(calls["f1"]["value"], whole)
    assert not torch.allclose(calls["f1_scaled"]["value"], whole * 100)
    torch.testing.assert_close(module.f1.compute(), whole)  # its own state: every call, as one step's


def _replica_with_its_own_microbatches(rank, world_size):
    """Replica ``rank`` runs its batch of 6 in 2 microbatches (rank 0) or 1 (rank 1), as a short last batch may."""
    from torchmetrics import MeanAbsoluteError

    torch.manual_seed(0)
    preds, target = torch.rand(world_size, 6), torch.rand(world_size, 6)
    module = Module()
    module.mae = MeanAbsoluteError(dist_sync_on_step=True)  # its process group: every rank here, the replicas
    sizes = [3, 3] if rank == 0 else [6]

    def step(module, i, size):
        start = sum(sizes[:i])
        module.log("mae", module.mae(preds[rank, start:start + size], target[rank, start:start + size]))
        return _loss(i)

    recorder = LogRecorder(module, "body")
    with recorder.recording(microbatched=True):
        for i, size in enumerate(sizes):
            recorder.start_microbatch()
            recorder.mark_loss(step(module, i, size))
        (call,) = recorder.fold(sizes, sizes)
    assert module.mae.dist_sync_on_step  # as the user made it, after the step
    whole = (preds - target).abs().mean()  # DDP: each replica's one call syncs over both batches
    return float(call["value"]), float(whole), float(module.mae.compute())


def test_a_metric_synced_on_step_syncs_once_a_step_whatever_each_replicas_microbatches():
    """Regression (review AAA): with a short last batch split into 2 microbatches on one replica and 1 on the
    other, the Metric's forward synced in every microbatch, so the replicas called its collective a different number
    of times and waited for each other for good. It syncs once a step now, its value over the step."""
    results = distributed.run(_replica_with_its_own_microbatches, 2, timeout=60)
    for logged, whole, epoch in results:
        assert logged == pytest.approx(whole, rel=1e-6) and epoch == pytest.approx(whole, rel=1e-6)


def test_a_metric_called_twice_in_a_step_logs_each_calls_own_value():
    """Regression (review): one accuracy called on a source batch (all right) and a target batch (all wrong) logged
    0.5 for both, its value over every call of the step; one step over the batch logs 1.0 and 0.0."""
    def step(module, i, size):
        target = torch.ones(size, dtype=torch.long)
        module.log("f1_source", module.f1(torch.ones(size), target))
        module.log("f1_target", module.f1(torch.zeros(size), target))
        return _loss(i)

    calls = {c["name"]: c for c in _record(Module(), step)}
    torch.testing.assert_close(calls["f1_source"]["value"], torch.tensor(1.0))
    torch.testing.assert_close(calls["f1_target"]["value"], torch.tensor(0.0))


def _fold_steps(step, steps):
    """Fold the calls of several steps of one recorder (``steps``: each step's microbatch sizes)."""
    recorder = LogRecorder(Module(), "body")
    folded = []
    for sizes in steps:
        with recorder.recording():
            for i, size in enumerate(sizes):
                recorder.start_microbatch()
                step(recorder.module, i, size)
                recorder.mark_loss(None)
            folded.append({c["name"]: c for c in recorder.fold(sizes, sizes)})
    return folded


def test_a_batch_of_one_microbatch_does_not_make_a_count_look_like_the_batch_size():
    """Regression: a last batch of one sample ran as one microbatch, whose batch_size=x.shape[0] equals the
    batch's size either way; taken for the batch's size for good, it made every later batch split evenly log
    one microbatch's size (4 instead of 8), so the epoch mean weighed batches 4, 4, 1 instead of 8, 8, 1."""
    def step(module, i, size):
        module.log("mae", torch.tensor(0.1 * (i + 1)), batch_size=size)

    *_, last = _fold_steps(step, [[4, 4], [1], [4, 4]])
    assert last["mae"]["batch_size"] == 8
    torch.testing.assert_close(last["mae"]["value"], torch.tensor(0.15))


def test_counts_that_once_differed_between_microbatches_stay_counts_when_they_happen_to_be_equal():
    """Regression: batch_size=(targets kept) gave 2, 2, 2 on microbatches of 3, 3, 2; with the sizes differing
    it was taken for the batch's size (weights 3, 3, 2 and batch_size 2) after earlier steps had counted 3, 1, 2,
    where one step over the batch logs with its count, 6."""
    counts = iter([[3, 1, 2], [2, 2, 2]])
    values = [0.0, 0.5, 0.5]

    def step(module, i, size):
        if i == 0:
            step.counts = next(counts)
        module.log("acc", torch.tensor(values[i]), batch_size=step.counts[i])

    first, second = _fold_steps(step, [[3, 3, 2], [3, 3, 2]])
    assert (first["acc"]["batch_size"], second["acc"]["batch_size"]) == (6, 6)
    torch.testing.assert_close(second["acc"]["value"], torch.tensor(1 / 3))


def test_a_constant_batch_size_taken_for_a_count_weighs_every_step_alike():
    """Regression (review): batch_size=7 in every microbatch, neither a microbatch's size nor the batch's,
    logged 14 (a count: 7 + 7) on batches split evenly and 7 on a short batch split 3 + 2, so the epoch
    mean weighed that batch half as much as one step over each batch does (7 each)."""
    values = [0.2, 0.8]

    def step(module, i, size):
        module.log("acc", torch.tensor(values[i]), batch_size=7)

    first, short, again = _fold_steps(step, [[5, 5], [3, 2], [5, 5]])
    assert (first["acc"]["batch_size"], short["acc"]["batch_size"], again["acc"]["batch_size"]) == (14, 14, 14)
    torch.testing.assert_close(short["acc"]["value"], torch.tensor((0.2 * 3 + 0.8 * 2) / 5))  # by sample


def test_integers_that_differ_between_microbatches_folded_as_a_mean_are_warned_about():
    """Review P: `self.log("correct", (pred == y).sum())` logged the size-weighted mean of the microbatches' counts,
    a third of the batch's count that DDP logs here, with no word. A count cannot be told from the values alone:
    integers that differ warn, with the fix; equal ones (a global step, a sequence length) and floats do not."""
    counts = [3, 1, 2]

    def step(module, i, size):
        module.log("correct", torch.tensor(counts[i]))
        module.log("seq_len", 16)
        module.log("acc", torch.tensor(counts[i] / size))
        return _loss(i)

    with pytest.warns(UserWarning, match=r"self\.log\('correct', \.\.\.\) logged integers that differ .*"
                                         r"on_train_batch_end") as record:
        calls = {c["name"]: c for c in _record(Module(), step)}
    assert [str(w.message)[:27] for w in record] == ["PipeStrategy: self.log('cor"]  # not the others
    torch.testing.assert_close(calls["correct"]["value"], torch.tensor(round((3 * 4 + 1 * 3 + 2 * 3) / 10)))
    assert calls["seq_len"]["value"] == 16
