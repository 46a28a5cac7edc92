"""Models written the way model libraries write them, under PipeStrategy, against Lightning's DDP.

The runs are tests/lm_app.py launches shared through ``lm_runs`` (tests/conftest.py); the models
(a Llama-style layer list with keyword arguments and rotary tables, a GPT-2-style list called
with positional arguments and returning tuples, ALBERT-style blocks shared across stages, an
``nn.Sequential`` with its head tied to its embedding) are described in tests/lm_app.py.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tests.conftest import launch_lm_app, stop_reasons, warned_by_run


def without_pipeline_metrics(row: dict) -> dict:
    """What a pipelined run logs besides the model's own values: PipeStrategy's ``pipe/`` metrics."""
    return {k: v for k, v in row.items() if not k.startswith("pipe/")}


def assert_same_training(got, want, rtol=None, atol=None, flips=None):
    """Weights, every logged value, callback metrics and steps of two runs agree (``rtol``/``atol``:
    assert_close's tolerances for weights and logs, its dtype defaults when None). ``flips``: how far
    a few weights (at most 1 % of a tensor's elements) may differ beyond those tolerances."""
    got = dict(got, csv=[without_pipeline_metrics(r) for r in got["csv"]],
               callback_metrics=without_pipeline_metrics(got["callback_metrics"]))
    got["csv"] = [r for r in got["csv"] if any(v != "" for k, v in r.items() if k not in ("epoch", "step"))]
    assert got["state_dict"].keys() == want["state_dict"].keys()
    for key, value in want["state_dict"].items():
        if flips is not None and value.is_floating_point():
            far = ~torch.isclose(got["state_dict"][key], value, rtol=rtol, atol=atol)
            worst = (got["state_dict"][key] - value).abs().max().item()
            assert far.float().mean() <= 0.01 and worst <= flips, \
                f"{key}: {int(far.sum())} of {far.numel()} differ, by up to {worst}"
            continue
        torch.testing.assert_close(got["state_dict"][key], value, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
    assert len(got["csv"]) == len(want["csv"])
    for row_got, row_want in zip(got["csv"], want["csv"]):
        assert row_got.keys() == row_want.keys()
        for key, value in row_want.items():
            if value == "" or row_got[key] == "":
                assert row_got[key] == value, (key, row_got, row_want)
            else:
                # equal_nan: a step float16 skips logs nan gradient norms under both strategies
                torch.testing.assert_close(float(row_got[key]), float(value), rtol=rtol or 1e-9, atol=atol or 1e-12,
                                           equal_nan=True, msg=lambda m: f"logged {key}: {m}")
    assert got["callback_metrics"].keys() == want["callback_metrics"].keys()
    for key, value in want["callback_metrics"].items():
        torch.testing.assert_close(got["callback_metrics"][key], value, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{key}: {m}")
    assert got["global_step"] == want["global_step"]


@pytest.mark.parametrize("launch, name, reference", [
    ("world2", "llama_p2", "llama"),  # GPipe, 2 stages
    ("world3", "llama_p3", "llama"),  # 1F1B, 3 stages
    ("world4", "llama_p4", "llama"),  # ZB-H1, 4 stages, checkpoint="always"
    ("world2", "gpt2_p2", "gpt2"),  # ZB-H1
    ("world2", "gpt2_zbh2", "gpt2"),  # ZB-H2: 3 microbatches in flight per process, head tied to the embedding
    # Lightning's profiler="pytorch" and EarlyStopping on a pipe/ metric. Regressions (review ZZ): a step's results
    # still being sent when Lightning started its next profiler session crashed torch (SIGSEGV in 5 of 6 runs); the
    # pipe/ metrics were logged on global rank 0 only, and EarlyStopping raised on rank 1 ("not available")
    ("world2", "gpt2_observed", "gpt2"),
    ("world2", "torch_encoder_zbv", "torch_encoder"),  # torch's nn.TransformerEncoder, its loop in torch's forward
    ("world2", "saved_on_cpu_p2", "llama"),  # torch.autograd.graph.save_on_cpu() around the body call: allowed
    # review LLL: a cache built by a module the blocks hold, which the step calls before the loop (a rotary
    # embedding's), and a config field set for good in the step that the blocks never read (`use_cache = False`)
    # were refused as attributes set for the body call; only those put back after it are
    ("world2", "persistent_p2", "persistent"),
    ("world2", "body_hooks_p2", "body_hooks"),  # forward hooks on the nn.Sequential body itself
    ("world2", "body_hooks_zbv", "body_hooks"),  # the same where process 0 runs the step up to the body and whole
    ("world4", "gpt2_p4", "gpt2"),  # GPipe
    ("world3", "albert_p3", "albert"),  # ZB-H1, one block on every stage, clipped by the global norm
    ("world3", "tied_seq_p3", "tied_seq"),  # nn.Sequential body, tie from its first to its last stage
])
def test_model_style_trains_as_under_ddp(lm_runs, launch, name, reference):
    assert_same_training(lm_runs(launch)[0][name], lm_runs("reference")[0][reference])


def test_what_hooks_set_on_the_blocks_through_self_modules_is_on_every_process_after_fit(lm_runs):
    """Regression (review KKK): a hook switching the blocks through `self.modules()` (PEFT's `set_adapter` in
    on_train_batch_start, a freeze in on_train_end) reaches this process's blocks only during fit; the whole model
    fit put back had the other stages' blocks as they were at fit start (PEFT's other adapter active: logits 0.29
    from DDP's after fit, a merge_and_unload 0.13 off). Their owners' flags, lists and requires_grad now come back
    with the weights."""
    got, root, _ = lm_runs("world2")
    reference, reference_root, _ = lm_runs("reference")
    assert_same_training(got["switched_p2"], reference["switched"])
    with open(reference_root / "after_fit_switched_0.json") as f:
        expected = json.load(f)
    assert expected == [[False, ["seen", 3], False]] * 4
    for rank in (0, 1):
        with open(root / f"after_fit_switched_p2_{rank}.json") as f:
            assert json.load(f) == expected, rank


@pytest.mark.parametrize("name", ["cached_p2", "cached_p2_ckpt"])
def test_a_stateful_object_given_to_every_block_sees_one_microbatch_as_under_ddp(lm_runs, name):
    """Regression: a key/value cache made per call and given to every block (Hugging Face's DynamicCache, made
    unless use_cache=False) was one object on the last stage for every microbatch and step: attention over other
    microbatches' keys (Mistral trained something else), or 'backward through the graph a second time' (Llama,
    Qwen2, Gemma, Phi-3). Each run of a stage's blocks gets its own copy now, the recomputation too ("_ckpt")."""
    assert_same_training(lm_runs("world2")[0][name], lm_runs("reference")[0]["cached"])


def test_a_loss_that_is_cross_entropys_token_mean_itself_is_weighted_by_its_tokens_as_under_ddp(lm_runs):
    """Regression: a step returning F.cross_entropy(..., ignore_index=-100)'s mean with no num_items was weighted
    per microbatch by its samples, while DDP averages over the batch's tokens (silently different). The reference
    returns the same mean with num_items; a loss computed from the call (`loss + 0`) cannot be counted and differs."""
    want = lm_runs("reference")[0]["llama"]
    assert_same_training(lm_runs("world2")[0]["mean_ce_p2"], want)
    derived = lm_runs("world2")[0]["mean_ce_derived_p2"]["state_dict"]
    assert any(not torch.allclose(derived[k], v, rtol=1e-6, atol=1e-9) for k, v in want["state_dict"].items())
    warned = warned_by_run(lm_runs("world2")[1], "world2",
                           "is computed from a cross_entropy/nll_loss whose targets include ignored ones")
    assert warned == {"mean_ce_derived_p2": 1}  # once; the others return num_items or the call's output itself


@pytest.mark.parametrize("name", ["alternating_p2", "alternating_p2v2"])
def test_blocks_given_their_own_masks_train_as_under_ddp(lm_runs, name):
    """Regression: a loop giving every other block a sliding-window mask (alternating attention types, as
    Gemma 2/3 or Qwen2 with use_sliding_window) was refused with BodyCallError; the first stage now sends each
    block its own arguments (with checkpoint="always"; interleaved, stages 0 and 2 on process 0)."""
    assert_same_training(lm_runs("world2")[0][name], lm_runs("reference")[0]["alternating"])


def test_a_counted_loss_with_one_microbatch_trains_bit_for_bit_as_under_ddp(lm_runs):
    """Regression: a loss with num_items backpropagated loss x count (divided by the total at the step's end), so
    a norm computed in float32 inside the float64 model rounded its gradients at another scale than DDP's."""
    assert_same_training(lm_runs("world2")[0]["float32_norm_mb1"], lm_runs("reference")[0]["float32_norm"],
                         rtol=0, atol=0)


@pytest.mark.parametrize("name", ["frozen", "paramfree"])
def test_a_stage_without_trainable_parameters_trains_as_under_ddp(lm_runs, name):
    """Regression: a stage of frozen layers (stage 0 of a fine-tuning run) or of parameter-free
    layers (balance [4, 2]) made torch refuse the empty optimizer on that rank only."""
    assert_same_training(lm_runs("world2")[0][f"{name}_p2"], lm_runs("reference")[0][name])


def test_gradients_no_optimizer_holds_add_up_over_the_steps_as_under_ddp(lm_runs):
    """Regression (review): PipeStrategy dropped every gradient present before the first step of an
    accumulation window, where Lightning zeroes only the optimizer's parameters; a trainable parameter
    given to no optimizer lost what it had accumulated, every step."""
    _, root, _ = lm_runs("world2")
    _, reference_root, _ = lm_runs("reference")
    want = torch.load(os.path.join(reference_root, "unoptimized_grads_frozen_0.pt"))
    got = {}
    for rank in range(2):
        for name, grad in torch.load(os.path.join(root, f"unoptimized_grads_frozen_p2_{rank}.pt")).items():
            assert name not in got, f"{name} has a gradient on both stages"
            got[name] = grad
    assert sorted(want) == sorted(got) and any(n.startswith("norm.") for n in want) and len(want) > 1
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["llama_2x2", "llama_2x2zbh2"])  # ZB-H1; ZB-H2 with checkpoint="except_last"
def test_two_stages_times_two_replicas_equal_ddp_on_two_devices(lm_runs, name):
    assert_same_training(lm_runs("world4")[0][name], lm_runs("world2")[0]["llama_ddp2"])


def test_replicas_clipped_by_the_global_norm_after_the_overlapped_average_equal_ddp(lm_runs):
    """pp=2 x dp=2 under ZB-H2, the replica average started in the backward, then clipping by the norm over
    both stages (gradient_clip_val=0.5, which the summed loss's gradients exceed): DDP's weights."""
    results, ddp = lm_runs("world4")[0], lm_runs("world2")[0]
    assert results["sum_2x2_clip"]["started_early"] == 1
    assert_same_training(results["sum_2x2_clip"], ddp["sum_ddp2_clip"])
    clipped, unclipped = ddp["sum_ddp2_clip"]["state_dict"], ddp["sum_ddp2"]["state_dict"]
    assert any(not torch.allclose(clipped[k], unclipped[k]) for k in clipped), "the clip never clipped"


def test_replicas_average_inside_the_step_as_ddp_averages(lm_runs):
    """pp=2 x dp=2: from the second step the replica all-reduce starts in the backward (one batch per
    optimizer step, no num_items); the weights still equal DDP's. With num_items it waits for the
    step's end (the count divides first), also equal to DDP (llama_2x2 above)."""
    results = lm_runs("world4")[0]
    assert results["sum_2x2"]["started_early"] == 1  # its one bucket, launched by the last backward
    assert_same_training(results["sum_2x2"], lm_runs("world2")[0]["sum_ddp2"])
    assert results["llama_2x2"]["started_early"] is None


@pytest.mark.parametrize("case", ["experts", "experts_before"])
def test_replicas_whose_steps_use_different_modules_average_as_ddp(lm_runs, case):
    """Regression: an expert that only some replicas' samples reached made the replicas all-reduce
    gradient buffers of different layouts (gloo aborted; NCCL may hang or mix values), and one no
    replica used got a zero gradient, which AdamW steps. Before the body, the first step's replicas
    also kept different modules (one released an expert its first batch did not call), and the
    job hung. Now: averaged with zeros where unused, no gradient where unused everywhere, as DDP
    with find_unused_parameters; what the first step learns is the union over the replicas."""
    assert_same_training(lm_runs("world4")[0][f"{case}_2x2"], lm_runs("world2")[0][f"{case}_ddp2"])


def test_replicas_average_after_the_step_once_batches_accumulate(lm_runs):
    """Regression: GradientAccumulationScheduler({1: 2}) makes epoch 0 one batch per optimizer step and
    later epochs two. The replica average, moved inside the step after the first one, stayed there:
    the batch set aside before it was added unaveraged, and each replica stepped with its own
    gradients (weights 29 % off DDP's). Averaged after the step once batches accumulate."""
    assert_same_training(lm_runs("world4")[0]["sum_2x2_acc"], lm_runs("world2")[0]["sum_ddp2_acc"])


def test_the_summary_names_the_layer_list_and_the_ties(lm_runs):
    _, _, output = lm_runs("world3")
    assert "body `layers`" in output and "body `h`" in output and "body `body`" in output
    # ALBERT: the shared block's weights on every stage, and the head tied to the embedding (one line)
    assert re.search(r"kept in sync: \['h\.0\.attn\.out\.bias',[^\n]*'wte\.weight'\]\n", output)
    assert "kept in sync: ['body.0.weight']\n" in output  # tied_seq_p3: the first layer tied to the head


@pytest.mark.parametrize("launch, name, tied", [
    ("world3", "albert_p3", [("wte.weight", "lm_head.weight"), ("h.0.mlp.0.weight", "h.2.mlp.0.weight")]),
    ("world3", "tied_seq_p3", [("body.0.weight", "body.5.weight")]),
])
def test_tied_checkpoints_hold_one_copy_and_load_into_the_plain_module(lm_runs, launch, name, tied):
    from tests.lm_app import CASES

    result = lm_runs(launch)[0][name]
    checkpoint = torch.load(result["last_model_path"], weights_only=False)["state_dict"]
    model = CASES[name.rsplit("_", 1)[0]][0]().double()
    assert list(checkpoint) == list(model.state_dict())
    for first, second in tied:
        assert checkpoint[first].untyped_storage().data_ptr() == checkpoint[second].untyped_storage().data_ptr()
    model.load_state_dict(checkpoint)  # strict
    for first, second in tied:
        assert model.get_parameter(first) is model.get_parameter(second)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, result["state_dict"][key], msg=lambda m: f"{key}: {m}")


def test_a_body_frozen_then_unfrozen_by_backbone_finetuning_trains_as_under_ddp(lm_runs):
    """Regression (review S): with the body frozen in epoch 0 and its input needing no gradient, stage 0's output
    needed none; unfrozen in epoch 1 (BaseFinetuning's `unfreeze_and_add_param_group`), the first step of the
    epoch failed with "what a stage sends must depend only on the shapes of the pipeline's inputs"."""
    assert_same_training(lm_runs("world2")[0]["finetuned_p2"], lm_runs("reference")[0]["finetuned"])


def test_a_loop_the_pipeline_cannot_reproduce_fails_on_every_rank_within_seconds(tmp_path_factory):
    """A residual around each block call (`x = x + block(x)`): the first stage refuses it at the second call."""
    code, seconds, survivors, output = launch_lm_app(
        tmp_path_factory, "bad_loop", [dict(name="bad", case="bad_loop", strategy="pipe", devices=2)],
        expect_failure=True, timeout=120,
    )
    assert code != 0 and not survivors, (survivors, output[-4000:])
    assert seconds < 90, seconds
    reasons = stop_reasons(output)
    assert "block 1 was not given the hidden state block 0 returned" in reasons[0], output[-4000:]
    assert "because another rank failed: [pp_rank 0 | step 0 | 0F0] BodyCallError" in reasons[1], output[-4000:]


@pytest.mark.parametrize("case, refusal", [
    # `with torch.autocast(...)` around the body in the step (not the Trainer's precision): only the first stage ran
    # under it, and the second failed on "mat1 and mat2 must have the same dtype" (or, where a stage begins with no
    # matmul, would compute in another precision than one process)
    ("own_autocast", "called the body `self.layers` under autocast cpu bfloat16, where the step itself runs under "
                     "autocast off"),
    # review III: `torch.func.functional_call(self, params, ...)` in the step (SAM's perturbed weights): only the
    # first stage's layers used the given parameters, the others their own; weights ended 1.85e-2 from DDP's
    ("functional_call", "called the body `self.layers` with parameters of its own"),
    # activations saved rounded to bfloat16 by saved_tensors_hooks around the body call: only the first stage's
    ("quantized_saves", "called the body `self.layers` under torch.autograd.graph.saved_tensors_hooks of its own "
                        "(packing with `SavedHooks.logits.<locals>.pack`)"),
])
def test_a_body_called_in_a_context_of_the_steps_own_is_refused_on_every_rank(tmp_path_factory, case, refusal):
    """Only the first stage runs the body's layers inside the step: what the step puts around the call is refused."""
    code, seconds, survivors, output = launch_lm_app(
        tmp_path_factory, case, [dict(name=case, case=case, strategy="pipe", devices=2)], expect_failure=True,
        timeout=120,
    )
    assert code != 0 and not survivors, (survivors, output[-4000:])
    reasons = stop_reasons(output)
    assert f"ConfigurationError: training_step {refusal}" in reasons[0], output[-4000:]
    assert "because another rank failed: [pp_rank 0 | step 0 | 0F0] ConfigurationError" in reasons[1], output[-4000:]


@pytest.mark.parametrize("launch, name, reference", [
    ("world2", "fp16_p2", "fp16"),  # 1F1B, 2 stages, against one device
    ("world4", "fp16_2x2", "fp16_ddp2"),  # ZB-H1, 2 stages x 2 replicas, against DDP on 2 devices
])
def test_float16_mixed_precision_skips_the_same_steps_as_ddp(lm_runs, launch, name, reference):
    """precision="16-mixed": the losses are scaled per microbatch by the job's one loss scale, and
    when a gradient is not finite on one stage only (batch 2's embedding gradient, stage 0) every
    stage and replica skips that step and halves the scale, as Lightning's DDP does (before:
    refused with a ConfigurationError; a scaler per rank would let the other stages step).
    float16 autocast rounds microbatches and whole batches differently, hence the tolerances:
    a step taken by one run and skipped by the other moves AdamW weights by about lr = 1e-2, and
    AdamW moves a weight whose gradient is about 0 by +-lr, whose sign that rounding may flip (seen
    on one AMD EPYC: 1 weight of 512 off by 0.019, the rest within 1e-3, and a logged gradient norm
    off by 1.09e-3 of its value; 0.0196 on an Intel Xeon). ``flips`` allows two such flips of one weight
    (2 x 2 lr), since another CPU's vector width rounds differently again; a skipped step taken by one
    run only would move nearly every weight by about lr, far beyond the 1 % of elements allowed."""
    got = lm_runs(launch)[0][name]
    want = lm_runs("reference" if reference == "fp16" else "world2")[0][reference]
    assert want["loss_scale"] == got["loss_scale"] == 128.0  # 256 halved once: one step skipped everywhere
    assert all(float(r["train_loss"]) < 10 for r in want["csv"] if r.get("train_loss"))  # the losses stay finite
    assert_same_training(got, want, rtol=5e-3, atol=1e-3, flips=4.5e-2)  # float16's epsilon is 9.8e-4


# -- two stages per process: interleaved 1F1B (process r holds stages r and r + 2) and ZB-V (r and 3 - r)
@pytest.mark.parametrize("launch, name, reference", [
    ("world2", "llama_p2v2", ("reference", "llama")),  # layer list, 4 stages of one block on 2 processes
    ("world2", "tied_seq_p2v2", ("reference", "tied_seq")),  # nn.Sequential, tie from stage 0 to stage 3, clipped
    ("world4", "llama_2x2v2", ("world2", "llama_ddp2")),  # 2 processes x 2 replicas, checkpoint="always"
    ("world2", "llama_zbv", ("reference", "llama")),  # first and last stage on process 0
    ("world2", "tied_seq_zbv", ("reference", "tied_seq")),  # the tie's both ends on process 0: one copy
    ("world4", "llama_2x2zbv", ("world2", "llama_ddp2")),  # with replicas, checkpoint="except_last"
])
def test_two_stages_per_process_train_as_under_ddp(lm_runs, launch, name, reference):
    assert_same_training(lm_runs(launch)[0][name], lm_runs(reference[0])[0][reference[1]])


@pytest.mark.parametrize("schedule, bubble, peak, ranks", [
    # m = 3, p = 2, v = 2: (p - 1) / (v * m + p - 1) = 1 / 7; process 0 holds 6 (stage, microbatch) pairs of half size
    ("interleaved_1f1b", "14.3%", 3, [0, 1, 0, 1]),
    ("zbv", "5.3%", 2, [0, 1, 1, 0]),
])
def test_the_summary_lists_every_stage_and_the_schedules_ideal_bubble(lm_runs, schedule, bubble, peak, ranks):
    _, _, output = lm_runs("world2")
    summary = (f"PipeStrategy: 4 stages (2 per process) x 1 replicas, schedule {schedule}, 3 microbatches, "
               f"checkpoint never, body `layers`, ideal bubble {bubble}, up to {peak} microbatches in flight per "
               "process\n"
               + "".join(f"  stage {s}: layers {s}..{s} (1), 2,144 parameters, ranks [{r}]\n" for s, r in enumerate(ranks)))
    # every run of this shape prints it: interleaved alternating_p2v2, llama_p2v2 and its resume; zbv llama_zbv
    assert output.count(summary) == (3 if schedule == "interleaved_1f1b" else 1), output[-3000:]


def test_the_summary_gives_what_zb_h2_holds_beside_zb_h1(lm_runs):
    """The same ideal bubble, one more microbatch in flight (p = 2, m = 3: 2p - 1 against p)."""
    _, _, output = lm_runs("world2")
    for schedule, peak in (("zb_h1", 2), ("zb_h2", 3)):
        assert (f"PipeStrategy: 2 stages x 1 replicas, schedule {schedule}, 3 microbatches, checkpoint never, body `h`, "
                f"ideal bubble 10.0%, up to {peak} microbatches in flight per process\n") in output


def test_balance_by_flops_cuts_every_stage_of_an_interleaved_pipeline(lm_runs):
    """6 Linear layers then 4 heavy parameter-free mixing blocks, cut into 4 stages on 2 processes:
    one mixing block per stage, the cheap layers with the first."""
    _, _, output = lm_runs("world2")
    rows = [(0, "0..6 (7), 6,336", 0), (1, "7..7 (1), 0", 1), (2, "8..8 (1), 0", 0), (3, "9..9 (1), 0", 1)]
    # the whole summary: the 2-stage run of the 2-block model prints the first two rows too
    assert re.search(r"PipeStrategy: 4 stages \(2 per process\) x 1 replicas, schedule interleaved_1f1b, [^\n]*\n" + "".join(
        rf"  stage {stage}: layers {re.escape(layers)} parameters, ranks \[{rank}\], flops [\d.e+]+ [^\n]*\n"
        for stage, layers, rank in rows), output)


def _tied_once_checkpoints(lm_runs) -> list:
    """(pipelined sharded checkpoint, DDP's file) of `tied_once`: the last one fit saved, and the one saved after."""
    want, got = lm_runs("reference")[0]["tied_once"], lm_runs("world2")[0]["tied_once_sharded"]
    _, root, _ = lm_runs("world2")
    _, reference_root, _ = lm_runs("reference")
    return [(got["last_model_path"], want["last_model_path"]),
            (os.path.join(root, "tied_once_sharded", "final.ckpt"), os.path.join(reference_root, "tied_once", "final.ckpt"))]


def test_a_hook_deleting_one_key_of_a_tied_weight_saves_the_other_in_sharded_checkpoints_as_under_ddp(lm_runs):
    """Regression (this stop): `del checkpoint["state_dict"]["body.0.weight"]`, the embedding's key of a weight tied
    to the head, made the sharded save expect neither key, and then refuse the head's (not the model's); saved after
    fit (the whole model back in every process, the hooks given all of it), it expected the deleted key
    (CheckpointMismatchError: no rank saves it). One process's file keeps the head's key."""
    from lightning_pipe.consolidate import consolidate

    for saved, reference in _tied_once_checkpoints(lm_runs):
        assert os.path.isdir(saved)
        keys = list(torch.load(reference, weights_only=False)["state_dict"])
        assert "body.0.weight" not in keys and "body.5.weight" in keys
        assert sorted(consolidate(saved)["state_dict"]) == sorted(keys)


def test_a_weights_only_sharded_checkpoint_holds_the_weights_ddp_saves(lm_runs):
    """Regression (review NN): `trainer.save_checkpoint(path, weights_only=True)` (and ModelCheckpoint(
    save_weights_only=True)) under state_dict_type="sharded" failed on every rank: the save expected an optimizer
    state per optimizer layout."""
    from lightning_pipe.consolidate import consolidate

    _, root, _ = lm_runs("world2")
    _, reference_root, _ = lm_runs("reference")
    ours = consolidate(os.path.join(root, "tied_once_sharded", "weights.ckpt"))
    theirs = torch.load(os.path.join(reference_root, "tied_once", "weights.ckpt"), weights_only=False)
    assert "optimizer_states" not in ours and "optimizer_states" not in theirs
    assert list(ours["state_dict"]) == list(theirs["state_dict"])
    for key, value in theirs["state_dict"].items():
        torch.testing.assert_close(ours["state_dict"][key], value, msg=lambda m, k=key: f"{k}: {m}")


def test_a_param_group_ordered_otherwise_than_the_model_is_saved_in_its_own_order_as_under_ddp(lm_runs):
    """Regression (review Y): each stage's optimizer holds its own parameters only, and the checkpoint ordered a
    group's parameters of different stages by the model's order; `AdamW(list(self.parameters())[::-1])` was saved
    with each stage's state in the wrong places (shapes that happen to match resume silently into other
    parameters). The order is now learned from configure_optimizers run over the whole model (meta elsewhere),
    the tied weight (a copy per stage there) counted once at its first place, as one process counts it."""
    from lightning_pipe.consolidate import consolidate

    for saved, reference in _tied_once_checkpoints(lm_runs):
        (ours,), (theirs,) = consolidate(saved)["optimizer_states"], torch.load(reference, weights_only=False)[
            "optimizer_states"]
        assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
        assert sorted(ours["state"]) == sorted(theirs["state"])
        for index, state in theirs["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(ours["state"][index][key], value, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, i=index, k=key: f"parameter {i}, {k}: {m}")


def test_two_stages_per_process_checkpoints_hold_the_plain_module_and_resume_as_lightning(lm_runs):
    """The full checkpoints (interleaved 1F1B, ZB-V) load strictly into the plain module; the interleaved
    one resumed for a second epoch (writing sharded checkpoints) ends where one DDP run of two epochs ends."""
    from lightning_pipe.consolidate import consolidate
    from tests.lm_app import CASES

    results = lm_runs("world2")[0]
    model = CASES["llama"][0]().double()
    for name in ("llama_p2v2", "llama_zbv"):
        full = torch.load(results[name]["last_model_path"], weights_only=False)["state_dict"]
        assert list(full) == list(model.state_dict())
        model.load_state_dict(full)  # strict
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, results[name]["state_dict"][key], msg=lambda m: f"{key}: {m}")
    resumed, want = results["llama_p2v2_resume"], lm_runs("reference")[0]["llama_2ep"]
    assert resumed["global_step"] == want["global_step"] == 12
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][key], value, msg=lambda m: f"{key}: {m}")
    sharded = consolidate(resumed["last_model_path"])["state_dict"]
    assert sorted(sharded) == sorted(model.state_dict())
    model.load_state_dict(sharded)
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(model.state_dict()[key], value, msg=lambda m: f"{key}: {m}")
