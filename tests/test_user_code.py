"""The user's step under PipeStrategy: random draws, loss reductions, side effects, what hooks see.

The runs are tests/lm_app.py launches shared through ``lm_runs`` (tests/conftest.py). Stage 0 and
the last stage both run the step's code before the body; ``draws_<run>_<rank>.pt`` holds what each
rank's step drew there, microbatch by microbatch.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from lightning_pipe import ConfigurationError, SideEffectError
from lightning_pipe.lightning.body import asks_for_gradient
from lightning_pipe.lightning.effects import StepEffects, optimizer_settings, refuse_changed_settings
from lightning_pipe.lightning.logs import combine_stages
from lightning_pipe.lightning.losses import LossAccount, Shapes, merge
from lightning_pipe.lightning.stale import mark
from tests.conftest import launch_lm_app, stop_reasons, warned_by_run
from tests.test_model_styles import assert_same_training


def _final_loss(result):
    return float([row["train_loss"] for row in result["csv"] if row.get("train_loss")][-1])


def _refused_on_every_rank(tmp_path_factory, case, error, **spec):
    """Launch ``case`` on two processes; check that both stopped, quickly, with ``error``; return the output."""
    code, seconds, survivors, output = launch_lm_app(
        tmp_path_factory, case, [dict(name=case, case=case, strategy="pipe", devices=2, **spec)],
        expect_failure=True, timeout=120,
    )
    assert code != 0 and not survivors and seconds < 90, (seconds, survivors, output[-4000:])
    reasons = stop_reasons(output)
    assert sorted(reasons) == [0, 1] and all(error in r for r in reasons.values()), output[-4000:]
    return output


# -- 1, 2: one draw per microbatch, the same on every stage that runs the step ------------------
@pytest.mark.parametrize("launch, name, first, last", [
    ("world2", "denoise_p2", [0], [1]),  # GPipe
    ("world3", "denoise_p3", [0], [2]),  # 1F1B
    ("world4", "denoise_2x2", [0, 1], [2, 3]),  # replica r: stage 0 on rank r, stage 1 on rank 2 + r
    ("world2", "diffusion_p2", [0], [1]),  # noise and timesteps before the body
    ("world2", "mixup_p2", [0], [1]),  # mixing weight and permutation before the body, targets mixed after
])
def test_the_first_and_last_stage_draw_the_same_numbers_for_every_microbatch(lm_runs, launch, name, first, last):
    _, root, _ = lm_runs(launch)
    for a, b in zip(first, last):
        drawn_first = torch.load(root / f"draws_{name}_{a}.pt")
        drawn_last = torch.load(root / f"draws_{name}_{b}.pt")
        assert len(drawn_first) == len(drawn_last) > 0
        assert drawn_first == drawn_last
        assert len({tuple(d) for d in drawn_first}) == len(drawn_first)  # and each microbatch draws anew


@pytest.mark.parametrize("launch, name", [("world2", "denoise_p2"), ("world3", "denoise_p3"), ("world4", "denoise_2x2")])
def test_a_body_that_must_reproduce_noise_drawn_in_the_step_learns_as_under_ddp(lm_runs, launch, name):
    """Regression: the first and last stage drew different noise (dropout in the body consumed the
    generators differently), so the body's input and the loss's target differed: loss 1.20 vs 0.024."""
    reference = _final_loss(lm_runs("reference")[0]["denoise"])
    got = _final_loss(lm_runs(launch)[0][name])
    assert reference < 0.1, reference
    assert got < 2 * reference + 0.02, (got, reference)


# -- 5: how microbatch losses combine ------------------------------------------------------------
def test_a_sum_reduced_loss_under_loss_reduction_sum_equals_ddp(lm_runs):
    """Regression: the sum over each microbatch was averaged, so the gradient was 1/m of DDP's."""
    assert_same_training(lm_runs("world2")[0]["sum_p2"], lm_runs("reference")[0]["sum"])


def test_a_summed_cross_entropy_under_loss_reduction_mean_is_refused_on_every_rank(tmp_path_factory):
    """Regression: the step's ``F.cross_entropy(..., reduction="sum")`` under the default
    ``loss_reduction="mean"`` was weighted by each microbatch's share of the batch, a quarter of one
    process's loss with 4 microbatches, and trained on without a word."""
    output = _refused_on_every_rank(tmp_path_factory, "summed_ce", "ConfigurationError")
    assert "training_step returned the output of a cross_entropy/nll_loss call with reduction='sum' as its loss, " \
           "but PipeStrategy(loss_reduction='mean')" in output, output[-4000:]
    assert "Pass PipeStrategy(loss_reduction='sum')" in output


