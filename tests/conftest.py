import json
import os
import re
import signal
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# -- tests/lm_app.py launches, shared by the tests of model styles and of user code ------------------
# Each launch runs several fits in the same processes (one world size per launch), so the whole
# comparison against DDP costs a handful of process start-ups. Runs: name -> the spec lm_app reads.
def _spec(name, case, strategy, devices, **options):
    return dict(name=name, case=case, strategy=strategy, devices=devices, **options)


NOISE_EPOCHS = 20
# test modules whose own app (``main(kind, root, out)``: DDP on one device, PipeStrategy on two) runs in these launches
APPS = ("test_outside_body_usage", "test_user_hooks_and_callbacks", "test_batches_and_views", "test_stale_copies",
        "test_weight_averaging", "test_tuner", "test_data_loading")
LM_LAUNCHES = {
    "reference": [  # Lightning's DDP on one device
        _spec("llama", "llama", "ddp", 1), _spec("gpt2", "gpt2", "ddp", 1),
        _spec("torch_encoder", "torch_encoder", "ddp", 1), _spec("body_hooks", "body_hooks", "ddp", 1),
        _spec("albert", "albert", "ddp", 1, clip=0.5),
        _spec("tied_seq", "tied_seq", "ddp", 1, clip=0.5), _spec("sum", "sum", "ddp", 1), _spec("switched", "switched", "ddp", 1), _spec("persistent", "persistent", "ddp", 1),
        _spec("finetuned", "finetuned", "ddp", 1, epochs=2),
        _spec("denoise", "denoise", "ddp", 1, epochs=NOISE_EPOCHS), _spec("frozen", "frozen", "ddp", 1),
        _spec("paramfree", "paramfree", "ddp", 1), _spec("fp16", "fp16", "ddp", 1, fp16_scale=256.0),
        _spec("llama_2ep", "llama", "ddp", 1, epochs=2), _spec("cached", "cached", "ddp", 1),
        _spec("alternating", "alternating", "ddp", 1), _spec("float32_norm", "float32_norm", "ddp", 1),
        _spec("tied_once", "tied_once", "ddp", 1, steps=2, save_after_fit=True),
        *[dict(name=f"{app}_ddp", app=app, strategy="ddp", devices=1) for app in APPS],
        dict(name="test_weight_averaging_ddp_filtered", app="test_weight_averaging", strategy="ddp_filtered", devices=1),
    ],
    "world2": [
        _spec("llama_p2", "llama", "pipe", 2, schedule="gpipe", trace=[2, 2]), _spec("gpt2_p2", "gpt2", "pipe", 2, schedule="zb_h1"),
        _spec("gpt2_zbh2", "gpt2", "pipe", 2, schedule="zb_h2"), _spec("gpt2_observed", "gpt2", "pipe", 2, observed=True),
        _spec("torch_encoder_zbv", "torch_encoder", "pipe", 2, schedule="zbv"),
        _spec("body_hooks_p2", "body_hooks", "pipe", 2), _spec("body_hooks_zbv", "body_hooks", "pipe", 2, schedule="zbv"),
        _spec("sum_p2", "sum", "pipe", 2, schedule="gpipe"), _spec("finetuned_p2", "finetuned", "pipe", 2, epochs=2),
        _spec("denoise_p2", "denoise", "pipe", 2, schedule="gpipe", epochs=NOISE_EPOCHS),
        _spec("diffusion_p2", "diffusion", "pipe", 2), _spec("mixup_p2", "mixup", "pipe", 2, schedule="gpipe"),
        _spec("cached_p2", "cached", "pipe", 2), _spec("saved_on_cpu_p2", "saved_on_cpu", "pipe", 2),
        _spec("switched_p2", "switched", "pipe", 2), _spec("persistent_p2", "persistent", "pipe", 2), _spec("cached_p2_ckpt", "cached", "pipe", 2, checkpoint="always"),
        _spec("mean_ce_p2", "mean_ce", "pipe", 2), _spec("mean_ce_derived_p2", "mean_ce_derived", "pipe", 2),
        # a sliding-window mask for every other block: the blocks' own extra arguments
        _spec("alternating_p2", "alternating", "pipe", 2, checkpoint="always"),
        _spec("alternating_p2v2", "alternating", "pipe", 2, schedule="interleaved_1f1b", virtual_stages=2),
        _spec("float32_norm_mb1", "float32_norm", "pipe", 2, microbatches=1),
        _spec("llama_ddp2", "llama", "ddp", 2), _spec("frozen_p2", "frozen", "pipe", 2),
        _spec("paramfree_p2", "paramfree", "pipe", 2, balance=[4, 2]),
        _spec("tied_once_sharded", "tied_once", "pipe", 2, steps=2, save_after_fit=True, state_dict_type="sharded"),
        _spec("unbalanced_time", "unbalanced_pair", "pipe", 2, balance="time", steps=1),
        _spec("unbalanced_flops", "unbalanced_pair", "pipe", 2, balance="flops", steps=1),
        _spec("unbalanced_parameters", "unbalanced_pair", "pipe", 2, steps=1),
        _spec("fp16_p2", "fp16", "pipe", 2, fp16_scale=256.0), _spec("fp16_ddp2", "fp16", "ddp", 2, fp16_scale=256.0),
        _spec("sum_ddp2", "sum", "ddp", 2, epochs=3),
        _spec("sum_ddp2_acc", "sum", "ddp", 2, epochs=3, accumulate={"1": 2}),
        _spec("sum_ddp2_clip", "sum", "ddp", 2, epochs=3, clip=0.5),
        _spec("experts_ddp2", "experts", "ddp_find_unused_parameters_true", 2, epochs=3),
        _spec("experts_before_ddp2", "experts_before", "ddp_find_unused_parameters_true", 2, epochs=3),
        dict(name="test_weight_averaging_ddp2", app="test_weight_averaging", strategy="ddp2", devices=2),
        dict(name="test_weight_averaging_1x2", app="test_weight_averaging", strategy="pipe1x2", devices=2),
        dict(name="test_weight_averaging_pipe_sharded", app="test_weight_averaging", strategy="pipe_sharded",
             devices=2),
        dict(name="test_weight_averaging_pipe_sharded_filtered", app="test_weight_averaging",
             strategy="pipe_sharded_filtered", devices=2),
        dict(name="test_data_loading_ddp2", app="test_data_loading", strategy="ddp2", devices=2),
        # interleaved 1F1B, 2 stages per process; the resume writes sharded checkpoints
        _spec("llama_p2v2", "llama", "pipe", 2, schedule="interleaved_1f1b", virtual_stages=2),
        _spec("tied_seq_p2v2", "tied_seq", "pipe", 2, schedule="interleaved_1f1b", virtual_stages=2, clip=0.5),
        _spec("llama_p2v2_resume", "llama", "pipe", 2, schedule="interleaved_1f1b", virtual_stages=2, epochs=2,
              resume="llama_p2v2/ckpt/last.ckpt", state_dict_type="sharded"),
        # ZB-V: stages 0 and 3 on process 0, which computes the loss
        _spec("llama_zbv", "llama", "pipe", 2, schedule="zbv"),
        _spec("tied_seq_zbv", "tied_seq", "pipe", 2, schedule="zbv", clip=0.5),
        _spec("unbalanced_flops_v2", "unbalanced", "pipe", 2, balance="flops", steps=1, schedule="interleaved_1f1b",
              virtual_stages=2),
        *[dict(name=f"{app}_pipe", app=app, strategy="pipe", devices=2) for app in APPS],
    ],
    "world3": [
        _spec("llama_p3", "llama", "pipe", 3, trace=[3, 1]), _spec("albert_p3", "albert", "pipe", 3, schedule="zb_h1", clip=0.5),
        _spec("tied_seq_p3", "tied_seq", "pipe", 3, schedule="gpipe", clip=0.5),
        _spec("denoise_p3", "denoise", "pipe", 3, schedule="zb_h1", epochs=NOISE_EPOCHS),
        dict(name="test_data_loading_pipe3", app="test_data_loading", strategy="pipe3", devices=3),
    ],
    "world4": [
        _spec("llama_p4", "llama", "pipe", 4, schedule="zb_h1", checkpoint="always", microbatches=4),
        _spec("gpt2_p4", "gpt2", "pipe", 4, schedule="gpipe", microbatches=4),
        _spec("llama_2x2", "llama", "pipe", 4, pipe_size=2, schedule="zb_h1"),
        _spec("llama_2x2zbh2", "llama", "pipe", 4, pipe_size=2, schedule="zb_h2", checkpoint="except_last"),
        _spec("denoise_2x2", "denoise", "pipe", 4, pipe_size=2, epochs=NOISE_EPOCHS),
        _spec("fp16_2x2", "fp16", "pipe", 4, pipe_size=2, schedule="zb_h1", fp16_scale=256.0),
        _spec("sum_2x2", "sum", "pipe", 4, pipe_size=2, schedule="zb_h1", epochs=3),
        # GradientAccumulationScheduler: one batch per optimizer step in epoch 0, two from epoch 1
        _spec("sum_2x2_acc", "sum", "pipe", 4, pipe_size=2, schedule="zb_h1", epochs=3, accumulate={"1": 2}),
        # clipped by the global norm, which every replica must take after the average overlapped with the backward
        _spec("sum_2x2_clip", "sum", "pipe", 4, pipe_size=2, schedule="zb_h2", epochs=3, clip=0.5),
        _spec("experts_2x2", "experts", "pipe", 4, pipe_size=2, epochs=3),
        _spec("experts_before_2x2", "experts_before", "pipe", 4, pipe_size=2, epochs=3),
        _spec("llama_2x2v2", "llama", "pipe", 4, pipe_size=2, schedule="interleaved_1f1b", virtual_stages=2,
              checkpoint="always"),
        _spec("llama_2x2zbv", "llama", "pipe", 4, pipe_size=2, schedule="zbv", checkpoint="except_last"),
        dict(name="test_weight_averaging_2x2", app="test_weight_averaging", strategy="pipe2x2", devices=4),
        dict(name="test_data_loading_pipe2x2", app="test_data_loading", strategy="pipe2x2", devices=4),
    ],
}


