"""Sharded checkpoints: written by 2 stages, read by 3 and by 1, replicas written once, consolidated, refused by name.

The source of truth is an ordinary Lightning checkpoint of a plain run: each "stage" saves its part
of it as PipeStrategy would (its state-dict keys, its optimizer state by parameter name), and
consolidation must give that checkpoint back.
"""

import io
import os
import shutil

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipe.consolidate import consolidate, main, numbered
from lightning_pipe.lightning.state import group_names, localize_optimizer, parameter_names
from lightning_pipe.sharded import (
    CheckpointMismatchError,
    INDEX,
    MissingShardError,
    load_sharded,
    save_sharded,
)
from tests import distributed

DEPTH = 4
ALIASES = {"head.weight": "embed.weight"}


class Net(L.LightningModule):
    """An embedding tied to the head, a body of DEPTH layers, a norm; two param groups."""

    def __init__(self, width: int = 4, vocab: int = 5, depth: int = DEPTH) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def training_step(self, batch, batch_index):
        (tokens,) = batch
        return nn.functional.cross_entropy(self.head(self.norm(self.body(self.embed(tokens)))).flatten(0, 1),
                                           tokens.flatten())

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.05)

    def train_dataloader(self):
        tokens = torch.randint(0, 5, (16, 3), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)


def fit(max_steps: int, ckpt_path=None, model=None) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model or Net(), ckpt_path=ckpt_path)
    return trainer


def stage_of(key: str, num_stages: int) -> int:
    if key.startswith("body."):
        return int(key.split(".")[1]) * num_stages // DEPTH
    return 0 if key.startswith("embed.") else num_stages - 1


def stage_keys(keys, stage: int, num_stages: int, with_aliases: bool):
    """A stage's state-dict keys; the alias only where the stage holds it (loading), never saved."""
    return [k for k in keys if stage_of(k, num_stages) == stage and (with_aliases or k not in ALIASES)]


def pack(value) -> bytes:  # tensors go back to the test process as bytes (no shared-memory handles)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A plain run's checkpoint after 3 steps, and the optimizer layout by parameter name."""
    root = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(0)
    trainer = fit(3)
    trainer.save_checkpoint(root / "plain.ckpt")
    module = trainer.lightning_module
    layout = [group_names(opt, parameter_names(module)) for opt in trainer.optimizers]
    return root, torch.load(root / "plain.ckpt", weights_only=False), layout


# -- ranks --------------------------------------------------------------------------------------
def _save_part(path, checkpoint, layout, stage, num_stages, expected=True):
    keys = list(checkpoint["state_dict"])
    mine = stage_keys(keys, stage, num_stages, with_aliases=False)
    names = [n for group in layout[0] for n in group]
    state = {names[i]: s for i, s in checkpoint["optimizer_states"][0]["state"].items() if names[i] in mine}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in checkpoint["optimizer_states"][0]["param_groups"]]
    metadata = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    save_sharded(path, {k: checkpoint["state_dict"][k] for k in mine}, [{"state": state, "groups": groups}], layout,
                 metadata if stage == 0 else None, aliases=ALIASES, expected_keys=keys if expected else None)


def _outcome(call):
    try:
        call()
        return ("ok", "")
    except Exception as error:
        return (type(error).__name__, str(error))


def _save_on_2(rank, world_size, root, checkpoint, layout):
    _save_part(root / "two", checkpoint, layout, rank, 2)
    before = {f: (root / "two" / f).read_bytes() for f in os.listdir(root / "two")}
    outcomes = {
        "file": _outcome(lambda: _save_part(root / "blocked.ckpt", checkpoint, layout, rank, 2)),
        "forgotten": _outcome(lambda: save_sharded(
            root / "two", {k: v for k, v in checkpoint["state_dict"].items() if stage_of(k, 2) == rank and
                           k != "body.3.bias"}, expected_keys=list(checkpoint["state_dict"]), aliases=ALIASES)),
    }
    unchanged = before == {f: (root / "two" / f).read_bytes() for f in os.listdir(root / "two")}
    return outcomes, unchanged


def _load_stage(path, checkpoint, layout, stage, num_stages, net=None, optimizers=1, templates=None):
    """What stage ``stage`` of ``num_stages`` loads: its keys (the tied head too) and its parameters' state."""
    state = (net or Net()).state_dict()
    keys = stage_keys(list(state), stage, num_stages, with_aliases=True)
    templates = {} if templates is None else templates
    templates.update((k, torch.full_like(state[k], 7.0)) for k in keys)
    names = list(dict.fromkeys(ALIASES.get(k, k) for k in keys))
    loaded = load_sharded(path, templates, [names] * optimizers, layouts=layout * optimizers, expected_keys=list(state))
    return loaded, templates