def test_blocks_called_under_no_grad_in_a_training_step_are_refused_on_every_rank(tmp_path_factory):
    """Regression (review): a step running the body under torch.no_grad() (a frozen feature extractor) trained the
    last stage's layers, which the pipeline runs with gradients whatever the step's grad mode."""
    output = _refused_on_every_rank(tmp_path_factory, "no_grad_blocks", "ConfigurationError")
    assert "training_step called the body `self.layers` with gradients disabled" in output, output[-4000:]


def test_a_gradient_with_respect_to_the_bodys_input_stops_every_rank_with_a_named_error(tmp_path_factory):
    """Regression (review J): `torch.autograd.grad(out.sum(), x)` for a gradient penalty or a saliency map stopped
    with autograd's own error ("appears to not have been used in the graph") inside a PipelineStepError, naming
    nothing of the cause: on the last stage the body's output is not computed from x. An input asking for a gradient
    is not refused by itself (review M): Hugging Face's enable_input_require_grads (LoRA, gradient checkpointing)
    makes the embeddings' output ask for one that nothing reads."""
    output = _refused_on_every_rank(tmp_path_factory, "penalty", "BodyCallError")
    assert "training_step asked autograd for a gradient through the body (The differentiated Tensor at index 0 " \
           "appears to not have been used in the graph" in output, output[-4000:]


def test_a_loss_term_from_another_stages_layer_stops_every_rank_with_a_named_error(tmp_path_factory):
    """Regression (review R): `loss + 0.05 * self.body[0].weight.pow(2).sum()` on the last stage, where that layer
    is a meta copy, made a meta loss that failed in the backward with torch's "Cannot copy out of meta tensor"."""
    output = _refused_on_every_rank(tmp_path_factory, "other_stages_weight", "BodyCallError")
    assert "training_step's loss is on the meta device: under PipeStrategy this process holds stage 1 of the 2 " \
           "stages of `self.body`" in output, output[-4000:]


def test_a_body_switched_to_another_mode_in_the_step_stops_every_rank_with_a_named_error(tmp_path_factory):
    """Regression (review R): `self.body.eval()` before the body call in training_step (and `.train()` after it)
    reached no stage: the pipeline ran the layers in train mode (step 0's loss 0.655 where DDP's is 0.749)."""
    output = _refused_on_every_rank(tmp_path_factory, "mode_in_step", "BodyCallError")
    assert "the step changed the training mode of the body's layers before calling it" in output, output[-4000:]


_EVALUATED_OTHERWISE = {
    "val_swapped": "validation_step changed ['body.0.weight', 'body.0.bias', 'body.2.weight', 'body.2.bias'] in "
                   "place. Under PipeStrategy the step runs once per microbatch (3 per batch): the code before the "
                   "body call on the first and the last stage, the rest on the last stage, and the body's layers on "
                   "the processes that hold them, so weights swapped in around the body call reach only",
    "val_gradient": "validation_step asked autograd for a gradient through the body (element 0 of tensors does "
                    "not require grad and does not have a grad_fn)",
}


@pytest.mark.parametrize("case", sorted(_EVALUATED_OTHERWISE))
def test_an_evaluation_step_evaluating_the_body_otherwise_is_refused_naming_the_cause(tmp_path_factory, case):
    """Regression (review III): weights scaled in place around the body call in validation_step (an EMA's swapped
    in) were refused with advice for a training step's update ("once per batch ... on_before_optimizer_step");
    a gradient with respect to a body weight under torch.enable_grad() ended with autograd's raw error on the last
    stage (that weight a meta copy there, the body's output computed elsewhere without a graph)."""
    output = _refused_on_every_rank(tmp_path_factory, case, "BodyCallError" if case == "val_gradient"
                                    else "SideEffectError")
    assert _EVALUATED_OTHERWISE[case] in output, output[-4000:]
    if case == "val_swapped":
        assert "on_validation_epoch_start and on_validation_epoch_end" in output, output[-4000:]


