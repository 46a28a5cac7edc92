"""Materialization of meta-device models: the same values for every split, ties kept, bad modules named."""

import copy

import pytest
import torch
from torch import nn

from lightning_pipe.init import MaterializationError, materialize, name_seed


class Rotary(nn.Module):
    """A non-persistent buffer computed from the configuration: recomputed in ``reset_parameters``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.rotary = Rotary(width)
        self.bn = nn.BatchNorm1d(width)


class LM(nn.Module):
    """Embedding tied to the head, 8 blocks, a norm outside the body."""

    def __init__(self, width: int = 8, vocab: int = 11, depth: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.head.weight = self.embed.weight


def meta_lm(**kwargs) -> LM:
    with torch.device("meta"):
        return LM(**kwargs)


def tensors(module: nn.Module) -> dict:
    return dict(module.state_dict(keep_vars=True)) | {n: b for n, b in module.named_buffers()}


def assert_same(part: dict, whole: dict) -> None:
    assert part, "nothing to compare"
    for name, value in part.items():
        assert not value.is_meta, name
        torch.testing.assert_close(value, whole[name], rtol=0, atol=0, msg=name)


def stage_of(name: str, num_stages: int, depth: int = 8) -> int:
    """Layers cut evenly; the embedding runs on stage 0, the norm and head on the last stage."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) * num_stages // depth
    return 0 if name.startswith("embed") else num_stages - 1


def test_the_whole_model_equals_every_split_into_1_2_and_4_stages():
    whole = meta_lm()
    assert materialize(whole, "cpu", seed=5)[:3] == ["embed", "layers.0.norm", "layers.0.attn"]
    reference = tensors(whole)
    assert whole.head.weight is whole.embed.weight
    for num_stages in (1, 2, 4):
        for stage in range(num_stages):
            model = meta_lm()
            torch.manual_seed(1000 + stage)  # the global random state must not matter
            materialize(model, "cpu", seed=5, include=lambda name: stage_of(name, num_stages) == stage)
            real = {n: t for n, t in tensors(model).items() if not t.is_meta}
            assert_same(real, reference)
            expected_layers = {i for i in range(8) if stage_of(f"layers.{i}", num_stages) == stage}
            assert {int(n.split(".")[1]) for n in real if n.startswith("layers.")} == expected_layers
            # the last stage holds the head, whose weight is the embedding's: that comes along, tied
            if stage == num_stages - 1:
                assert model.head.weight is model.embed.weight and "embed.weight" in real
            elif num_stages > 1:
                assert model.head.bias.is_meta


def test_layers_materialized_alone_with_their_prefix_equal_the_whole_model():
    whole = meta_lm()
    materialize(whole, "cpu", seed=3)
    template = meta_lm()
    for i in (0, 5, 7):
        layer = copy.deepcopy(template.layers[i])
        assert materialize(layer, "cpu", seed=3, prefix=f"layers.{i}")[0] == f"layers.{i}.norm"
        assert_same({f"layers.{i}.{n}": t for n, t in tensors(layer).items()}, tensors(whole))
    other = meta_lm()
    materialize(other, "cpu", seed=4)
    assert not torch.equal(other.layers[0].attn.weight, whole.layers[0].attn.weight)  # the seed matters
    assert not torch.equal(whole.layers[0].attn.weight, whole.layers[1].attn.weight)  # and the name


def test_a_module_registered_twice_gets_its_first_name_on_every_stage():
    with torch.device("meta"):
        shared = nn.Linear(4, 4)
        whole = nn.Sequential(shared, nn.Tanh(), shared)
    materialize(whole, "cpu", seed=0)
    with torch.device("meta"):
        shared = nn.Linear(4, 4)
        part = nn.Sequential(shared, nn.Tanh(), shared)
    assert materialize(part, "cpu", seed=0, include=lambda name: name == "2") == ["0"]
    assert torch.equal(part[2].weight, whole[0].weight) and part[0] is part[2]


def test_the_global_random_state_is_left_as_it_was():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    materialize(meta_lm(), "cpu", seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_name_seeds_are_stable_across_processes():
    # pinned: never Python's salted hash, and a change here would change every initial model
    assert name_seed(0, "layers.7.attn") == 9010813058026833375


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_modules_without_reset_parameters_are_refused_by_name_before_any_change():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), NoReset(), nn.MultiheadAttention(4, 2))
    with pytest.raises(MaterializationError, match=r"`1` \(NoReset\), `2` \(MultiheadAttention\).*"
                                                   r"Implement `reset_parameters\(\)`") as info:
        materialize(model, "cpu")
    assert isinstance(info.value, TypeError)
    assert all(t.is_meta for t in model.state_dict().values())  # nothing was changed
    assert materialize(model, "cpu", include=lambda name: name == "0") == ["0"]  # others need not be resettable


