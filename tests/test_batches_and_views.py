"""Per-sample lists in batches, dataclass and UserDict batches, containers the split cannot open, the
Sequential stand-in's view of the whole body, and buffers updated once per microbatch.

Unit tests first; then one model trained under DDP (1 device) and PipeStrategy (2 stages), in the
shared launches of ``tests/lm_app.py`` (see ``APPS`` in conftest.py): its batch is a dataclass holding a
UserDict, and carries per-sample strings that weigh the loss, with 1-sample microbatches, and
its ``configure_optimizers`` gives the layers of its ``nn.Sequential`` body decaying learning rates
over ``len``/``enumerate(self.body)`` and ``self.body[-1]`` one of its own.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import types
import warnings
from collections import OrderedDict
from collections.abc import Mapping

import pytest
import torch
from torch import nn

from lightning_pipe.errors import BodyCallError, ConfigurationError
from lightning_pipe.lightning.body import PipelinedSequential, present_whole_body
from lightning_pipe.lightning.effects import BufferWatch
from lightning_pipe.microbatch import gather, scatter


# -- scatter: per-sample lists ------------------------------------------------------------------
def test_a_list_of_per_sample_strings_is_split_with_the_tensors():
    names = ["a0", "b1", "a2", "b3", "a4"]
    parts = scatter((torch.arange(5), torch.ones(5, 2), names), chunks=2)
    assert [p[2] for p in parts] == [["a0", "b1", "a2"], ["b3", "a4"]]
    assert [p[0].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    parts = scatter({"x": torch.zeros(3), "ids": [7, 8, 9]}, chunks=8)  # one sample per microbatch
    assert [p["ids"] for p in parts] == [[7], [8], [9]]
    collated = torch.utils.data.default_collate([(torch.ones(2), f"s{i}") for i in range(3)])  # strings: a tuple
    assert [p[1] for p in scatter(collated, chunks=3)] == [("s0",), ("s1",), ("s2",)]


def test_tuples_and_lists_of_another_length_or_of_tensors_stay_as_before():
    x = torch.arange(4)
    parts = scatter((x, (1, 2, 3, 4), ["k", "l"], [x, x * 2], ["a", None, 3, torch.tensor(1.0)], ("k", "l")), chunks=2)
    for i, part in enumerate(parts):
        assert part[1] == (1, 2, 3, 4) and part[2] == ["k", "l"] and part[5] == ("k", "l")  # whole
        torch.testing.assert_close(part[3][1], (x * 2)[2 * i:2 * i + 2])  # a list of tensors: its tensors split
        assert part[4][:3] == ["a", None, 3]  # a list holding a tensor: not a per-sample list


@dataclasses.dataclass
class _Pair:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Checked:
    x: torch.Tensor
    names: list
    scale: float = 1.0
    rows: int = dataclasses.field(init=False)

    def __post_init__(self):
        self.rows = len(self.x)  # recomputed for each microbatch
        assert len(self.names) == self.rows


class _BatchEncoding(collections.UserDict):  # what Hugging Face's BatchEncoding is
    def __init__(self, data, encodings=None, n_sequences=1):
        super().__init__(data)
        self._encodings, self._n_sequences = encodings, n_sequences

    def to(self, device):  # how Lightning moves it to the device, keeping the encodings
        self.data = {k: v.to(device) for k, v in self.data.items()}
        return self


def test_a_dataclass_batch_is_split_field_by_field_and_rebuilt_by_its_own_init():
    batch = _Checked(torch.arange(10).view(5, 2), list("abcde"), scale=2.0)
    parts = scatter((batch, torch.zeros(5)), chunks=2)
    assert [type(p[0]) for p in parts] == [_Checked, _Checked]
    assert [p[0].x[:, 0].tolist() for p in parts] == [[0, 2, 4], [6, 8]]
    assert [(p[0].names, p[0].rows, p[0].scale) for p in parts] == [(list("abc"), 3, 2.0), (list("de"), 2, 2.0)]
    merged = gather([p[0] for p in parts])
    assert type(merged) is _Checked and merged.x.equal(batch.x) and merged.names == batch.names and merged.rows == 5


def test_a_user_dict_batch_keeps_its_type_and_splits_its_items_and_per_sample_attributes():
    batch = _BatchEncoding({"ids": torch.arange(5), "mask": torch.ones(5, 3)}, encodings=[f"e{i}" for i in range(5)])
    parts = scatter(batch, chunks=2)
    assert [type(p) for p in parts] == [_BatchEncoding, _BatchEncoding]
    assert [p["ids"].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert [p._encodings for p in parts] == [["e0", "e1", "e2"], ["e3", "e4"]]  # per sample: split
    assert all(p._n_sequences == 1 for p in parts) and batch["ids"].shape == (5,)  # others kept, the batch untouched
    merged = gather(parts)
    assert merged._encodings == batch._encodings and merged["ids"].equal(batch["ids"])
    batch._encodings = None  # a collator's batch: no encodings
    assert [p._encodings for p in scatter(batch, chunks=2)] == [None, None]


def test_a_hugging_face_batch_encoding_from_a_fast_tokenizer_splits_with_its_encodings():
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3, "c": 4}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]")
    batch = tokenizer(["a b", "b c a", "c", "a a a a", "b"], padding=True, return_tensors="pt")
    parts = scatter(batch, chunks=2)
    assert [type(p).__name__ for p in parts] == ["BatchEncoding"] * 2
    assert parts[1].input_ids.tolist() == [[2, 2, 2, 2], [3, 0, 0, 0]]
    assert parts[1].word_ids(0) == [0, 1, 2, 3] and parts[0].word_ids(2) == [0, None, None, None]
    collated = DataCollatorForLanguageModeling(tokenizer, mlm=False)([tokenizer(t) for t in ["a b", "b c a", "c"]])
    assert [p["labels"].tolist() for p in scatter(collated, chunks=3)] == [[[2, 3, -100]], [[3, 4, 2]], [[4, -100, -100]]]


@dataclasses.dataclass
class _Shifted:  # a __post_init__ that converts what it is given, again on a rebuild
    ids: torch.Tensor

    def __post_init__(self):
        self.ids = self.ids + 1


@dataclasses.dataclass
class _WithInitVar:
    x: torch.Tensor
    scale: dataclasses.InitVar[float]

    def __post_init__(self, scale):
        self.x = self.x * scale if scale != 1 else self.x


@dataclasses.dataclass
class _Settings:  # no tensor: nothing to split
    name: str
    sizes: tuple


def test_dataclasses_that_cannot_be_rebuilt_faithfully_are_refused_and_those_without_tensors_go_whole():
    with pytest.raises(ConfigurationError, match=r"_Shifted \(a dataclass\) whose __post_init__ changes \['ids'\]"):
        scatter(_Shifted(torch.zeros(4)), chunks=2)  # each microbatch would be shifted twice
    with pytest.raises(ConfigurationError, match=r"_WithInitVar \(a dataclass\).*raised ValueError.*InitVar"):
        scatter(_WithInitVar(torch.zeros(4), 2.0), chunks=2)
    settings = _Settings("a", (1, 2))
    parts = scatter((torch.zeros(4), settings), chunks=2)
    assert all(p[1] is settings for p in parts)


def test_user_dict_attributes_other_than_per_sample_lists_are_kept_and_odd_ones_do_not_crash():
    batch = _BatchEncoding({"ids": torch.arange(4)}, encodings=("a", "b", "c", "d"))  # a tuple: kept whole
    assert [p._encodings for p in scatter(batch, chunks=2)] == [("a", "b", "c", "d")] * 2
    odd = _BatchEncoding({})
    odd.data = "not a dict"
    parts = scatter((torch.zeros(4), odd), chunks=2)
    assert all(p[1] is odd for p in parts)


def test_the_pipelines_cached_input_signature_keeps_no_batch_alive():
    import gc
    import weakref

    from lightning_pipe.pipeline import _input_signature

    batch = _Pair(torch.zeros(4, 3), torch.zeros(4))
    signature = _input_signature((batch,), 2, 0)
    alive = weakref.ref(batch)
    del batch
    gc.collect()
    assert alive() is None and signature == _input_signature((_Pair(torch.ones(4, 3), torch.ones(4)),), 2, 0)


def test_the_pipelines_input_signature_sees_the_shapes_inside_an_opened_batch():
    from lightning_pipe.pipeline import _input_signature

    def signature(length):
        return _input_signature((_Pair(torch.zeros(4, length), torch.zeros(4)),), 2, 0)

    assert signature(3) == signature(3) and signature(3) != signature(5)


class _Mapping(Mapping):  # a Mapping that is neither a dict nor a UserDict
    def __init__(self, **items):
        self._items = items

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


@dataclasses.dataclass
class _Hidden:  # a batched tensor in a field __init__ does not take: replace() could not carry it over
    x: torch.Tensor
    mask: torch.Tensor = dataclasses.field(init=False, default=None)


def _hidden():
    batch = _Hidden(torch.zeros(4))
    batch.mask = torch.ones(4)
    return batch


def _with_tensor_attribute():
    batch = _BatchEncoding({"x": torch.zeros(4, 2)})
    batch.extra = torch.ones(4)  # neither an item nor a per-sample list
    return batch


@pytest.mark.parametrize("batch, kind", [
    (_Mapping(x=torch.zeros(4, 2)), "_Mapping (a Mapping that is not a dict)"),
    ((torch.zeros(4), _hidden()), "_Hidden (a dataclass)"),  # would go whole: refused
    (_with_tensor_attribute(), "_BatchEncoding (a Mapping that is not a dict)"),
])
def test_a_container_the_split_cannot_open_is_named_with_the_fix(batch, kind):
    with pytest.raises(ConfigurationError, match=kind.replace("(", r"\(").replace(")", r"\)")) as info:
        scatter(batch, chunks=2)
    assert "no tensor" not in str(info.value) and "collate_fn" in str(info.value)


def test_an_object_with_unbatched_tensors_is_still_given_whole():
    table = types.SimpleNamespace(x=torch.zeros(7), y=torch.zeros(7))  # batch size 4: not the batch's
    parts = scatter((torch.zeros(4), table), chunks=2)
    assert all(p[1] is table for p in parts)


# -- the nn.Sequential stand-in presents the whole body --------------------------------------------
def _stand_in(stage):
    body = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    ranges = [(0, 2), (2, 5)]
    a, b = ranges[stage]
    names = list(body._modules)
    stand_in = PipelinedSequential([OrderedDict((n, body._modules[n]) for n in names[a:b])], False, (stage,), 2)
    present_whole_body(stand_in, body)
    return body, stand_in


@pytest.mark.parametrize("stage", [0, 1])
def test_len_iteration_and_indexing_give_the_whole_body(stage):
    body, stand_in = _stand_in(stage)
    assert len(stand_in) == 5
    assert list(stand_in) == list(body) and [m for _, m in enumerate(stand_in)] == list(body)
    assert stand_in[-1] is body[4] and stand_in[0] is body[0]
    assert list(stand_in[1:3]) == [body[1], body[2]] and list(stand_in[1:3]._modules) == ["1", "2"]
    with pytest.raises(IndexError):
        stand_in[5]
    local = ["0", "1"] if stage == 0 else ["2", "3", "4"]  # state, parameters and what the pipeline runs stay local
    assert sorted({k.split(".")[0] for k in stand_in.state_dict()}) == local
    assert len(list(stand_in.parameters())) == 2 * len(local)
    x = torch.randn(3, 2)
    expected = x
    for name in local:
        expected = body._modules[name](expected)
    torch.testing.assert_close(stand_in.chunk(0)(x), expected)
    with pytest.raises(BodyCallError, match="outside the steps PipeStrategy pipelines"):
        stand_in(x)  # outside a step: not only this stage's layers


# -- buffers updated once per microbatch -------------------------------------------------------
class _Count(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return x


def _watched_model():
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(2, 2), _Count(), nn.BatchNorm1d(2), nn.Linear(2, 2))
    return model


def test_a_buffer_changed_in_the_step_gets_one_warning_naming_it():
    model = _watched_model()
    watch = BufferWatch(model)
    for step in range(2):
        snapshot = watch.before()
        for _ in range(3):  # three microbatches
            model.body(torch.randn(4, 2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            changed = watch.after(snapshot, num_microbatches=3)
        if step == 0:
            assert changed == ["body.1.n"]  # BatchNorm's running statistics left out
            assert len(caught) == 1 and "`body.1.n`" in str(caught[0].message) and "3 times per step" in str(caught[0].message)
        else:
            assert snapshot is None and changed == [] and not caught  # once


def test_no_warning_without_a_change_or_with_one_microbatch():
    model = _watched_model()
    model.body[1].forward = lambda x: x
    watch = BufferWatch(model)
    snapshot = watch.before()
    model.body(torch.randn(4, 2))
    assert watch.after(snapshot, num_microbatches=3) == []
    model = _watched_model()
    watch = BufferWatch(model)
    snapshot = watch.before()
    model.body(torch.randn(4, 2))
    assert watch.after(snapshot, num_microbatches=1) == [] and not watch.done


@pytest.mark.parametrize("checkpoint, warned", [("always", True), ("except_last", False), ("never", False)])
def test_one_microbatch_warns_where_checkpointing_recomputes_the_forward_that_changes_a_buffer(checkpoint, warned):
    """Regression (review JJ): spectral_norm under checkpoint="always" with one microbatch updated its power-iteration
    vectors twice a step, the gradients coming from the recomputed forward, without the warning (except_last does
    not recompute a step's only microbatch)."""
    model = _watched_model()
    model.pre = _Count()  # outside the body: never recomputed (review LL: it was named too)
    watch = BufferWatch(model, checkpoint=checkpoint, body="body")
    snapshot = watch.before()
    model.body(model.pre(torch.randn(4, 2)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        changed = watch.after(snapshot, num_microbatches=1)
    assert changed == (["body.1.n"] if warned else [])
    assert [str(w.message) for w in caught if "recomputes the forward" in str(w.message)] == (
        [str(caught[0].message)] if warned else [])
    if warned:
        assert "checkpoint='always'" in str(caught[0].message) and "twice per step" in str(caught[0].message)


# -- against DDP (in the shared launches) ---------------------------------------------------------
@dataclasses.dataclass
class _Batch:
    features: _BatchEncoding  # the inputs, and the names as its per-sample "encodings"
    y: torch.Tensor
    rows: int = dataclasses.field(init=False)

    def __post_init__(self):
        self.rows = len(self.y)


def _collate(samples):
    x, y, names = torch.utils.data.default_collate(samples)
    return _Batch(_BatchEncoding({"x": x}, encodings=list(names)), y)


def main(kind: str, root: str, out: str) -> None:
    """The app trained under DDP (1 device, ``kind="ddp"``) and PipeStrategy (2 stages, ``kind="pipe"``), in the
    launches of ``tests/lm_app.py``."""
    import lightning.pytorch as pl

    from lightning_pipe import PipeStrategy

    class Count(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            if self.training:
                self.n += 1
            return x

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(12, 4, generator=g)
            self.y = (self.x.sum(1) > 0).float()

        def __len__(self):
            return 12

        def __getitem__(self, i):
            return self.x[i], self.y[i], "ab"[i % 2] + str(i)

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Count(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y, names = batch.features["x"], batch.y, batch.features._encodings
            assert batch.rows == len(x)  # the microbatch's, from its own __post_init__
            if batch_idx > 0:  # from the second step on (the first is watched for writes): written, then replaced
                x = batch.features["x"] = x.mul_(0.5).clone()
            w = torch.tensor([1.0 if s.startswith("a") else 3.0 for s in names])
            logit = self.head(self.body(self.embed(x))).squeeze(-1)
            return (nn.functional.binary_cross_entropy_with_logits(logit, y, reduction="none") * w).mean()

        def configure_optimizers(self):
            n = len(self.body)
            groups = [{"params": list(b.parameters()), "lr": 0.2 * 0.5 ** (n - 1 - i)} for i, b in enumerate(self.body)
                      if not isinstance(b, nn.Tanh) and b is not self.body[-1]]
            groups.append({"params": list(self.body[-1].parameters()), "lr": 0.3})
            groups.append({"params": list(self.embed.parameters()) + list(self.head.parameters())})
            return torch.optim.SGD(groups, lr=0.1)

    pipe = kind == "pipe"
    torch.manual_seed(0)
    model = M()
    strategy = PipeStrategy(num_microbatches=4, schedule="gpipe", log_pipeline_metrics=False) if pipe else "ddp"
    trainer = pl.Trainer(accelerator="cpu", devices=2 if pipe else 1, strategy=strategy, max_epochs=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=root)
    trainer.fit(model, torch.utils.data.DataLoader(Data(), batch_size=4, collate_fn=_collate))
    if trainer.is_global_zero:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out)


def test_per_sample_strings_and_layer_wise_learning_rates_over_a_sequential_body_train_as_ddp(lm_runs):
    """A dataclass batch holding a UserDict (Hugging Face's BatchEncoding) with the per-sample names as an
    attribute trains as under DDP (they were refused). Regressions: with 1-sample microbatches each got the whole
    list of names, so the weights tensor broadcast (a different loss, silently); and ``len``/``enumerate``/``[-1]`` of the body gave the
    stage's layers only, so the learning rates of the layer-wise decay differed from DDP's. The step writes into its
    input and puts a copy in its place from the second step on: the first stage, which reads its batch fingerprint
    late, took the write for another batch (BatchMismatchError) when it looked for writes in the microbatch then."""
    ref = lm_runs("reference")[0]["test_batches_and_views_ddp"]
    got, _, output = lm_runs("world2")
    pipe = got["test_batches_and_views_pipe"]
    assert ref.keys() == pipe.keys()
    for key in ref:
        if key == "body.2.n":  # updated once per microbatch: 4 times per step, and said so
            torch.testing.assert_close(pipe[key], 4 * ref[key])
        else:
            torch.testing.assert_close(pipe[key], ref[key], msg=key)
    assert re.search(r"the buffer `body\.2\.n` changed in the training step[^\n]*4 times per step", output)
