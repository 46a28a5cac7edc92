"""Models no device holds whole: each rank builds and keeps only its stage; sharded checkpoints.

``meta_llama`` (tests/lm_app.py) creates its blocks in ``configure_model()``: under PipeStrategy on
the meta device, each rank materializing only its own blocks; on one device (the DDP reference)
with the documented initial values (``lightning_pipe.materialize`` of the same blocks). Its
checkpoints are sharded by default (built on meta). Resumes are compared with Lightning's own
resume under DDP, the reference the issue asks for.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import launch_lm_app, stop_reasons
from tests.test_model_styles import assert_same_training


def _spec(name, strategy, devices, **options):
    return dict(name=name, case="meta_llama", strategy=strategy, devices=devices, **options)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run by name (each launch runs its fits in the same processes); ``roots`` by launch."""
    results, roots, outputs = {}, {}, {}

    def launch(name, specs):
        got, roots[name], outputs[name] = launch_lm_app(tmp_path_factory, f"big_{name}", specs)
        results.update(got)

    launch("two", [_spec("p2", "pipe", 2, save_after_fit=True), _spec("ddp2", "ddp", 2),
                   _spec("p2_full", "pipe", 2, save_after_fit=True, state_dict_type="full"),
                   _spec("p2_flops", "pipe", 2, balance="flops", steps=1),
                   _spec("p2v2", "pipe", 2, schedule="interleaved_1f1b", virtual_stages=2), _spec("p2zbv", "pipe", 2, schedule="zbv")])
    sharded = str(roots["two"] / "p2" / "ckpt" / "epoch=0-step=6.ckpt")
    launch("three", [_spec("p3", "pipe", 3), _spec("p3_resume", "pipe", 3, epochs=2, resume=sharded)])
    launch("four", [_spec("p2x2", "pipe", 4, pipe_size=2), _spec("p4", "pipe", 4, steps=1, microbatches=4)])
    consolidated = str(roots["two"] / "consolidated.ckpt")
    subprocess.run([sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", sharded,
                    "--output_file", consolidated], check=True, capture_output=True, timeout=120)
    launch("one", [_spec("ref", "ddp", 1), _spec("ref_resume", "ddp", 1, epochs=2, resume="ref/ckpt/last.ckpt"),
                   _spec("p1_resume", "pipe", 1, epochs=2, resume=sharded),
                         _spec("plain_resume", "ddp", 1, epochs=2, resume=consolidated),
                         _spec("after_fit_resume", "pipe", 1, epochs=2, resume=str(roots["two"] / "p2" / "final.ckpt")),
                         _spec("full_after_fit_resume", "ddp", 1, epochs=2,
                               resume=str(roots["two"] / "p2_full" / "final.ckpt"))])
    return results, roots, outputs


@pytest.mark.parametrize("name, reference", [("p2", "ref"), ("p3", "ref"), ("p2x2", "ddp2")])
def test_a_model_built_in_configure_model_trains_as_under_ddp(runs, name, reference):
    assert_same_training(runs[0][name], runs[0][reference])


@pytest.mark.parametrize("launch, name, stages", [("two", "p2", 2), ("three", "p3", 3), ("four", "p4", 4),
                                                  ("two", "p2_flops", 2)])
def test_each_rank_materializes_only_its_own_blocks_with_the_documented_values(runs, launch, name, stages):
    _, roots, _ = runs
    root = roots[launch]
    reference = torch.load(roots["one"] / "materialized_ref_0.pt")  # one device: every block
    owned = []
    for rank in range(stages):
        with open(root / f"materialized_{name}_{rank}.json") as f:
            held = json.load(f)
        assert all(all(flags) or not any(flags) for flags in held["layers"].values()), held  # whole blocks
        owned.append([int(block.split(".")[1]) for block, flags in held["layers"].items() if all(flags)])
        first_or_last = rank in (0, stages - 1)
        assert held["outside_real"] == (["embed.weight", "head.weight", "norm.weight"] if first_or_last else [])
        initial = torch.load(root / f"materialized_{name}_{rank}.pt")
        for key, value in initial.items():
            torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    # every block materialized on exactly one rank, stages in order: no rank holds another stage's layers
    assert [block for blocks in owned for block in blocks] == [0, 1, 2, 3] and all(owned), owned