class Forgetful(nn.Module):
    """Computes its table in ``__init__`` only: after materialization it would be garbage."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def reset_parameters(self) -> None:
        pass


class Replacing(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.weight = embed.weight

    def reset_parameters(self) -> None:
        self.weight = nn.Parameter(torch.zeros(self.weight.shape))


def test_unwritten_buffers_and_broken_ties_are_refused_by_name():
    with torch.device("meta"):
        model = nn.Sequential(Forgetful())
    with pytest.raises(MaterializationError, match=r"uninitialized: `0.table` \(Forgetful\).*rotary"):
        materialize(model, "cpu")
    with torch.device("meta"):
        embed = nn.Embedding(3, 2)
        model = nn.Sequential(embed, Replacing(embed))
    with pytest.raises(MaterializationError, match=r"no longer shared: `0.weight` = `1.weight`"):
        materialize(model, "cpu")


def test_integer_buffers_are_zeroed_and_batchnorm_is_reset():
    with torch.device("meta"):
        model = nn.Sequential(nn.BatchNorm1d(3))
    materialize(model, "cpu")
    assert model[0].num_batches_tracked.item() == 0 and torch.equal(model[0].running_var, torch.ones(3))


def test_a_hugging_face_model_is_initialized_by_its_own_init_weights_per_part_as_whole():
    """Llama's RMSNorm and rotary embedding have no reset_parameters (refused before); inside a Hugging Face
    model its _init_weights initializes every module, as transformers does: normal weights of the config's
    initializer_range, norms of ones, the rotary table computed. A stage materialized alone equals the whole."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                      initializer_range=0.05)

    def meta():
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config)

    whole = meta()
    materialize(whole, "cpu", seed=3)
    eager = transformers.LlamaForCausalLM(config)
    torch.testing.assert_close(whole.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)
    assert torch.equal(whole.model.norm.weight, torch.ones(32))
    weights = torch.cat([p.reshape(-1) for n, p in whole.named_parameters() if n.endswith("proj.weight")])
    assert abs(weights.std().item() - 0.05) < 0.002 and whole.lm_head.weight is whole.model.embed_tokens.weight
    part = meta()
    materialize(part, "cpu", seed=3, include=lambda name: name.startswith("model.layers.2"))
    for name, tensor in part.model.layers[2].state_dict().items():
        assert torch.equal(tensor, whole.model.layers[2].state_dict()[name]), name
    assert part.model.layers[1].mlp.up_proj.weight.is_meta

    class Adapter(nn.Module):  # a user's module Hugging Face's _init_weights does not know
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(32))

    with torch.device("meta"):
        adapted = transformers.LlamaForCausalLM(config)
        adapted.model.layers[0].adapter = Adapter()
    with pytest.raises(MaterializationError, match=r"`model.layers.0.adapter.scale` \(Adapter\).*_init_weights"):
        materialize(adapted, "cpu", seed=3)

    class Positions(nn.Module):  # an integer buffer computed in __init__ only (transformers 4.x's position ids)
        def __init__(self):
            super().__init__()
            self.register_buffer("ids", torch.arange(8), persistent=False)

    with torch.device("meta"):
        counted = transformers.LlamaForCausalLM(config)
        counted.model.positions = Positions()
    with pytest.raises(MaterializationError, match=r"`model.positions.ids` \(Positions\)"):
        materialize(counted, "cpu", seed=3)  # left unwritten: refused, not zeros


def test_hugging_face_init_weights_also_runs_on_modules_that_set_their_childrens_weights():
    """GPT-2's _init_weights of an attention or MLP module (which holds no tensor itself) rescales its output
    projection to initializer_range / sqrt(2 n_layer) (regression: only tensor holders were initialized, so these
    kept 0.02); a layer materialized alone still equals the whole model's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=64, n_layer=8, n_head=4, n_positions=32)

    def meta():
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(config)

    whole = meta()
    materialize(whole, "cpu", seed=2)
    expected = 0.02 / (2 * 8) ** 0.5
    projections = torch.cat([b.attn.c_proj.weight.reshape(-1) for b in whole.transformer.h])
    assert abs(projections.std().item() - expected) < 0.1 * expected
    assert abs(whole.transformer.h[0].attn.c_attn.weight.std().item() - 0.02) < 0.002
    part = meta()
    materialize(part, "cpu", seed=2, include=lambda name: name.startswith("transformer.h.5"))
    for name, tensor in part.transformer.h[5].state_dict().items():
        assert torch.equal(tensor, whole.transformer.h[5].state_dict()[name]), name


def test_weights_loaded_into_a_model_built_on_the_meta_device_are_refused_not_lost():
    """configure_model() builds on the meta device under PipeStrategy, where copying pretrained weights into the
    module is a no-op that materialization would overwrite (under DDP the same code loads them): refused by name.
    assign=True puts the real tensors in place, which materialization keeps."""
    from lightning_pipe import PipeStrategy

    pretrained = nn.Linear(2, 2).state_dict()
    with PipeStrategy().model_sharded_context():
        layer = nn.Linear(2, 2)
        assert layer.weight.is_meta
        with pytest.raises(RuntimeError, match=r"built on the meta device.*Load pretrained weights in on_fit_start"), \
                pytest.warns(UserWarning, match="meta parameter"):  # torch's own warning, easily missed in a job's log
            layer.load_state_dict(pretrained)
        with pytest.raises(MaterializationError, match="built on the meta device"), torch.no_grad():
            layer.bias[:] = pretrained["bias"]
        layer.load_state_dict(pretrained, assign=True)
        meta_copy = nn.Linear(2, 2)
        meta_copy.load_state_dict(nn.Linear(2, 2, device="meta").state_dict())  # meta into meta: nothing lost
    assert materialize(layer, "cpu") == [] and torch.equal(layer.weight, pretrained["weight"])