def _load_on_3(rank, world_size, root, checkpoint, layout):
    loaded, _ = _load_stage(root / "two", checkpoint, layout, rank, 3)
    cases = {"deeper": dict(net=Net(depth=DEPTH + 1)), "wider": dict(net=Net(width=6)),
             "shard": dict(path=root / "no_shard"), "optimizers": dict(optimizers=2)}
    outcomes, untouched = {}, True
    for name, case in cases.items():
        templates = {}
        outcomes[name] = _outcome(lambda: _load_stage(case.pop("path", root / "two"), checkpoint, layout, rank, 3,
                                                      templates=templates, **case))
        untouched &= bool(templates) and all(bool((t == 7.0).all()) for t in templates.values())
    return pack(loaded), outcomes, untouched


def _save_pp2_dp2(rank, world_size, path, checkpoint, layout):
    _save_part(path, checkpoint, layout, rank // 2, 2)


# -- tests --------------------------------------------------------------------------------------
def assert_same(a, b, where="") -> None:
    """Nested dicts, lists and tuples with equal tensors and equal everything else."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def assert_loaded(loaded, checkpoint, layout):
    for key, value in loaded["state_dict"].items():
        assert torch.equal(value, checkpoint["state_dict"][key]), key
    full = checkpoint["optimizer_states"][0]
    names = [n for group in layout[0] for n in group]
    (optimizer,) = loaded["optimizer_states"]
    assert optimizer["param_groups"][0]["params"] == layout[0][0]
    assert optimizer["param_groups"][1]["lr"] == full["param_groups"][1]["lr"]
    for name, state in optimizer["state"].items():
        for k, v in state.items():
            assert torch.equal(v, full["state"][names.index(name)][k]), (name, k)
    assert loaded["global_step"] == checkpoint["global_step"] and loaded["loops"] == checkpoint["loops"]


def test_two_stages_save_and_three_stages_and_one_process_load_the_same_tensors(plain):
    root, checkpoint, layout = plain
    (root / "blocked.ckpt").write_text("a file in the way")
    saves = distributed.run(_save_on_2, 2, root, checkpoint, layout, timeout=120)
    assert sorted(os.listdir(root / "two")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", "pipe.json"]
    for outcomes, unchanged in saves:  # refused on every rank, before anything was written
        assert unchanged and (root / "blocked.ckpt").read_text() == "a file in the way"
        assert outcomes["file"][0] == "CheckpointMismatchError" and "is a file" in outcomes["file"][1]
        assert outcomes["forgotten"][0] == "CheckpointMismatchError"
        assert "no rank saves `body.3.bias`" in outcomes["forgotten"][1]

    shutil.copytree(root / "two", root / "no_shard")
    (root / "no_shard" / "__1_0.distcp").unlink()
    results = distributed.run(_load_on_3, 3, root, checkpoint, layout, timeout=120)
    held = set()
    for rank, (loaded, outcomes, untouched) in enumerate(results):
        loaded = torch.load(io.BytesIO(loaded), weights_only=False)
        assert_loaded(loaded, checkpoint, layout)
        held |= set(loaded["state_dict"])
        assert untouched
        assert outcomes["deeper"][0] == "CheckpointMismatchError" and "missing `body.4.weight`" in outcomes["deeper"][1]
        assert outcomes["wider"][0] == "CheckpointMismatchError"
        assert "`body.0.weight`: checkpoint (4, 4), model (6, 6)" in outcomes["wider"][1]
        assert outcomes["shard"][0] == "MissingShardError" and "__1_0.distcp` is missing" in outcomes["shard"][1]
        assert "the model has 2 optimizers but the checkpoint 1" in outcomes["optimizers"][1]
    assert held == set(checkpoint["state_dict"])  # the last stage read the tied head from its own entry

    # one process, no process group: everything, and a plain optimizer takes its state
    loaded, _ = _load_stage(root / "two", checkpoint, layout, 0, 1)
    assert_loaded(loaded, checkpoint, layout)
    net = Net()
    optimizer = net.configure_optimizers()
    optimizer.load_state_dict(localize_optimizer(loaded["optimizer_states"][0], layout[0], optimizer,
                                                 parameter_names(net)))
    assert_same(optimizer.state_dict(), checkpoint["optimizer_states"][0])


def test_replicas_write_each_entry_once(plain, tmp_path):
    root, checkpoint, layout = plain
    distributed.run(_save_pp2_dp2, 4, tmp_path / "pp2dp2", checkpoint, layout, timeout=120)
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(tmp_path / "pp2dp2").read_metadata()
    sizes = {f: os.path.getsize(tmp_path / "pp2dp2" / f) for f in os.listdir(tmp_path / "pp2dp2") if f.endswith(".distcp")}
    assert sum(sizes.values()) == sum(info.length for info in metadata.storage_data.values())  # no copy twice
    assert len(sizes) == 4 and all(sizes.values())  # and the replicas share the writing
    assert {i.fqn for i in metadata.storage_data} == set(metadata.state_dict_metadata)
    tensors = [m for m in metadata.state_dict_metadata.values() if hasattr(m, "size")]
    assert sum(m.size.numel() * m.properties.dtype.itemsize for m in tensors) <= sum(sizes.values())
    loaded, _ = _load_stage(tmp_path / "pp2dp2", checkpoint, layout, 0, 1)
    assert_loaded(loaded, checkpoint, layout)


def test_consolidation_gives_the_plain_checkpoint_back_and_lightning_resumes_from_it(plain, tmp_path):
    root, checkpoint, layout = plain
    if not (root / "two" / INDEX).exists():
        distributed.run(_save_on_2, 2, root, checkpoint, layout, timeout=120)
    assert main([str(root / "two"), str(tmp_path / "ours.ckpt")]) == 0
    ours = torch.load(tmp_path / "ours.ckpt", weights_only=False)
    assert list(ours["state_dict"]) == list(checkpoint["state_dict"])  # every key, in the model's order
    assert ours["state_dict"]["head.weight"].data_ptr() == ours["state_dict"]["embed.weight"].data_ptr()  # once
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    assert_same(ours["optimizer_states"], checkpoint["optimizer_states"])  # numbered as a plain run
    assert {k: v for k, v in ours.items() if k not in ("state_dict", "optimizer_states")} == \
        {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    assert main([str(root / "two"), str(tmp_path / "ours.ckpt")]) == 1  # never overwrites

    # Lightning's own command reads the same directory (parameter names as optimizer keys)
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    theirs = _format_checkpoint(_load_distributed_checkpoint(root / "two"))
    torch.save(theirs, tmp_path / "theirs.ckpt")
    (named,) = theirs["optimizer_states"]
    assert_same(numbered(named["state"], named["param_groups"]), checkpoint["optimizer_states"][0])
    for path in (tmp_path / "ours.ckpt", tmp_path / "theirs.ckpt"):
        net = Net.load_from_checkpoint(path)
        assert torch.equal(net.body[2].weight, checkpoint["state_dict"]["body.2.weight"])
        resumed = fit(5, ckpt_path=path)
        assert resumed.global_step == 5


def test_a_missing_directory_and_an_incomplete_save_are_named(tmp_path):
    with pytest.raises(MissingShardError, match="there is no checkpoint at"):
        load_sharded(tmp_path / "nothing", {})
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "meta.pt").write_bytes(b"")
    with pytest.raises(CheckpointMismatchError, match=r"not a complete sharded checkpoint: it has no `\.metadata`"):
        consolidate(tmp_path / "half")


def test_strict_false_loads_the_keys_both_have_and_a_truncated_shard_is_named(plain, tmp_path):
    root, checkpoint, layout = plain
    if not (root / "two" / INDEX).exists():
        distributed.run(_save_on_2, 2, root, checkpoint, layout, timeout=120)
    deeper = Net(depth=DEPTH + 1).state_dict()
    templates = {k: torch.full_like(v, 7.0) for k, v in deeper.items()}
    load_sharded(root / "two", templates, expected_keys=list(deeper), strict=False)
    assert torch.equal(templates["body.3.weight"], checkpoint["state_dict"]["body.3.weight"])
    assert (templates["body.4.weight"] == 7.0).all()  # not in the checkpoint: left as it was

    shutil.copytree(root / "two", tmp_path / "cut")
    shard = tmp_path / "cut" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(MissingShardError, match=r"__0_0.distcp` is truncated \(100 bytes"):
        load_sharded(tmp_path / "cut", {"body.0.weight": torch.zeros(4, 4)})


def test_current_weights_beside_averaged_ones_are_sharded_read_back_and_consolidated(tmp_path):
    """A weight averaging callback's checkpoint: ``state_dict`` holds the averages, ``current_model_state`` the
    current weights (refused with sharded checkpoints before); both ways of consolidating give both back."""
    averaged = {"w": torch.ones(2, 3), "tied": torch.zeros(3), "b": torch.full((3,), 2.0)}
    current = {k: v + 10 for k, v in averaged.items()}
    save_sharded(tmp_path / "ckpt", averaged, metadata={"averaging_state": {"n_averaged": torch.tensor(3)}},
                 aliases={"also_w": "w"}, expected_keys=["w", "tied", "b", "also_w"], current_state=current)
    templates = {k: torch.zeros_like(v) for k, v in averaged.items()}
    loaded = load_sharded(tmp_path / "ckpt", {"w": templates["w"], "b": templates["b"]}, strict=False)
    assert torch.equal(templates["w"], averaged["w"]) and set(loaded["current_model_state"]) == {"w", "b"}
    assert torch.equal(loaded["current_model_state"]["b"], current["b"])
    assert loaded["current_model_state"]["w"].data_ptr() != templates["w"].data_ptr()  # new tensors, not the model's

    ours = consolidate(tmp_path / "ckpt")
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    theirs = _format_checkpoint(_load_distributed_checkpoint(tmp_path / "ckpt"))
    for whole in (ours, theirs):
        assert set(whole["current_model_state"]) == {"w", "tied", "b", "also_w"}
        for key, value in {**current, "also_w": current["w"]}.items():
            assert torch.equal(whole["current_model_state"][key], value), key
        assert torch.equal(whole["state_dict"]["also_w"], averaged["w"])
    assert ours["current_model_state"]["also_w"].data_ptr() == ours["current_model_state"]["w"].data_ptr()  # once

    with pytest.raises(CheckpointMismatchError, match=r"the averaged weights hold keys the current ones lack: `b`"):
        save_sharded(tmp_path / "bad", averaged, current_state={"w": current["w"]})
    # a checkpoint hook deleted an averaged entry (a frozen weight), as it may under DDP: the current ones keep it
    save_sharded(tmp_path / "filtered", {"w": averaged["w"]}, current_state=current)
    assert set(consolidate(tmp_path / "filtered")["current_model_state"]) == set(current)
    # ... or the first key of a tied weight, whose other key the averaged entries then hold (regression, review N:
    # the current ones lacked it, and every save with a weight averaging callback was refused)
    save_sharded(tmp_path / "tied", {"also_w": averaged["w"]}, aliases={"also_w": "w"}, current_state=current)
    assert set(consolidate(tmp_path / "tied")["current_model_state"]) == set(current) | {"also_w"}


def _kept_by_hooks(rank, world_size):
    from types import SimpleNamespace

    from lightning_pipe.lightning.state import Checkpoints, HookState

    split = SimpleNamespace(key_order=["a", "b", "c", "d", "d_alias"], key_aliases={"d_alias": "d"})
    given = HookState({k: None for k in [["a", "b"], ["c", "d"]][rank]}, split.key_order)  # this rank's keys
    checkpoints = SimpleNamespace(given=given, before_hooks=dict(given), split=split)
    for name in ("b", "d"):  # a hook deleting the frozen ones by name, on every rank (as under DDP)
        del given[name]
    with pytest.raises(KeyError):
        del given["e"]  # not a key of the model: as in a dict
    kept = Checkpoints._kept_by_hooks(checkpoints, given)
    # after fit the whole model is back in every process, and the hooks were given all of it
    checkpoints.given, checkpoints.before_hooks = None, {}
    after_fit = Checkpoints._kept_by_hooks(checkpoints, {"a": None, "c": None, "d_alias": None})
    return kept, after_fit, checkpoints.given, sorted(given)


def test_a_sharded_save_expects_the_keys_no_checkpoint_hook_deleted_on_any_rank():
    """Regression: a "keep the trainable weights" on_save_checkpoint made the sharded save refuse the checkpoint
    (no rank saves `b`, `d`). The keys deleted on any rank are left out on every rank. And deleting a key of the
    model that another rank holds raised KeyError. Review (this stop): the alias of a deleted tied key was left out
    too, where one process's state dict keeps it; and a save after fit, whose hooks got the whole model, expected
    the keys they deleted (CheckpointMismatchError: no rank saves them)."""
    expected = (["a", "c", "d_alias"], ["a", "c", "d_alias"], None)
    assert distributed.run(_kept_by_hooks, 2) == [(*expected, ["a"]), (*expected, ["c"])]


def test_the_state_dict_the_checkpoint_hooks_get_is_written_as_a_plain_dict(tmp_path):
    """Regression: a weight averaging callback moved it to `current_model_state`, where nothing made it plain
    again: the file did not load (HookState.__init__() missing arguments)."""
    import copy
    from collections import OrderedDict

    from lightning_pipe.lightning.state import HookState

    given = HookState({"a": torch.ones(1)}, ["a", "b"])
    torch.save({"current_model_state": given}, tmp_path / "x.ckpt")
    loaded = torch.load(tmp_path / "x.ckpt", weights_only=True)["current_model_state"]
    assert type(loaded) is OrderedDict and list(loaded) == ["a"]
    assert type(copy.deepcopy(given)) is OrderedDict