@pytest.mark.parametrize("case, changed", [
    ("flags_modules", "`2.enabled` True -> False, `3.enabled` True -> False"),  # the last stage's blocks
    ("flags_config", "`0.scales.scale` 1.0 -> 0.5"),
])
def test_values_set_on_the_blocks_around_the_body_call_are_refused_on_every_rank(tmp_path_factory, case, changed):
    """Regression (review III): a flag set on every block through `self.modules()` (PEFT's `disable_adapter()`), or
    on a config object the blocks share, just for the body call reached the blocks of the first stage only (they
    run inside its step); the last stage's ran before its step (weights 1.13e-2 from DDP's in III's probe). Through
    `self.modules()` the first step sets nothing (`batch_idx % 2 == 0` leaves the blocks on): the second is
    refused; the config's scale is refused in the first. Changes the step keeps are not (`persistent_p2` in
    test_model_styles.py trains as under DDP)."""
    output = _refused_on_every_rank(tmp_path_factory, case, "BodyCallError")
    assert f"training_step changed attributes of the body's modules just for the body call (set before it, put " \
           f"back after it): {changed}" in output, \
        output[-4000:]


def test_a_body_input_asking_for_a_gradient_is_told_from_parameters_and_stale_values():
    """What decides whether autograd's "not used in the graph" is explained as a gradient through the body: a
    non-parameter leaf with requires_grad, or a value computed from one (review N: an unrelated unused head's
    parameters in `torch.autograd.grad` were blamed on the body); parameters, values without gradients and the
    last stage's stale values do not ask."""
    proj = torch.nn.Linear(2, 2)
    x = torch.ones(3, 2)
    assert not asks_for_gradient([x, proj(x), proj.weight, torch.ones(2).requires_grad_().detach()])
    assert asks_for_gradient([x, x.clone().requires_grad_()])
    assert asks_for_gradient([proj(x.clone().requires_grad_()) * 2])
    assert not asks_for_gradient([mark(torch.zeros(3, 2).requires_grad_(), frozenset({"proj"}))])  # skipped, stale


@pytest.mark.parametrize("case, error", [("failing_val", "KeyError: 'mae'"),
                                         ("failing_log", "ConfigurationError: only self.log")])
def test_an_error_after_the_body_on_the_last_stage_stops_every_rank_with_it(tmp_path_factory, case, error):
    """An error in the last stage's evaluation step after the body, or in folding its logs, raises outside the
    pipeline's actions, on that process alone: the first stage's, waiting for its results, stops at once, naming
    it (review L asked whether it waited for the timeout, or failed with gloo's "Connection closed by peer")."""
    output = _refused_on_every_rank(tmp_path_factory, case, error)
    reason = stop_reasons(output)[0]
    assert reason.startswith("PipelineAbortedError: stopped while waiting for what pipeline rank 1 shares"), reason
    assert f"because another rank failed: global rank 1 (stage 1, replica 0) failed: {error}" in reason, reason


def test_a_token_mean_loss_declared_with_num_items_equals_ddp(lm_runs):
    """The microbatches hold different numbers of tokens; weighted by num_items they add up to DDP's loss."""
    from tests.lm_app import token_data

    _, labels = token_data()[:8]
    counts = [int((part != -100).sum()) for part in torch.tensor_split(labels, 3)]
    assert len(set(counts)) > 1, counts  # the size-weighted mean would be wrong here
    assert_same_training(lm_runs("world2")[0]["llama_p2"], lm_runs("reference")[0]["llama"])


