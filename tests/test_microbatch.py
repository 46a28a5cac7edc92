"""Splitting batches into microbatches and merging outputs back."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import NoChunk
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.microbatch import batch_size_of, gather, microbatch_sizes, scatter


def test_scatter_nested_pytree_keeps_structure_and_slices_every_tensor():
    x = torch.arange(8.0).view(4, 2)
    index = torch.arange(4)
    inputs = {"x": x, "rest": [index, ("tag", 7, index * 10)]}
    parts = scatter(inputs, chunks=2)
    assert len(parts) == 2
    for i, part in enumerate(parts):
        assert set(part) == {"x", "rest"}
        assert isinstance(part["rest"], list) and isinstance(part["rest"][1], tuple)
        torch.testing.assert_close(part["x"], x[2 * i : 2 * i + 2])
        torch.testing.assert_close(part["rest"][0], index[2 * i : 2 * i + 2])
        assert part["rest"][1][:2] == ("tag", 7)
        torch.testing.assert_close(part["rest"][1][2], index[2 * i : 2 * i + 2] * 10)


def test_scatter_tuple_inputs_give_tuples():
    parts = scatter((torch.zeros(6, 3), torch.ones(6)), chunks=3)
    assert [type(p) for p in parts] == [tuple] * 3
    assert [(p[0].shape, p[1].shape) for p in parts] == [(torch.Size([2, 3]), torch.Size([2]))] * 3


def test_scatter_uneven_batch_gives_larger_microbatches_first():
    parts = scatter(torch.arange(10), chunks=4)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert microbatch_sizes(10, 4) == [3, 3, 2, 2]


def test_scatter_batch_smaller_than_chunks_gives_one_microbatch_per_sample():
    parts = scatter((torch.arange(3), "tag"), chunks=8)
    assert [p[0].tolist() for p in parts] == [[0], [1], [2]]
    assert [p[1] for p in parts] == ["tag"] * 3
    assert microbatch_sizes(3, 8) == [1, 1, 1]


@pytest.mark.parametrize("batch", range(1, 13))
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5, 8])
def test_microbatch_sizes_match_scatter(batch, chunks):
    sizes = [len(p) for p in scatter(torch.zeros(batch), chunks)]
    assert microbatch_sizes(batch, chunks) == sizes
    assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1


def test_no_chunk_tensor_goes_whole_to_every_microbatch():
    mask = torch.arange(3.0)
    parts = scatter((torch.zeros(4, 2), NoChunk(mask)), chunks=2)
    assert all(p[1] is mask for p in parts)
    assert [p[0].shape for p in parts] == [torch.Size([2, 2])] * 2


def test_no_chunk_allows_a_tensor_with_another_batch_size():
    parts = scatter({"x": torch.zeros(4, 2), "table": NoChunk(torch.zeros(7, 2))}, chunks=4)
    assert [p["table"].shape for p in parts] == [torch.Size([7, 2])] * 4


def test_no_chunk_rejects_non_tensors():
    with pytest.raises(TypeError, match="NoChunk wraps a tensor, got list"):
        NoChunk([1, 2])


def test_non_tensor_leaves_and_scalars_are_duplicated():
    scalar = torch.tensor(5.0)
    parts = scatter((torch.zeros(4), None, 3.5, "s", scalar), chunks=2)
    for part in parts:
        assert part[1:4] == (None, 3.5, "s")
        assert part[4].item() == 5.0
    assert parts[0][4] is scalar and parts[1][4] is not scalar  # the others get copies (see the next test)


def test_a_write_into_a_0_dim_tensor_is_made_once_per_microbatch_on_the_value_one_process_would_write_into():
    """Regression: every microbatch got the same 0-dim tensor, so a stage's ``scale.mul_(0.5)`` compounded:
    microbatch i read 0.5 ** (i + 1) of it where one process reads half of it for every sample."""
    scale = torch.tensor(2.0)
    parts = scatter((torch.ones(4), scale), chunks=4)
    assert [part[1].mul_(0.5).item() for part in parts] == [1.0, 1.0, 1.0, 1.0]
    assert scale.item() == 1.0  # written once, as by one process (the first microbatch's is the batch's own)
    leaf = torch.tensor(2.0, requires_grad=True)  # its gradient flows back: the same tensor in every microbatch
    assert all(part[1] is leaf for part in scatter((torch.ones(4), leaf), chunks=2))


def test_scatter_along_batch_dim_1():
    x = torch.arange(12.0).view(2, 6)
    parts = scatter((x, torch.zeros(3, 6)), chunks=4, batch_dim=1)
    assert [p[0].shape for p in parts] == [torch.Size([2, 2])] * 2 + [torch.Size([2, 1])] * 2
    assert [p[1].shape[1] for p in parts] == [2, 2, 1, 1]
    torch.testing.assert_close(parts[0][0], x[:, :2])
    torch.testing.assert_close(gather([p[0] for p in parts], batch_dim=1), x)


def test_batch_dim_beyond_a_tensors_dimensions_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="batch_dim"):
        scatter((torch.zeros(3, 4), torch.zeros(4)), chunks=2, batch_dim=1)


def test_mismatched_batch_sizes_name_the_shapes_and_the_fix():
    with pytest.raises(
        ConfigurationError,
        match=r"the inputs disagree on the batch size along batch_dim=0: shapes \[\(4, 2\), \(5,\)\]; "
              r"wrap tensors that are not batched in NoChunk, or set batch_dim",
    ):
        scatter((torch.zeros(4, 2), torch.zeros(5)), chunks=2)


def test_mismatched_batch_sizes_along_batch_dim_1():
    with pytest.raises(ConfigurationError, match=r"disagree on the batch size along batch_dim=1"):
        scatter((torch.zeros(2, 4), torch.zeros(2, 5)), chunks=2, batch_dim=1)


@pytest.mark.parametrize("inputs", [("a", 3), (NoChunk(torch.zeros(4)),), (torch.tensor(1.0),), {}])
def test_inputs_without_a_batched_tensor_are_rejected(inputs):
    with pytest.raises(ConfigurationError, match="the inputs hold no tensor with a batch dimension to split into microbatches"):
        scatter(inputs, chunks=2)
    with pytest.raises(ConfigurationError, match="hold no tensor with a batch dimension"):
        batch_size_of(inputs)


@pytest.mark.parametrize("chunks", [0, -1, 2.0, None])
def test_chunks_must_be_a_positive_integer(chunks):
    with pytest.raises(ConfigurationError, match=r"chunks \(the number of microbatches\) must be a positive integer, got "):
        scatter(torch.zeros(4), chunks)


def test_chunks_true_is_rejected_like_in_pipeline():
    with pytest.raises(ConfigurationError, match=r"must be a positive integer, got True"):
        scatter(torch.zeros(4), True)


def test_configuration_errors_are_value_errors():
    with pytest.raises(ValueError):
        scatter(torch.zeros(4), 0)


def test_gather_round_trips_nested_outputs():
    x = torch.randn(10, 3)
    inputs = {"x": x, "pair": (x.sum(1), "name")}
    parts = scatter(inputs, chunks=4)
    merged = gather(parts)
    torch.testing.assert_close(merged["x"], x)
    torch.testing.assert_close(merged["pair"][0], x.sum(1))
    assert merged["pair"][1] == "name"


def test_gather_stacks_zero_dim_tensors_and_keeps_first_non_tensor():
    merged = gather([(torch.tensor(1.0), "a"), (torch.tensor(2.0), "b")])
    torch.testing.assert_close(merged[0], torch.tensor([1.0, 2.0]))
    assert merged[1] == "a"


def test_gather_concatenates_per_sample_lists_and_refuses_outputs_of_another_structure():
    """Regression: per-sample strings in the last stage's output kept the first microbatch's only
    (silently, with microbatches of one size), and outputs of another structure were zipped short."""
    x = torch.arange(5)
    names = ["a0", "b1", "a2", "b3", "a4"]
    parts = scatter((x, names, ("s0", "s1", "s2", "s3", "s4"), "tag"), chunks=2)  # sizes 3 and 2
    merged = gather(parts)
    assert merged[0].tolist() == x.tolist() and merged[1] == names and merged[2] == ("s0", "s1", "s2", "s3", "s4")
    assert merged[3] == "tag"
    even = gather([(torch.zeros(2), ["a", "b"]), (torch.ones(2), ["c", "d"])])  # one size: still per sample
    assert even[1] == ["a", "b", "c", "d"]
    with pytest.raises(ConfigurationError, match="outputs of microbatches 0 and 1 differ in structure"):
        gather([{"x": torch.zeros(2)}, {"x": torch.zeros(2), "y": torch.zeros(2)}])


def test_each_microbatch_counts_its_own_writes_into_the_memory_it_shares_with_the_batch():
    batch = torch.zeros(4, 2)
    first, second = (part[0] for part in scatter((batch,), chunks=2))
    first.add_(1)
    assert (first._version, second._version) == (1, 0)  # autograd sees no write into the second's samples
    assert batch[:2].eq(1).all() and batch[2:].eq(0).all()  # the batch's memory, written once

    leaf = torch.zeros(4, 2, requires_grad=True)  # its gradient flows back through views of it
    parts = [part[0] for part in scatter((leaf,), chunks=2)]
    assert all(part._base is leaf for part in parts)


def test_tensors_of_a_batch_that_share_memory_keep_views_that_see_each_others_writes():
    """A slice counts its own writes only where no other tensor of the batch shares its memory: autograd must
    see a write into the labels as a write into the inputs they overlap, as it does for one process."""
    tokens = torch.arange(24.0).reshape(4, 6)
    first = scatter(({"inputs": tokens[:, :-1], "labels": tokens[:, 1:]},), chunks=2)[0][0]
    first["labels"].add_(1)
    assert first["inputs"]._version == 1
    same = torch.zeros(4, 2)
    first = scatter(({"ids": same, "labels": same},), chunks=2)[0][0]
    first["labels"].add_(1)
    assert first["ids"]._version == 1


def test_slices_whose_rows_overlap_in_memory_keep_views():
    """An expanded or unfolded tensor's rows share memory: its slices must see each other's writes, as one
    process's autograd does (a counter per microbatch would hide them)."""
    positions = torch.arange(6.0).expand(4, 6)  # stride 0 along the batch
    windows = torch.arange(10.0).unfold(0, 4, 2)  # overlapping windows
    plain = torch.zeros(4, 6)[:, 1:]  # not contiguous, but its rows are apart
    for tensor, shares in ((positions, True), (windows, True), (plain, False)):
        parts = [part[0] for part in scatter((tensor,), chunks=2)]
        assert (parts[0]._base is not None) == shares


