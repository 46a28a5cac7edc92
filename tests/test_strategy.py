"""PipeStrategy end to end: the same run under Lightning's DDP and under the pipeline must agree.

Each run is ``tests/lightning_app.py`` in a subprocess (Lightning's launcher re-executes the script
per rank), with a hard timeout; runs with the same number of processes share one launch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import stop_reasons

APP = os.path.join(os.path.dirname(__file__), "lightning_app.py")
TIMEOUT = 240


def run_app(tmp_path_factory, name, *args, expect_failure=False):
    root = tmp_path_factory.mktemp(name)
    out = root / "result.pt"
    cmd = [sys.executable, APP, "--root", str(root), "--out", str(out), *map(str, args)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    if expect_failure:
        assert proc.returncode != 0, "the run was expected to fail"
        return proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = torch.load(out, weights_only=False)
    result["root"] = root
    result["output"] = proc.stdout + proc.stderr
    return result


def run_apps(tmp_path_factory, name, runs):
    """Several runs of tests/lightning_app.py in one launch (same number of processes): results by name."""
    root = tmp_path_factory.mktemp(name)
    cmd = [sys.executable, APP, "--runs", json.dumps(runs), "--root", str(root)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT * 2, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output[-8000:]}"
    results = {}
    for run in runs:
        results[run] = torch.load(root / run / "result.pt", weights_only=False)
        results[run].update(root=root / run, output=output)
    return results


_COMMON_SKIPBN = ["--strategy", "pipe", "--model", "skipbn", "--deferred-batch-norm", "--checkpoint", "except_last",
                  "--microbatches", 3]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    return run_apps(tmp_path_factory, "two", {
        "pipe_gpipe": ["--strategy", "pipe", "--devices", 2, "--schedule", "gpipe"],
        "pipe_bf16": ["--strategy", "pipe", "--devices", 2, "--precision", "bf16-mixed", "--max-epochs", 1],
        "pipe_ckpt": ["--strategy", "pipe", "--devices", 2, "--max-epochs", 1, "--model-summary"],
    })


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, two_processes):
    return run_apps(tmp_path_factory, "one", {
        "ddp": ["--strategy", "ddp", "--devices", 1],  # the run every pipelined run must reproduce
        "ddp_bf16": ["--strategy", "ddp", "--devices", 1, "--precision", "bf16-mixed", "--max-epochs", 1],
        "skipbn_1": [*_COMMON_SKIPBN, "--devices", 1],
        "resume_ddp": ["--strategy", "ddp", "--devices", 1, "--resume", first_epoch(two_processes)],
    })


@pytest.fixture(scope="module")
def three_processes(tmp_path_factory, two_processes):
    return run_apps(tmp_path_factory, "three", {
        "pipe_1f1b": ["--strategy", "pipe", "--devices", 3, "--schedule", "1f1b", "--checkpoint", "except_last"],
        "skipbn_3": [*_COMMON_SKIPBN, "--devices", 3, "--schedule", "1f1b"],
        "resume_pipe": ["--strategy", "pipe", "--devices", 3, "--resume", first_epoch(two_processes)],
    })


def first_epoch(two_processes):
    """The checkpoint pipe_ckpt (pipe_size=2) wrote after its first and only epoch."""
    return os.path.join(os.path.dirname(two_processes["pipe_ckpt"]["last_model_path"]), "epoch=0-step=4.ckpt")


@pytest.fixture(scope="module")
def reference(one_process):
    """Lightning's own DDP on one device: the run every pipelined run must reproduce."""
    return one_process["ddp"]


def assert_same_run(result, expected):
    from tests.test_model_styles import without_pipeline_metrics

    result, expected = (dict(run, csv=[without_pipeline_metrics(r) for r in run["csv"]],
                             callback_metrics=without_pipeline_metrics(run["callback_metrics"]),
                             tensorboard=without_pipeline_metrics(run["tensorboard"])) for run in (result, expected))
    for key, value in expected["state_dict"].items():
        torch.testing.assert_close(result["state_dict"][key], value, msg=lambda m: f"{key}: {m}")
    assert result["state_dict"].keys() == expected["state_dict"].keys()
    assert result["callback_metrics"].keys() == expected["callback_metrics"].keys()
    for key, value in expected["callback_metrics"].items():
        torch.testing.assert_close(result["callback_metrics"][key], value, msg=lambda m: f"{key}: {m}")
    assert len(result["csv"]) == len(expected["csv"])
    for got, want in zip(result["csv"], expected["csv"]):
        assert got.keys() == want.keys()
        for key in want:
            if want[key] == "" or got[key] == "":
                assert got[key] == want[key], (key, got, want)
            else:
                torch.testing.assert_close(float(got[key]), float(want[key]), rtol=1e-5, atol=1e-6)
    for got, want in zip(result["validated"] + result["tested"], expected["validated"] + expected["tested"]):
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    assert result["tensorboard"].keys() == expected["tensorboard"].keys()
    for tag, points in expected["tensorboard"].items():
        assert [step for step, _ in result["tensorboard"][tag]] == [step for step, _ in points], tag
        torch.testing.assert_close([v for _, v in result["tensorboard"][tag]], [v for _, v in points], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result["predictions"], expected["predictions"])
    # a BasePredictionWriter's files, named by global rank (regression: every stage's process wrote each prediction)
    written, want_written = (sorted(os.listdir(run["root"] / "written")) for run in (result, expected))
    assert written == want_written and "epoch_0.pt" in written
    for name in written:
        torch.testing.assert_close(torch.load(result["root"] / "written" / name, weights_only=False),
                                   torch.load(expected["root"] / "written" / name, weights_only=False))
    assert os.path.basename(result["best_model_path"]) == os.path.basename(expected["best_model_path"])
    assert result["global_step"] == expected["global_step"]