def test_the_loss_account_checks_what_it_can():
    account = LossAccount([2, 1], "mean")
    account.add(0, torch.tensor(1.0), {"loss": torch.tensor(1.0), "num_items": torch.tensor(4)})
    with pytest.raises(ConfigurationError, match="'num_items' for some microbatches and not for others"):
        account.add(1, torch.tensor(1.0), torch.tensor(1.0))
    with pytest.raises(ConfigurationError, match="under PipeStrategy\\(loss_reduction='sum'\\)"):
        LossAccount([2], "sum").add(0, torch.tensor(1.0), {"loss": torch.tensor(1.0), "num_items": 3})
    with pytest.raises(ConfigurationError, match="must be a non-negative number"):
        LossAccount([2], "mean").add(0, torch.tensor(1.0), {"loss": torch.tensor(1.0), "num_items": -1})
    empty = LossAccount([2, 2], "mean")
    root = empty.add(0, torch.tensor(float("nan"), requires_grad=True), {"loss": torch.tensor(0.0), "num_items": 0})
    assert root.item() == 0.0 and root.requires_grad  # a microbatch with no item adds nothing, and no NaN
    second = empty.add(1, torch.tensor(2.0), {"loss": torch.tensor(2.0), "num_items": 5})
    assert empty.log_weights() == [0.0, 5.0] and (root + second) / empty.normalizer() == 2.0  # the batch's mean
    assert LossAccount([2], "mean").normalizer() is None  # no count: nothing to divide by
    one = LossAccount([4], "mean")  # one microbatch: its loss as it is, as one step over the batch
    assert one.add(0, torch.tensor(3.0), {"loss": torch.tensor(3.0), "num_items": 7}).item() == 3.0
    assert one.normalizer() == 1.0


def test_mean_targets_counts_what_a_mean_cross_entropy_or_nll_loss_averaged_over():
    from lightning_pipe.lightning.losses import MeanTargets

    targets, logits = MeanTargets(), torch.randn(5, 3)
    labels = torch.tensor([0, 2, -100, 1, -100])
    original = torch.nn.functional.cross_entropy
    with targets.watching():
        by_module = torch.nn.CrossEntropyLoss()(logits, labels)  # looks F.cross_entropy up when called
        weighted = torch.nn.functional.cross_entropy(logits, labels, weight=torch.tensor([1.0, 2.0, 4.0]))
        nll = torch.nn.functional.nll_loss(logits.log_softmax(-1), labels.clamp(min=0), ignore_index=2)
        summed = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        soft = torch.nn.functional.cross_entropy(logits, torch.full((5, 3), 1 / 3))
    assert torch.nn.functional.cross_entropy is original  # put back
    assert targets.count_of(by_module) == 3 and targets.count_of(weighted) == 1 + 4 + 2
    assert targets.count_of(nll) == 4  # the targets that are not 2
    assert targets.count_of(summed) is None and targets.count_of(soft) is None and targets.count_of(by_module * 2) is None
    assert targets.ignored_some()
    account = LossAccount([3, 2], "mean")  # the count stands for num_items
    first = account.add(0, by_module, by_module, counted=targets.count_of(by_module))
    second = account.add(1, weighted, {"loss": weighted, "num_items": 9}, counted=targets.count_of(weighted))  # given
    assert account.log_weights() == [3.0, 9.0]  # wins
    torch.testing.assert_close((first + second) / account.normalizer(), (3 * by_module + 9 * weighted) / 12)


def test_a_loss_written_in_place_after_the_call_is_not_taken_for_its_output():
    """Regression (review): `loss = F.cross_entropy(..., reduction="sum"); loss /= n` keeps the output's memory, and
    was taken for a summed loss (refused under loss_reduction="mean", where it is right) or for a counted mean."""
    from lightning_pipe.lightning.losses import MeanTargets

    targets, logits, labels = MeanTargets(), torch.randn(4, 3), torch.tensor([0, 1, 2, -100])
    with targets.watching():
        mean = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        mean /= 3
        shifted = torch.nn.functional.cross_entropy(logits, labels)
        shifted += 1.0
        plain = torch.nn.functional.cross_entropy(logits, labels)
        each = torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="none")  # 0-dim, not a reduction
        with torch.inference_mode():  # no version counter: taken as it is
            evaluated = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    assert targets.reduction_of(mean) is None and targets.count_of(mean) is None
    assert targets.reduction_of(shifted) is None and targets.count_of(shifted) is None
    assert targets.reduction_of(plain) == "mean" and targets.count_of(plain) == 3
    assert targets.reduction_of(each) is None and targets.reduction_of(evaluated) == "sum"


def test_a_checkpoint_holding_values_no_process_has_is_refused():
    from lightning_pipe.lightning.strategy import _refuse_meta_tensors

    _refuse_meta_tensors({"a": torch.zeros(2), "n": 3})
    with pytest.raises(ConfigurationError, match=r"tensors without values \(on the meta device\): \['b'\].*Filter "
                                                 r"checkpoint\['state_dict'\] instead"):
        _refuse_meta_tensors({"a": torch.zeros(2), "b": torch.empty(2, device="meta")})