def warned_by_run(root, launch, text):
    """``{run name: how many warnings of PipeStrategy's step checks containing text it showed, on any rank}``
    over the runs of lm_app launch ``launch`` that showed any (each run writes its own, see lm_app)."""
    counts = {spec["name"]: sum(text in w for path in (root / spec["name"]).glob("warnings_*.json")
                                for w in json.loads(path.read_text()))
              for spec in LM_LAUNCHES[launch]}
    return {name: n for name, n in counts.items() if n}


def stop_reasons(output):
    """{global rank: why it stopped} from the line PipeStrategy logs on each rank as it fails."""
    return {int(rank): reason for rank, reason in re.findall(r"^\[rank: (\d+)\] stopped: (.*)$", output, re.M)}


def launch_lm_app(tmp_path_factory, name, runs, expect_failure=False, timeout=420):
    """Run tests/lm_app.py with ``runs``; return (what rank 0 saved, the root folder, the output).

    Every rank is started at once, as torchrun would (Lightning's launcher starts the other ranks
    only after the first has imported everything: about 6 s more per launch on 2 cores). The tests
    of Lightning's own launcher are in test_scaling.py and test_strategy.py.
    """
    from tests.test_scaling import Launch, _env, _free_port

    root = tmp_path_factory.mktemp(f"lm_{name}")
    out = root / "result.pt"
    cmd = [sys.executable, os.path.join(HERE, "lm_app.py"), "--root", str(root), "--out", str(out), "--runs",
           json.dumps(runs)]
    (devices,) = {spec["devices"] for spec in runs}  # one world size per launch
    port = str(_free_port())
    envs = []
    for rank in range(devices):
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK="0", LOCAL_RANK=str(rank), WORLD_SIZE=str(devices))
        # ours are checked, Lightning's not
        env["PYTHONWARNINGS"] = "ignore,default:::lightning_pipe.lightning.effects,default:::lightning_pipe.lightning.steps"
        envs.append(env)
    codes, seconds, survivors, outputs = Launch(root, [cmd] * devices, envs).finish(timeout)
    output = "".join(outputs)
    if expect_failure:
        # a rank stopped by another's error exits with it, not SIGABRT (regression, reviews UU, WW, YY: a receive
        # thread returned into the finalizing interpreter as its peer exited: "terminate called without ...")
        assert -signal.SIGABRT not in codes and "terminate called" not in output, (codes, output[-4000:])
        return codes[0], seconds, survivors, output
    assert codes == [0] * devices and not survivors, f"{name} -> {codes}, survivors {survivors}:\n{output[-6000:]}"
    return torch.load(out, weights_only=False), root, output


@pytest.fixture(scope="session")
def lm_runs(tmp_path_factory):
    """Every run of LM_LAUNCHES by name, launched on first use; ``root`` and ``output`` per launch too."""
    cache, failed = {}, {}

    def get(launch):
        if launch in failed:  # once: every test of a failed launch would launch it again, minutes each
            pytest.fail(f"the {launch} launch failed earlier in this session: {failed[launch]}", pytrace=False)
        if launch not in cache:
            try:
                cache[launch] = launch_lm_app(tmp_path_factory, launch, LM_LAUNCHES[launch])
            except BaseException as error:
                failed[launch] = f"{type(error).__name__}: {str(error)[-3000:]}"
                raise
        return cache[launch]

    return get