def test_a_tensor_subclass_keeps_its_views_and_its_memory_is_not_read():
    class Marked(torch.Tensor):
        def untyped_storage(self):  # as a wrapper subclass (DTensor), whose storage cannot be read
            raise RuntimeError("Attempted to access the data pointer on an invalid python storage")

    marked = torch.zeros(4, 2).as_subclass(Marked)
    parts = scatter((marked, torch.zeros(4)), chunks=2)
    assert all(type(part[0]) is Marked for part in parts)


def _split_twice(monkeypatch, inputs, chunks, batch_dim=0):
    """``inputs`` split by scatter's path for plain batches, then by its general path (plain_tensors off)."""
    from lightning_pipe import microbatch

    made_fast, made_general = [], []
    fast = scatter(inputs, chunks, batch_dim, made_fast)
    size = batch_size_of(inputs, batch_dim)
    with monkeypatch.context() as patched:
        patched.setattr(microbatch, "plain_tensors", lambda tree: None)
        general = scatter(inputs, chunks, batch_dim, made_general)
        assert batch_size_of(inputs, batch_dim) == size
    return fast, general, made_fast, made_general


def _shape_of(tree):
    """Containers (their types, keys, lengths) with each tensor's shape, whether it has its own version counter
    (not a view) and its values."""
    if isinstance(tree, torch.Tensor):
        return "tensor", tuple(tree.shape), tree._base is None, tree.tolist()
    if isinstance(tree, dict):
        return type(tree), [(key, _shape_of(value)) for key, value in tree.items()]
    if isinstance(tree, (list, tuple)):
        return type(tree), [_shape_of(item) for item in tree]
    return tree