@pytest.mark.parametrize("name, owned, outside", [
    ("p2v2", [[0, 2], [1, 3]], [True, True]),  # interleaved 1F1B: the first stage on process 0, the last on 1
    ("p2zbv", [[0, 3], [1, 2]], [True, False]),  # ZB-V: the first and the last stage on process 0
])
def test_two_stages_per_process_materialize_only_their_blocks_and_train_as_under_ddp(runs, name, owned, outside):
    _, roots, _ = runs
    reference = torch.load(roots["one"] / "materialized_ref_0.pt")
    for rank in range(2):
        with open(roots["two"] / f"materialized_{name}_{rank}.json") as f:
            held = json.load(f)
        assert [int(block.split(".")[1]) for block, flags in held["layers"].items() if all(flags)] == owned[rank]
        assert not any(any(flags) for block, flags in held["layers"].items() if int(block.split(".")[1]) not in owned[rank])
        assert held["outside_real"] == (["embed.weight", "head.weight", "norm.weight"] if outside[rank] else [])
        initial = torch.load(roots["two"] / f"materialized_{name}_{rank}.pt")
        for key, value in initial.items():
            torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    assert_same_training(runs[0][name], runs[0]["ref"])


@pytest.mark.parametrize("name", ["p3_resume", "p1_resume", "plain_resume"])
def test_a_sharded_checkpoint_resumes_under_any_layout_as_lightning_resumes(runs, name):
    """Saved sharded by 2 stages; resumed by 3 stages, by one process, and, consolidated, by plain DDP:
    each ends where Lightning's DDP ends after the same save and resume."""
    got, want = runs[0][name], runs[0]["ref_resume"]
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, msg=lambda m: f"{key}: {m}")
    assert got["global_step"] == want["global_step"] == 12


@pytest.mark.parametrize("name", ["after_fit_resume", "full_after_fit_resume"])
def test_a_checkpoint_saved_after_fit_resumes(runs, name):
    """Regression: trainer.save_checkpoint after fit wrote stage 0's optimizer state only, so resuming
    failed ("the checkpoint's param group has 20 parameters but this model's has 36"). Sharded and
    resumed under PipeStrategy, full and resumed under a plain Trainer."""
    got, want = runs[0][name], runs[0]["ref_resume"]
    for key, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, msg=lambda m: f"{key}: {m}")


def test_the_consolidated_checkpoint_loads_in_a_plain_process(runs):
    from tests.lm_app import MetaLlama

    _, roots, _ = runs
    checkpoint = torch.load(roots["two"] / "consolidated.ckpt", weights_only=False)
    model = MetaLlama()
    model.configure_model()
    model.load_state_dict(checkpoint["state_dict"])
    assert [len(g["params"]) for g in checkpoint["optimizer_states"][0]["param_groups"]] == [39]


def test_a_sharded_checkpoint_with_a_missing_shard_is_refused_on_every_rank(runs, tmp_path_factory):
    _, roots, _ = runs
    broken = roots["two"] / "p2" / "ckpt" / "epoch=0-step=6.ckpt"
    os.remove(broken / "__1_0.distcp")
    code, seconds, survivors, output = launch_lm_app(
        tmp_path_factory, "missing_shard", [_spec("broken", "pipe", 2, resume=str(broken))], expect_failure=True,
        timeout=120,
    )
    assert code != 0 and not survivors and seconds < 90, (seconds, survivors, output[-4000:])
    reasons = stop_reasons(output)
    assert sorted(reasons) == [0, 1] and all(r.startswith("MissingShardError") for r in reasons.values()), output[-4000:]
    assert "__1_0.distcp" in output


def test_balance_by_flops_counts_a_meta_built_model_without_materializing_it(runs):
    """Global rank 0 counts every block's FLOPs on meta stand-ins; the blocks of the other stage stay meta
    there (see the materialization test for p2_flops) and the summary shows the estimate per stage."""
    _, _, outputs = runs
    assert re.search(r"stage 0: layers 0\.\.1 \(2\), [\d,]+ parameters, ranks \[0\], flops [\d.e+]+ GFLOP", outputs["two"])


def test_each_rank_holds_about_its_share_of_the_training_state():
    """benchmarks/memory_per_rank.py at p = 2, body built in configure_model(): each rank's peak resident
    memory above its start stays near its stage's parameters, gradients and AdamW state (a loose bound;
    the benchmark reports the exact ratios)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.memory_per_rank import run

    ranks = run(2, True, 3)
    assert len(ranks) == 2
    for rank in ranks:
        ideal = 4 * rank["stage_bytes"] + 4 * rank["outside_bytes"]
        assert rank["stage_bytes"] == 8 * 2048 * 2049 * 4  # half of the 16 blocks, and nothing of the other half
        assert rank["peak"] < 1.5 * ideal, (rank["peak"] / 2**20, ideal / 2**20)