def test_step_results_merge_like_one_step_over_the_batch():
    parts = [{"preds": torch.zeros(2), "acc": torch.tensor(1.0), "num_items": torch.tensor(3), "ids": ["a", "b"]},
             {"preds": torch.ones(1), "acc": torch.tensor(0.0), "num_items": torch.tensor(1), "ids": ["c"]}]
    merged = merge(parts, [2.0, 1.0], [2, 1])
    assert merged["preds"].tolist() == [0.0, 0.0, 1.0] and merged["ids"] == ["a", "b", "c"]
    torch.testing.assert_close(merged["acc"], torch.tensor(2 / 3))
    assert int(merged["num_items"]) == 4
    # integers count (regression, review: averaged, `len(y)` 6 gave 1.667 and a count tensor a truncated mean); a
    # plain int equal in every microbatch to an index the step knows is kept (review M: summed, batch_idx 7 gave 28)
    shapes = Shapes()
    shapes.indices = {7, 100}  # batch_idx, global step
    parts = [{"n": 2, "correct": torch.tensor(2), "zero": 0, "batch_idx": 7, "step": 100},
             {"n": 1, "correct": torch.tensor(0), "zero": 0, "batch_idx": 7, "step": 100}]
    merged = merge(parts, [2.0, 1.0], [2, 1], shapes=shapes)
    assert merged == {"n": 3, "correct": torch.tensor(2), "zero": 0, "batch_idx": 7, "step": 100}
    assert type(merged["n"]) is int and merged["correct"].dtype == torch.int64
    # equal counts first, other counts later (review N: taken for an index for good, 2 + 2 + 2 + 2 gave 2)
    for count in (0, 2):
        assert merge([{"correct": count}] * 4, [2.0] * 4, [2] * 4, shapes=shapes)["correct"] == 4 * count


