"""The examples run: the plain-API demo, the LightningCLI language model, the digits U-Net and the
Hugging Face Llama, each in a subprocess.

Every run has a hard timeout and ``OMP_NUM_THREADS=1``; sizes are tiny so the runs together take
about two minutes on two cores. The LightningCLI runs write into a tmp dir
(``--trainer.default_root_dir`` and the CSV logger's ``save_dir``).
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN = os.path.join(ROOT, "examples", "plain_pipeline.py")
TRAIN = os.path.join(ROOT, "examples", "stdlib_lm", "train.py")
CONFIG = os.path.join(ROOT, "examples", "stdlib_lm", "config.yaml")
TIMEOUT = 240

sys.path.insert(0, ROOT)


def run(cmd, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-6000:]}"
    return output


def test_plain_pipeline_loss_drops(tmp_path):
    output = run([sys.executable, PLAIN, "--steps", "30", "--print-every", "10"], tmp_path)
    assert "rank 0: F0 F1 .. B0" in output, output  # the 1F1B diagram is printed first
    match = re.search(r"first loss ([\d.]+), last loss ([\d.]+)", output)
    assert match, output
    first, last = map(float, match.groups())
    assert last < first - 0.5, output


# A tiny model and data set; max_steps=4 with validation after steps 2 and 4.
TINY = [
    "--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1",
    "--model.d_model=32", "--model.n_layers=2", "--model.n_heads=2", "--model.max_len=32",
    "--data.max_bytes=40000", "--data.seq_len=32", "--data.batch_size=8",
]


def fit(tmp_path, *overrides):
    cmd = [
        sys.executable, TRAIN, "fit", "--config", CONFIG, *TINY, *overrides,
        f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    output = run(cmd, tmp_path)
    log_dir = tmp_path / "stdlib_lm" / "version_0"
    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert sum(1 for r in rows if r["val_loss"]) == 2, rows  # after steps 2 and 4
    assert all(r["val_bpb"] for r in rows if r["val_loss"]), rows
    assert sum(1 for r in rows if r["train_loss"]) == 4, rows
    checkpoints = list((log_dir / "checkpoints").glob("*.ckpt"))
    assert [c.name for c in checkpoints] == ["epoch=0-step=4.ckpt"], checkpoints
    # the checkpoint holds the whole, unpartitioned model
    from examples.stdlib_lm.model import ByteLM

    model = ByteLM.load_from_checkpoint(checkpoints[0], map_location="cpu")
    assert len(model.layers) == 2
    return output, log_dir


def test_cli_with_registered_strategy_name(tmp_path):
    output, log_dir = fit(tmp_path, "--trainer.strategy=pipe")
    assert "PipeStrategy: 2 stages x 1 replicas, schedule 1f1b, 4 microbatches" in output, output[-3000:]
    assert "  strategy: pipe\n" in (log_dir / "config.yaml").read_text()  # the name replaced the class_path


def test_the_shipped_config_runs_unpipelined_for_comparison(tmp_path):
    """README's comparison run: one process, Lightning's own strategy, the same config (its
    PipelineTrace callback included: it says it has nothing to record instead of failing, which it
    did)."""
    output, _ = fit(tmp_path, "--trainer.devices=1", "--trainer.strategy=auto")
    assert "PipeStrategy:" not in output and "trained 4 steps: train_loss" in output
    assert "timeline:" not in output


def test_cli_with_shipped_config(tmp_path):
    """The config's class_path form: PipeStrategy(pipe_size=2, num_microbatches=4, schedule=1f1b), and a
    PipelineTrace callback recording batches 2 and 3 here; the run ends by saying where its files are."""
    output, log_dir = fit(tmp_path, "--trainer.callbacks.first=2")
    assert "lightning_pipe.PipeStrategy" in (log_dir / "config.yaml").read_text()
    assert "PipeStrategy: 2 stages x 1 replicas, schedule 1f1b, 4 microbatches" in output, output[-3000:]
    assert re.search(r"trained 4 steps: train_loss [\d.]+, val_loss [\d.]+, val_bpb [\d.]+", output), output[-3000:]
    assert f"logs:       {log_dir}/metrics.csv" in output
    assert f"checkpoint: {log_dir}/checkpoints/epoch=0-step=4.ckpt" in output
    assert f"timeline:   {log_dir}/pipeline_timeline.png" in output and (log_dir / "pipeline_trace.json").exists()


def test_digits_unet_example_trains(tmp_path):
    """The U-Net on scikit-learn's bundled digits: skips across 2 stages, deferred BatchNorm,
    ``checkpoint="except_last"``; 2 epochs (44 steps) here, well past 0.8 validation accuracy
    (the example's default 15 reach about 0.99)."""
    import pytest

    pytest.importorskip("sklearn")  # load_digits reads data shipped inside scikit-learn, no download
    script = os.path.join(ROOT, "examples", "digits_unet", "train.py")
    output = run([sys.executable, script, "--devices", "2", "--pipe-size", "2", "--max-epochs", "2",
                  "--root", str(tmp_path)], tmp_path)
    assert "PipeStrategy: 2 stages x 1 replicas, schedule 1f1b, 4 microbatches, checkpoint except_last" in output, \
        output[-3000:]
    match = re.search(r"trained (\d+) steps .* final val_acc ([\d.]+)", output)
    assert match, output[-3000:]
    steps, logged = int(match.group(1)), float(match.group(2))
    assert steps == 2 * 22, output[-3000:]  # 1438 training images in batches of 64, the last one dropped
    assert logged > 0.8, output[-3000:]
    # the whole model gathered after fit, run in one process, agrees with what the pipeline logged
    gathered = float(re.search(r"gathered model in one process: val_acc ([\d.]+)", output).group(1))
    assert abs(gathered - logged) < 0.01, output[-3000:]
    # deferred BatchNorm: running statistics updated once per batch, not once per microbatch
    assert f"BatchNorm running statistics updated [{steps}] times" in output, output[-3000:]
    with open(tmp_path / "digits_unet" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert sum(1 for r in rows if r["val_acc"]) == 2, rows


def test_hugging_face_llama_example_trains_as_one_process_does(tmp_path):
    """The transformers example: BatchEncoding batches from Hugging Face's collator, the model's own loss, the
    decoder layers split over 2 stages; its per-step losses and validation loss equal the one-process DDP run's
    (float32: the microbatches' sums round differently)."""
    import pytest

    pytest.importorskip("transformers")
    script = os.path.join(ROOT, "examples", "hf_llama", "train.py")
    tiny = ["--steps", "4", "--max-bytes", "150000", "--vocab-size", "512", "--d-model", "32", "--layers", "2"]
    results = {}
    for strategy, devices in (("pipe", "2"), ("ddp", "1")):
        output = run([sys.executable, script, *tiny, "--strategy", strategy, "--devices", devices,
                      "--root", str(tmp_path / strategy)], tmp_path)
        losses = re.search(r"step losses: ([\d. ]+)\n", output)
        val = re.search(r"trained 4 steps: train_loss [\d.]+, val_loss ([\d.]+)", output)
        assert losses and val, output[-3000:]
        results[strategy] = [float(v) for v in losses.group(1).split()], float(val.group(1))
    (pipe, pipe_val), (ddp, ddp_val) = results["pipe"], results["ddp"]
    assert len(ddp) == 4 and ddp[-1] < ddp[0]
    for got, want in zip(pipe, ddp):
        assert abs(got - want) <= 1e-4 * want, (pipe, ddp)
    assert abs(pipe_val - ddp_val) <= 2e-3, (pipe_val, ddp_val)  # printed with 3 decimals