@pytest.mark.parametrize("batch_dim", [0, 1])
def test_plain_batches_split_without_pytree_as_the_general_path_splits_them(monkeypatch, batch_dim):
    """The fast path for tuples, lists and dicts of tensors gives what the pytree path gives: structure, values,
    which slices count their own writes, the same slices for a tensor given twice, the versions noted."""
    x = torch.arange(40.0).reshape(5, 8) if batch_dim == 0 else torch.arange(40.0).reshape(8, 5)
    shift = torch.arange(30.0).reshape(6, 5)
    leaf = torch.zeros(5, 5, requires_grad=True)
    batches = [
        ((x, x * 2),),
        ({"ids": x, "pair": (x, None), "rest": [x + 1]},),
        (({"inputs": shift[:-1], "labels": shift[1:]},), ({"inputs": shift[:-1]},)) if batch_dim == 1 else
        (({"inputs": shift[:, :-1], "labels": shift[:, 1:]},), (shift[:, :-1],)),
        ((x,), (x,)),  # one tensor as inputs and labels
        (leaf if batch_dim == 0 else leaf.t(), x),
        [x, (), {}],
    ]
    for inputs in batches:
        fast, general, made_fast, made_general = _split_twice(monkeypatch, inputs, 3, batch_dim)
        assert [_shape_of(part) for part in fast] == [_shape_of(part) for part in general]
        assert len(made_fast) == len(made_general)
    fast = _split_twice(monkeypatch, ((x,), (x,)), 2, batch_dim)[0]
    assert all(part[0][0] is part[1][0] for part in fast)


def test_batches_the_fast_path_leaves_to_pytree_are_split_there():
    """Anything but plain containers of tensors with a batch dimension goes the general way (and its errors)."""
    from collections import namedtuple

    from lightning_pipe.microbatch import plain_tensors

    x = torch.zeros(4, 2)
    pair = namedtuple("Pair", "a b")
    for inputs in ((x, "tag"), (x, torch.tensor(1.0)), [x, None], pair(x, x), (x, NoChunk(x)), (x, ["a"] * 4)):
        assert plain_tensors(inputs) is None
    assert type(scatter(pair(x, x), chunks=2)[0]) is pair
    with pytest.raises(ConfigurationError, match="disagree"):
        scatter((x, torch.zeros(3)), chunks=2)
    with pytest.raises(ConfigurationError, match="no dimension batch_dim"):
        scatter((x, torch.zeros(4)), chunks=2, batch_dim=1)