@pytest.mark.parametrize("launch, name", [("two_processes", "pipe_gpipe"), ("three_processes", "pipe_1f1b")])
def test_pipelined_fit_equals_ddp(request, reference, launch, name):
    """GPipe on 2 stages and 1F1B on 3 (checkpoint="except_last") against DDP on one device."""
    assert_same_run(request.getfixturevalue(launch)[name], reference)


def test_bf16_mixed_precision_matches_ddp(one_process, two_processes):
    """bf16 autocast runs on every stage: same training as DDP under bf16, up to bf16 rounding."""
    reference, result = one_process["ddp_bf16"], two_processes["pipe_bf16"]
    for key, value in reference["state_dict"].items():
        torch.testing.assert_close(result["state_dict"][key], value, rtol=0.02, atol=0.01, msg=lambda m: f"{key}: {m}")
    for key, value in reference["callback_metrics"].items():
        torch.testing.assert_close(result["callback_metrics"][key], value, rtol=0.02, atol=0.01)


def test_checkpoint_loads_in_a_plain_process(two_processes):
    """The ModelCheckpoint written under PipeStrategy is an ordinary checkpoint of the whole model."""
    sys.path.insert(0, os.path.dirname(__file__))
    from lightning_app import Regressor

    result = two_processes["pipe_ckpt"]
    # rank 0's model summary counts the whole model (embed 40 + body 432 + head 9), not stage 0's part
    assert re.search(r"481\s+Total params|Total params: 481", result["output"]), result["output"][-3000:]
    # the module's example_input_array, hidden from the summary (its forward needs the whole model), is put back
    assert result["example_input_array"].shape == (2, 4)
    checkpoint = torch.load(result["last_model_path"], weights_only=False)
    assert list(checkpoint["state_dict"]) == list(Regressor().state_dict())
    model = Regressor.load_from_checkpoint(result["last_model_path"])
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, result["state_dict"][key])
    # the optimizer state is in the unpartitioned layout: one entry per parameter with momentum
    optimizer = checkpoint["optimizer_states"][0]
    assert [len(g["params"]) for g in optimizer["param_groups"]] == [12, 4]
    assert sorted(optimizer["state"]) == list(range(16))


@pytest.mark.parametrize("launch, name", [("one_process", "resume_ddp"), ("three_processes", "resume_pipe")])
def test_resume_from_pipelined_checkpoint(request, reference, launch, name):
    """Resuming a pipe_size=2 checkpoint under a plain Trainer or 3 stages ends like an uninterrupted run."""
    result = request.getfixturevalue(launch)[name]
    for key, value in reference["state_dict"].items():
        torch.testing.assert_close(result["state_dict"][key], value, msg=lambda m: f"{key}: {m}")
    assert result["global_step"] == reference["global_step"]


def test_more_stages_than_layers_fails_on_every_rank(tmp_path_factory):
    output = run_app(
        tmp_path_factory, "too_deep", "--strategy", "pipe", "--devices", 3, "--depth", 1, expect_failure=True
    )
    reasons = stop_reasons(output)
    assert sorted(reasons) == [0, 1, 2] and all(r.startswith("PartitionError") for r in reasons.values()), output[-3000:]
    assert "needs at least 3 layers" in output


def test_skips_and_deferred_batch_norm_under_the_strategy(one_process, three_processes):
    """A U-Net-like body with BatchNorm, 3 stages, except_last checkpointing: equal to the same
    microbatches run in sequence in one process (pipe_size=1), running statistics included."""
    single, piped = one_process["skipbn_1"], three_processes["skipbn_3"]
    assert_same_run(piped, single)
    tracked = single["state_dict"]["body.1.bn.num_batches_tracked"]
    assert tracked == single["global_step"] * 2  # once per batch (2 batches per optimizer step), not per microbatch