def test_step_results_are_joined_as_one_step_over_the_batch_returns_them():
    """Regression: a one-sample microbatch's ``out.squeeze()`` is 0-dim, and a batch's predictions came back as
    a list of tensors and numbers, or (every microbatch of one sample) as their mean; a tensor without a batch
    dimension (``logits.mean(0)``, a confusion matrix) was concatenated into a tensor of another shape. Rows that
    follow the samples (per-token ``view(-1, V)``, a masked selection) are joined as before; one value is kept."""
    squeezed = [torch.tensor([0.5, 1.5]), torch.tensor(2.5), torch.tensor(3.5)]
    torch.testing.assert_close(merge(squeezed, [2, 1, 1], [2, 1, 1]), torch.tensor([0.5, 1.5, 2.5, 3.5]))
    tokens = [torch.zeros(6, 5), torch.ones(3, 5)]  # 3 tokens a sample, flattened; then a masked selection
    assert merge(tokens, [2, 1], [2, 1]).shape == (9, 5)
    assert merge([torch.zeros(4), torch.ones(4)], [2, 2], [2, 2]).shape == (8,)
    single = torch.tensor(0.25)  # a batch of one sample is one microbatch: its result as it is
    assert merge([single], [1], [1], predictions=True) is single
    ones = [torch.tensor(0.5), torch.tensor(1.5)]
    torch.testing.assert_close(merge(ones, [1, 1], [1, 1], predictions=True), torch.tensor([0.5, 1.5]))
    torch.testing.assert_close(merge(ones, [1, 1], [1, 1]), torch.tensor(1.0))  # a loss or a metric: the mean
    predicted = merge([{"loss": v, "preds": v} for v in ones], [1, 1], [1, 1], predictions=True)
    assert predicted["loss"].dim() == 0 and predicted["preds"].shape == (2,)
    with pytest.warns(UserWarning, match="0-dim tensors under 'acc' from microbatches of one sample each"):
        merge([{"acc": v} for v in ones], [1, 1], [1, 1])
    shapes = Shapes()  # an earlier batch showed per-sample values under the key: a short last batch stacks them
    merge([{"out": {"preds": torch.zeros(2), "score": torch.tensor(0.0)}}] * 2, [2, 2], [2, 2], shapes=shapes)
    with pytest.warns(UserWarning, match="'out.score'"):  # not 'out.preds'
        merged = merge([{"out": {"preds": v, "score": v}} for v in ones], [1, 1], [1, 1], shapes=shapes)["out"]
    torch.testing.assert_close(merged["preds"], torch.tensor([0.5, 1.5]))
    torch.testing.assert_close(merged["score"], torch.tensor(1.0))  # another key at the same depth: a number
    matrices = [{"confusion": torch.eye(3)}, {"confusion": torch.ones(3, 3)}]
    with pytest.warns(UserWarning, match=r"'confusion' of shapes \[\(3, 3\), \(3, 3\)\] from microbatches of \[2, 1\]"):
        merged = merge(matrices, [2, 1], [2, 1], shapes=shapes)
    assert isinstance(merged["confusion"], list) and len(merged["confusion"]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once; a list again in a later batch of equal microbatches
        assert isinstance(merge(matrices, [2, 2], [2, 2], shapes=shapes)["confusion"], list)

    # a masked selection whose counts vary is rows, even where they happen to be equal or empty later
    shapes = Shapes()
    for counts, sizes in (([3, 1], [5, 4]), ([2, 2], [5, 4]), ([0, 0], [5, 4]), ([2, 2], [4, 4])):
        merged = merge([torch.zeros(n, 2) for n in counts], sizes, sizes, "wrong", shapes=shapes)
        assert merged.shape == (sum(counts), 2)
    assert merge([torch.zeros(0, 2)] * 2, [5, 4], [5, 4], "none", shapes=Shapes()).shape == (0, 2)
    # per-sample rows of each microbatch's own length (generate's outputs): one step pads them its own way
    with pytest.warns(UserWarning, match="rows of different lengths"):
        assert isinstance(merge([torch.zeros(2, 6), torch.zeros(2, 4)], [2, 2], [2, 2], "tokens"), list)
    # a number among tensors (`acc if n else 0.0`) combines with them
    torch.testing.assert_close(merge([torch.tensor(0.5), 0.0], [1.0, 1.0], [1, 1], "acc"), torch.tensor(0.25))


# -- 3: side effects of the step -----------------------------------------------------------------
def test_a_counter_in_the_step_is_warned_about_once(lm_runs):
    warned = warned_by_run(lm_runs("world2")[1], "world2", "training_step changed `self.steps_seen`")
    assert warned == {"diffusion_p2": 1}  # the run with the counter: once, though its step runs once per microbatch


@pytest.mark.parametrize("case, updated", [("ema", "teacher.0.weight"), ("ema_late", "teacher.weight")])
def test_an_ema_teacher_updated_in_the_step_is_refused_on_every_rank(tmp_path_factory, case, updated):
    """``ema_late`` updates an EMA of a module after the body from step 2 on. Regression: checked on
    the first step only, it trained on, the EMA updated once per microbatch on the last stage."""
    output = _refused_on_every_rank(tmp_path_factory, case, "SideEffectError", body="body")
    assert f"SideEffectError: training_step changed ['{updated}'," in output, output[-4000:]
    assert "Move it to a hook that runs once per batch on every rank" in output


def test_a_learning_rate_set_in_the_step_is_refused_on_every_rank(tmp_path_factory):
    """Regression (review): a warm-up writing param_groups' lr after the body changed it on the last stage only (the
    first stage trained on at the old rate), and a scheduler stepped in the step stepped once per microbatch."""
    output = _refused_on_every_rank(tmp_path_factory, "warmup_in_step", "SideEffectError")
    assert "training_step changed optimizer 0 param group 0: lr 0.002 -> 0.0002" in output, output[-4000:]
    assert "a learning-rate scheduler from configure_optimizers" in output


def test_a_scheduler_stepped_or_an_optimizer_added_in_the_step_is_found():
    from types import SimpleNamespace

    optimizer = torch.optim.AdamW([torch.zeros(2, requires_grad=True)], lr=torch.tensor(0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    trainer = SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])
    before = optimizer_settings(trainer)
    refuse_changed_settings("training_step", before, trainer)  # nothing changed: a tensor lr equal to itself
    scheduler.step()  # no new rate before step 100, but a step too many
    with pytest.raises(SideEffectError, match=r"lr scheduler 0: last_epoch 0 -> 1; lr scheduler 0: _step_count 1 -> 2"):
        refuse_changed_settings("training_step", before, trainer)
    before = optimizer_settings(trainer)
    optimizer.param_groups[0]["lr"].fill_(0.5)  # in place, as a capturable optimizer's tensor rate is changed
    with pytest.raises(SideEffectError, match="optimizer 0 param group 0: lr"):
        refuse_changed_settings("training_step", before, trainer)
    with torch.inference_mode():  # a tensor with no version (regression, review N: RuntimeError on every step)
        optimizer.param_groups[0]["lr"] = torch.tensor(0.5)
    before = optimizer_settings(trainer)
    refuse_changed_settings("training_step", before, trainer)
    before = optimizer_settings(trainer)
    optimizer.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
    with pytest.raises(SideEffectError, match="training_step changed the optimizers"):
        refuse_changed_settings("training_step", before, trainer)


def test_step_effects_tell_state_built_in_the_step_from_side_effects():
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(2)
            self.register_buffer("queue", torch.zeros(3))
            self.scores = []

    module = Module()
    effects = StepEffects(module, num_microbatches=2)
    snapshot = effects.before("validation_step")
    module.scores.append(1)
    module.norm(torch.randn(4, 2))  # a submodule's own statistics: allowed
    effects.after("validation_step", snapshot, last_stage=True)
    assert effects.built == {"scores"} and effects.shared_state() == {"scores": [1]}
    versions = effects.versions(module.parameters())
    module.norm(torch.randn(4, 2))
    effects.refuse_updated("training_step", versions)
    module.queue[0] = 1.0  # a buffer of the module itself, changed by the step
    with pytest.raises(Exception, match=r"changed \['queue'\] in place"):
        effects.refuse_updated("training_step", versions)
    with torch.inference_mode():  # a validation step assigned a new value: Lightning evaluates in inference mode
        module.queue = torch.zeros(3)
    effects.refuse_updated("validation_step", effects.versions(module.parameters()))  # an inference tensor: no version


@pytest.mark.parametrize("update, refused", [
    ("append", "['seen']"),  # a list grown before the body call
    ("metric", "['count']"),  # a torchmetrics Metric updated before the body call
    ("assign", None),  # a new value assigned: the whole run assigns it again, harmless
])
def test_state_grown_before_the_body_on_the_process_with_the_first_and_last_stage_is_refused(update, refused):
    """Under ZB-V process 0 runs the code before the body twice per microbatch (to feed the body, and whole for
    the loss): what that code grows would grow twice there, and the epoch-end state it shares be wrong."""
    from collections import OrderedDict
    from types import SimpleNamespace

    import lightning.pytorch as pl
    import torchmetrics

    from lightning_pipe import SideEffectError
    from lightning_pipe.lightning.body import BodyReached, PipelinedSequential
    from lightning_pipe.lightning.logs import LogRecorder
    from lightning_pipe.lightning.steps import StepRunner

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
            self.count, self.seen, self.last = torchmetrics.SumMetric(), [], None

        def training_step(self, batch, batch_idx):
            if update == "append":
                self.seen.append(batch_idx)
            elif update == "metric":
                self.count.update(1.0)
            else:
                self.last = batch.clone()
            return self.body(batch).sum()

    module = Module()
    layers = list(module.body.named_children())
    module.body = PipelinedSequential([OrderedDict(layers[:1]), OrderedDict(layers[1:])], False, (0, 3), 4)
    runner = StepRunner(module, module.body, "body", LogRecorder(module, "body"), StepEffects(module, 2), "never", "mean")
    runner.runs_whole_too = True
    runner.begin("training_step", (0,), SimpleNamespace(reseed=lambda *keys: None))
    if refused is None:
        with pytest.raises(BodyReached):
            runner.run(0, torch.ones(1, 2), "stop")
        return
    with pytest.raises(SideEffectError, match=rf"training_step changed {re.escape(refused)} before calling the body "
                                              r"`self.body`. This process holds the first and the last stage"):
        runner.run(0, torch.ones(1, 2), "stop")


# -- 6: what hooks and callbacks see -------------------------------------------------------------
@pytest.mark.parametrize("launch, name", [("world2", "llama_p2"), ("world3", "llama_p3"), ("world2", "llama_p2v2"),
                                          ("world2", "llama_zbv")])
def test_on_train_batch_end_receives_the_steps_whole_outputs(lm_runs, launch, name):
    """Regressions: rank 0 got only the loss; DDP passes the step's whole dict. on_validation_batch_end got
    None on rank 0 (only predictions were shared)."""
    got, want = lm_runs(launch)[0][name]["outputs"], lm_runs("reference")[0]["llama"]["outputs"]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys() == {"loss", "num_items", "preds"}
        torch.testing.assert_close(g["loss"], w["loss"])
        assert torch.equal(g["preds"], w["preds"]) and int(g["num_items"]) == int(w["num_items"])
    got, want = lm_runs(launch)[0][name]["val_outputs"], lm_runs("reference")[0]["llama"]["val_outputs"]
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g.keys() == w.keys() == {"loss", "num_items"}
        torch.testing.assert_close(g["loss"], w["loss"])
        assert int(g["num_items"]) == int(w["num_items"])


@pytest.mark.parametrize("launch, name", [("world2", "llama_p2"), ("world3", "llama_p3")])
def test_grad_norm_logged_before_the_optimizer_step_covers_the_whole_model(lm_runs, launch, name):
    """Regressions: grad_norm(self, 2) logged stage 0's own norm (0.059) where DDP logs 0.247; the same
    from on_after_backward (here the 1-norms) still did."""
    got, want = lm_runs(launch)[0][name]["csv"], lm_runs("reference")[0]["llama"]["csv"]
    names = [k for k in want[0] if k.startswith(("grad_2.0_norm", "grad_1.0_norm"))]
    assert {"grad_2.0_norm_total", "grad_2.0_norm/layers.3.mlp.2.weight", "grad_1.0_norm_total",
            "grad_1.0_norm/layers.3.mlp.2.weight"} <= set(names)
    for row_got, row_want in zip(got, want):
        for key in names:
            if row_want[key] == "":  # a validation row
                assert row_got[key] == ""
                continue
            torch.testing.assert_close(float(row_got[key]), float(row_want[key]), rtol=1e-9, atol=0)


@pytest.mark.parametrize("launch, name", [("world2", "llama_p2"), ("world3", "llama_p3")])
def test_an_epoch_metric_from_lists_built_in_validation_step_equals_ddp(lm_runs, launch, name):
    """Regression: the lists existed only on the last stage; rank 0 logged nan."""
    got, want = lm_runs(launch)[0][name], lm_runs("reference")[0]["llama"]
    value = got["callback_metrics"]["val_token_accuracy"]
    assert not torch.isnan(value)
    torch.testing.assert_close(value, want["callback_metrics"]["val_token_accuracy"])


def test_logs_of_several_stages_combine_per_name():
    stage0 = [{"name": "grad_2.0_norm/a", "value": torch.tensor(3.0)}, {"name": "grad_2.0_norm_total", "value": 3.0},
              {"name": "lr", "value": 0.1}]
    stage1 = [{"name": "grad_2.0_norm/b", "value": torch.tensor(4.0)}, {"name": "grad_2.0_norm/c", "value": torch.tensor(3.0)},
              {"name": "grad_2.0_norm_total", "value": 4.0}, {"name": "lr", "value": 0.1}, {"name": "mine", "value": 2.0}]
    stage1[1]["name"] = "grad_2.0_norm/a2"  # a tied copy of "a", known on stage 1 under another name
    calls, disagree = combine_stages([stage0, stage1], {"a2": "a"}, ["a", "b", "c"])
    by_name = {c["name"]: c["value"] for c in calls}
    assert by_name["grad_2.0_norm_total"].item() == 5.0  # sqrt(3^2 + 4^2), the tied copy counted once
    assert by_name["lr"] == 0.1 and by_name["mine"] == 2.0 and disagree == []


def test_constants_and_numpy_rows_merge_as_one_step_returns_them():
    """Review L: a string or flag the step returns whole came back once per microbatch, and `.numpy()` outputs as a
    list of arrays (np.concatenate of the predictions then failed, or stacked them into the wrong shape)."""
    import numpy as np

    parts = [{"model": "v1", "flag": True, "rows": np.full((2, 3), i)} for i in range(3)]
    merged = merge(parts, [2.0, 2.0, 2.0], [2, 2, 2])
    assert merged["model"] == "v1" and merged["flag"] is True
    assert merged["rows"].shape == (6, 3) and (merged["rows"][2:4] == 1).all()
    assert merge(["a", "b"], [1.0, 1.0], [1, 1]) == ["a", "b"]  # not one value: one per microbatch, as before
