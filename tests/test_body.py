"""The body stand-ins in one process: what the user's loop sees, and the calls they refuse."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn

from lightning_pipe import BodyCallError, ConfigurationError
from lightning_pipe.lightning.body import BodyReached, PipelinedSequential
from lightning_pipe.lightning.layer_list import CallChannel, HiddenStandIn, PipelinedLayerList, join_call, split_call


class Block(nn.Module):
    def __init__(self, returns_tuple: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.returns_tuple = returns_tuple
        self.kind = "full_attention"

    def forward(self, x, scale=None, mask=None, flag=True):
        y = torch.tanh(self.linear(x)) * (scale if scale is not None else 1) + (mask.sum() if mask is not None else 0)
        return (y, None) if self.returns_tuple else y


def stand_in(start=0, stop=2, blocks=None, num_stages=2, stage_index=0):
    blocks = blocks or [Block() for _ in range(4)]
    return PipelinedLayerList(blocks, [(start, stop)], (stage_index,), num_stages, CallChannel(None)), blocks


def test_split_and_join_restore_the_call():
    mask, scale = torch.ones(2), torch.tensor(2.0)
    structure, tensors = split_call((scale,), {"mask": mask, "cos_sin": (mask, scale), "flag": False, "cache": None})
    assert len(tensors) == 2 and tensors[0] is scale and tensors[1] is mask
    args, kwargs = join_call(structure, tensors)
    assert args[0] is scale and kwargs["mask"] is mask and kwargs["cos_sin"] == (mask, scale)
    assert kwargs["flag"] is False and kwargs["cache"] is None


def test_the_stand_ins_are_the_containers_they_replace_and_refuse_changes_of_their_layers():
    """Regression (review III): `isinstance(self.layers, nn.ModuleList)` was False on the layer-list stand-in, so a
    step branching on it took another path and failed with an unnamed error. The containers' own ways to change
    their layers are refused: each process holds only its stages' layers."""
    layers, _ = stand_in(1, 3)
    sequential = PipelinedSequential([OrderedDict(a=nn.Linear(2, 2))], False, (0,), 2)
    assert isinstance(layers, nn.ModuleList) and isinstance(sequential, nn.Sequential)
    assert repr(layers).splitlines()[1].startswith("  (1): Block(")
    for container, change in [(layers, lambda c: c.append(Block())), (layers, lambda c: c.insert(0, Block())),
                              (layers, lambda c: c.pop(0)), (layers, lambda c: c.extend([Block()])),
                              (sequential, lambda c: c.__setitem__(0, nn.Identity())),
                              (sequential, lambda c: c.__delitem__(0)), (layers, lambda c: c + nn.ModuleList())]:
        with pytest.raises(ConfigurationError, match=r"the body's layers were changed \(added, removed, replaced or "
                                                     r"copied into a new container\) during fit; under PipeStrategy "
                                                     r"they are split over 2 stages"):
            change(container)
    assert len(layers) == 4 and len(layers._modules) == 2 and len(sequential) == 1


def test_the_stand_in_behaves_like_the_list_for_the_loop():
    layers, blocks = stand_in(1, 3)
    assert len(layers) == 4
    assert [name for name, _ in layers.named_children()] == ["1", "2"]  # only this stage's blocks
    assert list(layers.state_dict())[0] == "1.linear.weight"  # under their original names
    assert [p._index for p in layers] == [0, 1, 2, 3]
    assert [p._index for p in layers[:3]] == [0, 1, 2] and layers[-1]._index == 3
    assert [i for i, _ in enumerate(layers[1:])] == [0, 1, 2]
    assert layers[3].kind == "full_attention"  # attributes of blocks of other stages are readable
    with pytest.raises(IndexError):
        layers[4]


def test_the_first_stage_runs_its_blocks_at_the_final_call_and_stops_the_step():
    layers, blocks = stand_in(0, 2)
    x0, scale = torch.randn(3, 4), torch.tensor(0.5)
    for learning in (True, False):  # the first pass runs the stage's blocks as called; later ones at the end
        layers.begin_step("stop")
        x = x0
        with pytest.raises(BodyReached) as reached:
            for i, block in enumerate(layers):
                x = block(x, scale, flag=False)
                if i == 1:
                    assert isinstance(x, HiddenStandIn) != learning  # the stage's output, or a stand-in for it
            after_the_loop = True
        hidden, sent_scale, key = reached.value.outputs
        torch.testing.assert_close(hidden, blocks[1](blocks[0](x0, scale), scale))
        assert sent_scale is scale and key.dtype == torch.int64 and "after_the_loop" not in locals()
        last, _ = stand_in(2, 4, blocks, stage_index=1)
        last.channel = layers.channel  # one store in a real job
        (out,) = last(hidden, sent_scale, key)
        torch.testing.assert_close(out, blocks[3](blocks[2](hidden, scale), scale))


@pytest.mark.parametrize("returns_tuple", [False, True])
def test_blocks_given_their_own_extra_arguments_get_them_on_every_stage(returns_tuple):
    """Alternating attention types (Gemma 2/3, Qwen2 with sliding windows) give each block its own mask: the
    first stage records every call and sends one set of arguments per block."""
    blocks = [Block(returns_tuple) for _ in range(4)]
    first, _ = stand_in(0, 2, blocks)
    x0 = torch.randn(3, 4)
    masks = [torch.full((2,), float(i)) for i in range(2)]

    def loop(layers, x):
        for i, block in enumerate(layers):
            out = block(x, mask=masks[i % 2], scale=None)
            x = out[0] if returns_tuple else out
        return x

    def whole(x):
        for i, block in enumerate(blocks):
            out = block(x, mask=masks[i % 2])
            x = out[0] if returns_tuple else out
        return x

    for _ in range(2):  # the first pass, and a later one
        first.begin_step("stop")
        with pytest.raises(BodyReached) as reached:
            loop(first, x0)
        hidden, *message = reached.value.outputs
        assert len(message) == 3  # both masks and the key
        last, _ = stand_in(2, 4, blocks, stage_index=1)
        last.channel = first.channel
        (out,) = last(hidden, *message)
        torch.testing.assert_close(out[0] if returns_tuple else out, whole(x0))


def _replace_step(layers, calls):
    """Run a loop on the last stage in replace mode; ``calls(layers, x)`` is the user's loop."""
    final = torch.randn(3, 4)
    layers.begin_step("replace", (final,))
    out = calls(layers, torch.randn(3, 4))
    layers.end_step("training_step", "layers")
    return out, final


def test_the_last_stage_returns_the_pipeline_output_to_the_loop():
    layers, _ = stand_in(2, 4, stage_index=1)
    mask = torch.ones(2)

    def loop(layers, x):
        for block in layers:
            x = block(x, mask=mask)
        return x

    out, final = _replace_step(layers, loop)
    assert out is final


def test_the_loop_may_read_what_it_is_handed_between_blocks_but_not_compute_with_it():
    layers, _ = stand_in(2, 4, stage_index=1)
    seen = []

    def loop(layers, x):
        for block in layers:
            seen.append((tuple(x.shape), x.dtype, x.device, x.dim(), len(x)))
            x = block(x)
        return x

    out, final = _replace_step(layers, loop)
    assert out is final and seen == [((3, 4), torch.float32, torch.device("cpu"), 2, 3)] * 4


def _chain(blocks, x, extra=lambda i: ()):
    for i, block in enumerate(blocks):
        x = block(x, *extra(i))
    return x


def _residual(layers, x):
    for block in layers:
        x = x + block(x)
    return x


def _mean_of_last_two(layers, x):
    hidden = []
    for block in layers:
        x = block(x)
        hidden.append(x)
    return torch.stack(hidden[-2:]).mean(0)


@pytest.mark.parametrize("loop, message", [
    (lambda layers, x: _chain(list(layers) * 2, x), r"in the order \[0, 1, 2, 3, 0, 1, 2, 3\]"),
    (lambda layers, x: _chain(layers[:3], x), r"in the order \[0, 1, 2\]; .* every block once"),
    (lambda layers, x: [block(x) for block in layers], "block 1 was not given the hidden state block 0 returned"),
    (_residual, r"used the output of block 0 for something other than the next block's input \(add\)"),
    (_mean_of_last_two, r"used the output of block 2 .* \(stack\)"),
])
def test_loops_a_pipeline_cannot_reproduce_are_refused(loop, message):
    layers, _ = stand_in(2, 4, stage_index=1)
    with pytest.raises(BodyCallError, match=message):
        _replace_step(layers, loop)


def test_a_loop_over_part_of_the_list_is_refused_on_the_first_stage_too():
    layers, _ = stand_in(0, 2)
    layers.begin_step("stop")
    x = torch.randn(2, 4)
    for block in layers[:3]:
        x = block(x)
    with pytest.raises(BodyCallError, match=r"in the order \[0, 1, 2\]; .* every block once"):
        layers.end_step("training_step", "layers")


def test_blocks_must_start_at_zero_take_the_hidden_state_first_and_return_it():
    layers, _ = stand_in(0, 2)
    layers.begin_step("stop")
    with pytest.raises(BodyCallError, match="block call 0 went to block 1; it must call every block once, in order"):
        layers[1](torch.randn(2, 4))
    with pytest.raises(BodyCallError, match="without a tensor as its first positional argument"):
        layers[0](x=torch.randn(2, 4))

    class AuxLoss(Block):
        def forward(self, x):
            return x, x.pow(2).mean()  # a per-block auxiliary loss cannot cross stages

    layers, _ = stand_in(0, 2, [AuxLoss() for _ in range(4)])
    layers.begin_step("stop")
    with pytest.raises(BodyCallError, match="only the hidden state crosses stages"):
        layers[0](torch.randn(2, 4))


def test_tuple_returning_blocks_pass_the_hidden_state_and_the_final_tuple_reaches_the_loop():
    blocks = [Block(returns_tuple=True) for _ in range(4)]
    whole, _ = stand_in(0, 4, blocks, num_stages=1)
    whole.begin_step("local")
    x = torch.randn(2, 4)
    out = x
    for block in whole:
        out = block(out)[0]
    last, _ = stand_in(2, 4, blocks, stage_index=1)
    assert isinstance(last.run_blocks(x, ((), {}), 2, 4), tuple)  # the final block's whole return value


def test_a_sequential_body_called_twice_in_one_step_is_refused():
    body = PipelinedSequential([OrderedDict(a=nn.Linear(2, 2))], False, (1,), 2)
    body.begin_step("replace", (torch.zeros(1, 2),))
    body(torch.ones(1, 2))
    body(torch.ones(1, 2))
    with pytest.raises(BodyCallError, match=r"called the body `self.body` 2 times in one step"):
        body.end_step("training_step", "body")


def test_a_process_with_two_stages_holds_both_under_their_names_and_runs_each_alone():
    """Interleaved 1F1B, 4 stages of one block on 2 processes: process 0 holds stages 0 and 2."""
    blocks = [Block() for _ in range(4)]
    first = PipelinedLayerList(blocks, [(0, 1), (2, 3)], (0, 2), 4, CallChannel(None))
    second = PipelinedLayerList(blocks, [(1, 2), (3, 4)], (1, 3), 4, CallChannel(None))
    second.channel = first.channel  # one store in a real job
    assert list(first.state_dict()) == ["0.linear.weight", "0.linear.bias", "2.linear.weight", "2.linear.bias"]
    assert not any(m is chunk for m in first.modules() for chunk in first.chunks)  # no second name for a block
    x0, scale = torch.randn(3, 4), torch.tensor(0.5)
    first.begin_step("stop")
    with pytest.raises(BodyReached) as reached:
        x = x0
        for block in first:
            x = block(x, scale)
    message, x = reached.value.outputs, x0
    torch.testing.assert_close(message[0], blocks[0](x, scale))  # stage 0 only
    message = second.chunk(0)(*message)
    torch.testing.assert_close(message[0], blocks[1](blocks[0](x, scale), scale))
    message = first.chunk(1)(*message)
    (out,) = second.chunk(1)(*message)  # the last stage: the final block's return value for the loop
    torch.testing.assert_close(out, blocks[3](blocks[2](blocks[1](blocks[0](x, scale), scale), scale), scale))


@pytest.mark.parametrize("mode", ["stop", "replace"])
def test_a_block_call_wrapped_in_torch_checkpoint_or_unpacked_is_refused(mode):
    layers, _ = stand_in(0 if mode == "stop" else 1, 4, stage_index=0 if mode == "stop" else 1)
    layers.begin_step(mode, (torch.randn(3, 4),))
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(BodyCallError, match="called inside torch.utils.checkpoint .* PipeStrategy\\(checkpoint="):
        torch.utils.checkpoint.checkpoint(layers[0], x, use_reentrant=False)
    for reentrant in (False, True):  # regression (review O): through a lambda, refused later with a wrong cause
        with pytest.raises(BodyCallError, match="called inside torch.utils.checkpoint"):
            torch.utils.checkpoint.checkpoint(lambda h, block=layers[0]: block(h), x, use_reentrant=reentrant)
    with pytest.raises(BodyCallError, match="unpacked or indexed block 0"):
        attn, ff = layers[0]
    whole, _ = stand_in(0, 4, num_stages=1)
    torch.utils.checkpoint.checkpoint(whole[0], x, use_reentrant=False)  # one stage: torch's checkpoint as usual


@pytest.mark.parametrize("kind", ["sequential", "layer_list"])
def test_the_body_called_outside_the_pipelined_steps_is_refused_where_a_process_holds_part_of_it(kind):
    """Regression: a callback calling the model in on_train_start ran this process's layers only, and printed a
    different value on each rank (-0.177, -0.340; -0.255 under DDP)."""
    if kind == "layer_list":
        body, _ = stand_in(2, 4, stage_index=1)
        whole, _ = stand_in(0, 4, num_stages=1)
        call = lambda b: [block(torch.randn(3, 4), torch.tensor(1.0)) for block in b]  # noqa: E731
    else:
        layers = OrderedDict((str(i), nn.Linear(4, 4)) for i in range(4))
        body = PipelinedSequential([OrderedDict(list(layers.items())[2:])], False, (1,), 2)
        whole = PipelinedSequential([layers], False, (0,), 1)
        call = lambda b: b(torch.randn(3, 4))  # noqa: E731
    with pytest.raises(BodyCallError, match=r"outside the steps PipeStrategy pipelines .* holds only stage 1 of 2"):
        call(body)
    call(whole)  # one stage: the whole body runs


@pytest.mark.parametrize("mode", ["stop", "replace"])
def test_calling_a_part_of_a_block_in_the_loop_is_refused_with_the_fix(mode):
    """Regression: ``blk.linear(h)`` in the loop ran the submodule outside the pipeline; on a stage not
    holding the block it failed inside torch on meta tensors."""
    layers, _ = stand_in(0 if mode == "stop" else 1, 4, stage_index=0 if mode == "stop" else 1)
    layers.begin_step(mode, (torch.randn(3, 4),))
    part = layers[3].linear
    assert part.out_features == 4 and tuple(part.weight.shape) == (4, 4)  # reading the part is fine
    with pytest.raises(BodyCallError, match=r"the loop called `linear` of block 3 \(Linear\) directly; .* Call the block"):
        part(torch.randn(3, 4))
    whole, _ = stand_in(0, 4, num_stages=1)
    whole[3].linear(torch.randn(3, 4))  # one stage: the block's own module, as usual


def test_a_stand_in_made_from_a_stand_in_keeps_the_hidden_states_metadata():
    """The first stage's loop passes stand-ins on: each next one is made from the last (regression: it read the
    meta device, and went through torch's slow empty_like of a meta subclass, 60 µs a block call)."""
    first = HiddenStandIn.of(torch.zeros(2, 3, requires_grad=True), 0)
    second = HiddenStandIn.of(first, 1)
    assert (second.shape, second.device, second.requires_grad, second.dtype) == \
        (torch.Size([2, 3]), torch.device("cpu"), True, torch.float32)
    with pytest.raises(BodyCallError, match="output of block 1"):
        second + 1


@pytest.mark.parametrize("kind", ["layer_list", "sequential"])
def test_a_whole_models_state_dict_loads_strictly_into_a_stand_in_which_takes_its_own_layers(kind):
    """Pretrained weights loaded in on_fit_start (`self.model.load_state_dict(whole)`): the other stages' layers
    are theirs to load, so a strict load succeeds and fills this rank's layers (regression: "Unexpected key(s)")."""
    from lightning_pipe.lightning.body import PipelinedSequential, present_whole_body

    whole = nn.Sequential(*[Block() for _ in range(4)])
    if kind == "layer_list":
        local, _ = stand_in(2, 4, blocks=[Block() for _ in range(4)], stage_index=1)
    else:
        layers = [Block() for _ in range(4)]
        local = PipelinedSequential([OrderedDict([("2", layers[2]), ("3", layers[3])])], False, (1,), 2)
        present_whole_body(local, nn.Sequential(*layers))
    assert sorted({k.split(".")[0] for k in local.state_dict()}) == ["2", "3"]
    local.load_state_dict(whole.state_dict())
    for key, value in local.state_dict().items():
        assert torch.equal(value, whole.state_dict()[key]), key
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        local.load_state_dict({**whole.state_dict(), "extra": torch.zeros(1)})  # not a layer: still unexpected
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "3.linear.bias"'):
        local.load_state_dict({k: v for k, v in whole.state_dict().items() if k != "3.linear.bias"})


def test_a_block_returning_tensors_besides_the_hidden_state_is_refused_with_what_to_switch_off():
    """Attention maps, caches, auxiliary losses, or a value the loop hands to the next block (T5's position bias)
    would not cross stages: named, not dropped."""
    from lightning_pipe.errors import BodyCallError
    from lightning_pipe.lightning.layer_list import _hidden_of

    hidden = torch.zeros(2, 3)
    assert _hidden_of(hidden, 0) is hidden and _hidden_of((hidden, None, 1.0), 0) is hidden
    with pytest.raises(BodyCallError, match=r"block 1 returned 2 values.*use_cache=False.*T5's position bias"):
        _hidden_of((hidden, torch.ones(2, 4, 3, 3)), 1)


def test_a_forward_hook_put_on_a_block_during_the_step_is_refused_and_one_put_before_is_not():
    """Hugging Face's output_hidden_states=True records each decoder layer's output with forward hooks it puts on
    the layers inside the model's forward (output_attentions on their attention modules); the layers run on their
    stages, outside the step, so the step saw an empty tuple (an IndexError in transformers' code, or in the
    user's). Hooks already there (a profiler's) stay."""
    from lightning_pipe.errors import BodyCallError

    s, blocks = stand_in()
    blocks[1].register_forward_hook(lambda *args: None)  # before the step: a profiler's
    s.begin_step("stop")
    x = torch.ones(2, 4)
    h = s[0](x)
    handle = blocks[1].register_forward_hook(lambda *args: None)
    with pytest.raises(BodyCallError, match=r"forward hook was put on block 1 during the step.*output_hidden_states"):
        s[1](h)
    handle.remove()
    s.begin_step("stop")
    handle = blocks[0].linear.register_forward_pre_hook(lambda *args: None)  # output_attentions: on a submodule
    with pytest.raises(BodyCallError, match=r"put on block 0 \(its `linear`\) during the step.*output_attentions"):
        s[0](x)
    handle.remove()
    s.begin_step("local")


class ContextBlock(nn.Module):
    """A block reading what the loop hands it besides the hidden state: a dict, a list or an object."""

    def __init__(self, fills: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.fills = fills

    def forward(self, x, ctx=None, sink=None):
        depth = ctx["depth"] if isinstance(ctx, dict) else ctx[0] if isinstance(ctx, list) else ctx.depth
        y = torch.tanh(self.linear(x)) * (1 + depth)
        if sink is not None and self.fills:
            sink.append(y.pow(2).mean())  # a per-block auxiliary loss handed back through a list
        return y


class Depth:
    def __init__(self, depth: int = 0) -> None:
        self.depth = depth


def _two_stages(blocks):
    first, _ = stand_in(0, 2, blocks)
    last, _ = stand_in(2, 4, blocks, stage_index=1)
    last.channel = first.channel  # one store in a real job
    return first, last


def _pipelined(first, last, loop, x):
    """The output of ``loop`` on two stages: the first stage's loop up to its final call, the last stage's run."""
    first.begin_step("stop")
    with pytest.raises(BodyReached) as reached:
        loop(first, x)
    (out,) = last(*reached.value.outputs)
    return out


@pytest.mark.parametrize("kind", ["dict", "list", "object", "object_kept"])
def test_extra_arguments_the_loop_changes_between_calls_reach_each_block_as_it_was_called(kind):
    """Regression (review O): a dict (or list, or object) changed in place between the calls (`ctx["depth"] += 1`)
    reached every block with its first call's contents: the loop's same object counted as the same arguments, and
    the stages trained a different model (weights up to 1.8e3 apart after 4 steps). An object kept across steps
    and changed between them (`object_kept`) reached the blocks as the first step had it."""
    blocks = [ContextBlock() for _ in range(4)]
    kept = Depth()

    def loop(layers, x, start=0):
        ctx = {"dict": lambda: {"depth": start}, "list": lambda: [start], "object": lambda: Depth(start)}.get(kind)
        ctx = ctx() if ctx is not None else kept
        if kind == "object_kept":
            kept.depth = start
        for block in layers:
            x = block(x, ctx=ctx)
            if kind == "dict":
                ctx["depth"] += 1
            elif kind == "list":
                ctx[0] += 1
            else:
                ctx.depth += 1
        return x

    first, last = _two_stages(blocks)
    x = torch.randn(3, 4)
    for start in (0, 5, 5):  # the first pass runs the first stage's blocks as called; later ones at the end
        torch.testing.assert_close(_pipelined(first, last, lambda layers, h: loop(layers, h, start), x),
                                   loop(blocks, x, start))


def test_an_extra_tensor_changed_in_place_after_its_block_call_is_refused():
    """Regression (review O): `scale.mul_(0.5)` between the calls reached every block with the last value."""
    first, _ = stand_in(0, 2)

    def loop(layers, x):
        scale = torch.ones(())
        for block in layers:
            x = block(x, scale)
            scale.mul_(0.5)
        return x

    for _ in range(2):
        first.begin_step("stop")
        with pytest.raises(BodyCallError, match=r"changed a tensor in place after giving it to block 0 .* scale \* 0.5"):
            loop(first, torch.randn(3, 4))


def test_a_block_filling_a_list_the_loop_gave_it_is_refused_on_every_stage():
    """Regression (review O): an auxiliary loss each block appended to a list the loop passed (`sink`) never
    reached the loop, whose copy stayed empty: the loss was silently left out."""

    def loop(layers, x):
        sink = []
        for block in layers:
            x = block(x, ctx=[0], sink=sink)
        return x

    first, _ = stand_in(0, 2, [ContextBlock() for _ in range(4)])
    for _ in range(2):  # the first pass runs the blocks as called, later ones at the final call
        first.begin_step("stop")
        with pytest.raises(BodyCallError, match="block 0 changed a list or dict the loop gave it"):
            loop(first, torch.randn(3, 4))
    first, last = _two_stages([ContextBlock(fills=i == 3) for i in range(4)])
    with pytest.raises(BodyCallError, match="block 3 changed a list or dict the loop gave it"):
        _pipelined(first, last, loop, torch.randn(3, 4))


@pytest.mark.parametrize("where", ["block", "part"])
def test_a_tensor_a_block_sets_as_it_runs_read_by_the_loop_is_refused(where):
    """Regression (review O): `sum(block.aux for block in self.layers)` after the loop read each block's initial
    value on a process not holding it, and the last run's value where it did: part of the loss was lost."""
    blocks = [Block() for _ in range(4)]
    for block in blocks:
        block.aux = torch.zeros(())
        block.linear.aux = torch.zeros(())
    layers, _ = stand_in(2, 4, blocks, stage_index=1)
    assert float(sum(block.aux for block in layers)) == 0.0  # outside the steps: the block's attribute, as usual

    def loop(layers, x):
        for block in layers:
            x = block(x)
        assert layers[3].kind == "full_attention" and layers[3].linear.weight.shape == (4, 4)  # these read fine
        return x + sum(block.aux if where == "block" else block.linear.aux for block in layers)

    path = "aux" if where == "block" else "linear.aux"
    with pytest.raises(BodyCallError, match=f"the loop read `{path}` of block 0, a tensor the block keeps as a plain"):
        _replace_step(layers, loop)


class AuxBlock(Block):
    """Sets an auxiliary loss (None until it first runs) and a router's load (a float) as it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_loss = None
        self.linear.load = None

    def forward(self, x, **kwargs):
        y = super().forward(x, **kwargs)
        if self.training:
            self.aux_loss, self.linear.load = (y ** 2).mean(), float(y.abs().mean())
        return y


@pytest.mark.parametrize("validated", [False, True])
@pytest.mark.parametrize("where", ["block", "part"])
def test_an_attribute_a_block_sets_as_it_runs_read_by_the_loop_is_refused_while_not_a_tensor(where, validated):
    """Regression (review AA): `a = self.layers[1].aux_loss; loss = ce + (0.1 * a if a is not None else 0)` on the
    last stage read block 1's initial None (block 1 runs on the first stage) and trained without the auxiliary
    term (weights 0.53 from DDP's). The attributes the stage's own blocks set as they run are noted from their
    first calls, told to the other processes through the job's store; those calls come before the last stage's
    run of the step on their output. Reading one is refused like a tensor. Review BB: with Lightning's sanity
    check, two validation calls (eval mode, where `if self.training:` sets nothing) used up the calls watched;
    each mode now has its own."""
    import torch.distributed as dist

    blocks, store = [AuxBlock() for _ in range(4)], dist.HashStore()
    first, _ = stand_in(0, 2, blocks)
    layers, _ = stand_in(2, 4, blocks, stage_index=1)
    first.channel, layers.channel = CallChannel(store), CallChannel(store)  # two processes' channels, one store
    if validated:  # the sanity check's microbatches first, read back on the last stage as an evaluation step would
        with torch.no_grad():
            for block in blocks:
                block.eval()
            for _ in range(2):
                layers.run_blocks(first.run_blocks(torch.randn(3, 4), ((), {}), 0, 2), ((), {}), 2, 4)
            assert not layers.sets_as_it_runs(1, "aux_loss")
            for block in blocks:
                block.train()
    hidden = first.run_blocks(torch.randn(3, 4), ((), {}), 0, 2)  # the first stage's forward
    blocks[1].aux_loss = blocks[1].linear.load = None  # as the last stage's process holds block 1: never run there
    layers.run_blocks(hidden, ((), {}), 2, 4)  # the last stage's, before the step runs on its output

    def loop(layers, x):
        for block in layers:
            x = block(x)
        assert layers[1].kind == "full_attention"  # set once, in __init__: reads fine
        aux = layers[1].aux_loss if where == "block" else layers[1].linear.load
        return x + (0.1 * aux if aux is not None else 0.0)

    path = "aux_loss" if where == "block" else "linear.load"
    with pytest.raises(BodyCallError, match=f"the loop read `{path}` of block 1, a plain attribute the block's forward"):
        _replace_step(layers, loop)


def test_a_hook_may_set_an_attribute_of_a_block_and_the_step_may_not():
    """Regression (review O): `block.drop_rate = ...` from on_train_batch_start raised a bare AttributeError
    (the proxy has slots); every process runs the hook, so it is set on every copy. Set in the step, it would not
    reach the blocks of a middle stage, which never runs the step."""
    layers, blocks = stand_in(2, 4, stage_index=1)
    for block in layers:
        block.drop_rate = 0.25
    assert [block.drop_rate for block in blocks] == [0.25] * 4
    layers.begin_step("replace", (torch.randn(3, 4),))
    with pytest.raises(BodyCallError, match="the step set `drop_rate` on block 0; .*on_train_batch_start"):
        layers[0].drop_rate = 0.5


@pytest.mark.parametrize("mode", ["stop", "replace"])
def test_a_blocks_output_given_to_the_next_block_as_an_extra_argument_is_refused(mode):
    """Regression (review O): `block(x, prev=x)` was refused with a message about a `detach` the loop never wrote."""
    layers, _ = stand_in(0 if mode == "stop" else 2, 2 if mode == "stop" else 4, stage_index=0 if mode == "stop" else 1)
    for learning_pass in range(2 if mode == "stop" else 1):
        layers.begin_step(mode, (torch.randn(3, 4),))
        x = torch.randn(3, 4)
        with pytest.raises(BodyCallError, match=r"gave a block's output to the next block as an extra argument"):
            for block in layers:
                x = block(x, mask=x)


@pytest.mark.parametrize("kind", ["sequential", "layer_list"])
def test_a_step_switching_the_bodys_mode_is_refused_and_one_keeping_it_is_not(kind):
    """Regression (review R): `self.body.eval()` (or `.train()`, or one layer's) in a step reached no stage: the
    pipeline runs the layers apart from the step, in the mode Lightning set, and trained something else silently.
    Refused at the body call (before it) and at the step's end (after it: the next microbatch's run would see it)."""
    if kind == "sequential":
        body = PipelinedSequential([OrderedDict(a=nn.Linear(4, 4), b=nn.Dropout(0.5))], False, (1,), 2)

        def call(body, x):
            return body(x)
    else:
        body, _ = stand_in(2, 4, stage_index=1)

        def call(body, x):
            for block in body:
                x = block(x)
            return x

    body.train()
    for change, when in ((lambda: body.eval(), "before"), (lambda: body[1].eval(), "before"),
                         (lambda: body.train(), None), (lambda: None, "after")):
        body.begin_step("replace", (torch.randn(3, 4),))
        change()
        if when == "before":
            with pytest.raises(BodyCallError, match="the step changed the training mode of the body's layers before"):
                call(body, torch.randn(3, 4))
            assert body.mode == "local"
            body.train()
            continue
        call(body, torch.randn(3, 4))
        if when == "after":
            body.eval()
            with pytest.raises(BodyCallError, match="training_step changed the training mode .* during the step"):
                body.end_step("training_step", "body")
            body.train()
        else:
            body.end_step("training_step", "body")


def test_a_value_from_another_stages_layer_is_refused_with_where_the_layer_lives():
    """Regression (review R): `self.log("w0", self.body[0].weight.sum())` or a penalty on it in the step, on the last
    stage, where that layer is a meta copy, failed with torch's "Cannot copy out of meta tensor" in the backward."""
    from lightning_pipe.lightning.logs import LogRecorder
    from lightning_pipe.lightning.release import explain_meta_error

    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = PipelinedSequential([OrderedDict({"1": nn.Linear(4, 4)})], False, (1,), 2)
            self.body.__dict__["whole_layers"] = [nn.Linear(4, 4, device="meta"), self.body[0]]

        def log(self, *args, **kwargs):
            raise AssertionError("recorded instead")

    module = Module()
    recorder = LogRecorder(module, "body")
    with recorder.recording():
        recorder.start_microbatch()
        with pytest.raises(BodyCallError, match=r"self.log\('w0', ...\) got a tensor on the meta device: under "
                                                r"PipeStrategy this process holds stage 1 of the 2 stages of `self.body`"):
            module.log("w0", module.body[0].weight.sum())
    with pytest.raises(BodyCallError, match=r"training_step computed with a tensor on the meta device \(Cannot copy"):
        explain_meta_error(NotImplementedError("Cannot copy out of meta tensor; no data!"), module, "body",
                           "training_step")
    explain_meta_error(RuntimeError("shapes do not match"), module, "body", "training_step")  # others pass through


class SharedStateBlock(nn.Module):
    """A block that changes what the loop gives it: an object's list or count, a cache, or a tensor in place."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.how = how

    def forward(self, x, state=None, scale=None):
        y = torch.tanh(self.linear(x))
        if self.how == "append":
            state.sink.append(y.pow(2).mean())  # an auxiliary loss handed back through an object
        elif self.how == "count":
            state.count += 1  # a count the blocks share
            y = y * state.count
        elif self.how == "cache":
            state.update(y, 0)
        elif self.how == "in_place":
            scale.mul_(0.5)  # under DDP every later block sees the halved value too
            y = y * scale
        return y


class Cache:
    def __init__(self) -> None:
        self.entries = []

    def update(self, value, layer):
        self.entries.append(value)

    def get_seq_length(self, layer=0):
        return len(self.entries)


class State:
    def __init__(self) -> None:
        self.sink, self.count = [], 0


@pytest.mark.parametrize("how", ["append", "count"])
def test_a_block_changing_an_object_the_loop_gave_it_is_refused_on_every_stage(how):
    """Regression (review Q): blocks appending an auxiliary loss to an object's list (`state.sink`), or counting in
    it, changed their run's own copy: the loop's object stayed empty (the loss was silently left out), and the
    count restarted on every stage (weights 1.5e-2 from DDP's after 4 steps)."""
    def loop(layers, x):
        state = State()
        for block in layers:
            x = block(x, state=state)
        return x

    first, _ = stand_in(0, 2, [SharedStateBlock(how) for _ in range(4)])
    for _ in range(2):  # the first pass runs each block as called, later ones the stage at the final call
        first.begin_step("stop")
        with pytest.raises(BodyCallError, match=r"(block 0|one of blocks 0\.\.1) changed the State object the loop gave it \(its `"):
            loop(first, torch.randn(3, 4))
    first, last = _two_stages([SharedStateBlock(how if i == 3 else "none") for i in range(4)])
    with pytest.raises(BodyCallError, match=r"one of blocks 2\.\.3 changed the State object the loop gave it"):
        _pipelined(first, last, loop, torch.randn(3, 4))


def test_a_cache_each_block_writes_and_a_tensor_a_block_changes_in_place_pass_as_under_one_process():
    """A cache's interface (`update`, `get_seq_length`: Hugging Face's) may change; a tensor a block changes in
    place reaches the later blocks as under one process (review Q: the first pass took the block's change for the
    loop's and refused it)."""
    for how in ("cache", "in_place"):
        blocks = [SharedStateBlock(how) for _ in range(4)]

        def loop(layers, x):
            state, scale = Cache(), torch.ones(())
            for block in layers:
                x = block(x, state=state, scale=scale)
            return x

        first, last = _two_stages(blocks)
        x = torch.randn(3, 4)
        for _ in range(2):
            torch.testing.assert_close(_pipelined(first, last, loop, x), loop(blocks, x))


def test_the_call_channel_keeps_a_bounded_number_of_structures_and_reads_older_ones_back_from_the_store():
    """Review Q: an object whose contents change every step (`self.ctx.step = n` given to the blocks) made one
    record per step, all kept for good on every process."""
    import torch.distributed as dist

    channel = CallChannel(dist.HashStore())
    keys = [channel.publish(split_call((), {"ctx": Depth(n)})[0]) for n in range(CallChannel.KEPT + 10)]
    assert len(channel._by_key) == CallChannel.KEPT and len(channel._records) == CallChannel.KEPT
    reader = CallChannel(channel.store)  # another process: reads what it lacks from the store
    for channel_ in (channel, reader):
        _, constants, _ = channel_.lookup(keys[0])
        assert constants[0].depth == 0 and channel_.lookup(keys[0])[1][0] is not constants[0]  # a copy per run


def test_lightnings_finetuning_callback_takes_a_layer_list_apart_and_unfreezes_every_block():
    """Regression (review W): BaseFinetuning's unfreeze_and_add_param_group(pl_module.layers, ...) stopped both ranks
    with "the loop unpacked or iterated block 0": its flatten_modules iterates whatever is iterable, and the loop's
    block proxies were (to refuse `attn, ff = block`, which indexing now refuses)."""
    from lightning.pytorch.callbacks import BaseFinetuning

    layers, blocks = stand_in(2, 4, stage_index=1)
    assert BaseFinetuning.flatten_modules(layers) == [block.linear for block in blocks]
    BaseFinetuning.freeze(layers)
    assert not any(p.requires_grad for block in blocks for p in block.parameters())
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    BaseFinetuning.unfreeze_and_add_param_group(layers, optimizer, lr=0.05)
    assert all(p.requires_grad for block in blocks for p in block.parameters())
    assert len(optimizer.param_groups[1]["params"]) == 8 and optimizer.param_groups[1]["lr"] == 0.05
    layers.begin_step("replace", (torch.randn(3, 4),))
    with pytest.raises(BodyCallError, match="unpacked or indexed block 1"):
        attn, ff = layers[1]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_hidden_state_from_torchs_transformer_encoder_is_refused_with_the_fix():
    """Regression (review HH): nn.TransformerEncoder's evaluation fast path (on by default) makes the hidden state a
    nested tensor when given a padding mask; the first stage failed on it with an error blaming released weights."""
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 4).eval()
    encoder.layers = PipelinedLayerList(list(encoder.layers), [(0, 2)], (0,), 2, CallChannel(None))
    encoder.layers.begin_step("stop")
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[:, 3:] = True
    with torch.no_grad(), pytest.raises(BodyCallError, match="nested tensor .* `enable_nested_tensor=False`"):
        encoder(torch.randn(2, 5, 8), src_key_padding_mask=padding)


def test_hooks_on_the_bodys_layers_get_one_warning_and_torchs_own_none():
    """Regression (review JJ): a forward hook on a first-stage layer recording activation statistics for the step
    logged its initial value on the last stage at every step, silently; hooks are now named in a warning at each
    loop's start (once per hook), except torch's own (legacy weight_norm, pruning masks), which change values only."""
    stats = {}
    blocks = [Block() for _ in range(4)]
    torch.nn.utils.weight_norm(blocks[0].linear)  # a forward pre-hook of torch's
    torch.nn.utils.prune.l1_unstructured(blocks[1].linear, "weight", amount=0.5)  # so is a pruning mask
    blocks[0].register_forward_hook(lambda module, args, out: stats.update(first=out.abs().mean()))
    layers, _ = stand_in(2, 4, blocks, stage_index=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert layers.warn_layer_hooks() == ["forward hook `test_hooks_on_the_bodys_layers_get_one_warning_and_torchs_"
                                             "own_none.<locals>.<lambda>` on layer 0"]
        assert layers.warn_layer_hooks() == []  # once per hook
        blocks[3].linear.register_full_backward_hook(lambda module, grad_in, grad_out: None)
        assert layers.warn_layer_hooks() == [
            "backward hook `test_hooks_on_the_bodys_layers_get_one_warning_and_torchs_own_none.<locals>.<lambda>` on "
            "layer 3 (its `linear`)"]
    assert len(caught) == 2 and "records them only on that process" in str(caught[0].message)


def test_a_released_module_given_a_blocks_stand_in_names_the_loop_that_stopped_early():
    """Review HHH: a loop running fewer blocks from step 2 on (depth set in a hook) handed block 2's stand-in to
    `self.head`, released on the first stage, and the error blamed the head's release and advised calling it in
    every step; it now names the loop."""
    from lightning_pipe import ConfigurationError
    from lightning_pipe.lightning.release import refuse_calls

    head = nn.Linear(3, 3)
    refuse_calls(head, "head", "pipeline rank 0 (stage 0)")
    with pytest.raises(BodyCallError, match=r"output of block 2 .*\(a call of self\.head\).* stopped after block 2"):
        head(HiddenStandIn.of(torch.zeros(2, 3), 2))
    with pytest.raises(ConfigurationError, match="released its weights"):  # any other input: as before
        head(torch.zeros(2, 3))


@pytest.mark.parametrize("kind", ["sequential", "layer_list"])
def test_values_of_other_stages_layers_name_a_sequential_body_called_layer_by_layer(kind):
    """Review HHH: a step looping over an nn.Sequential body's layers met the other stages' meta copies, and the
    error spoke only of penalties on weights; for a Sequential body it now says to call it whole."""
    from lightning_pipe.lightning.release import refuse_other_stages_values

    module = nn.Module()
    if kind == "sequential":
        module.body = PipelinedSequential([OrderedDict(a=Block(), b=Block())], False, [0], 2)
    else:
        module.body, _ = stand_in(0, 2)
    with pytest.raises(BodyCallError, match="meta copies") as raised:
        refuse_other_stages_values(module, "body", "the step computed with a tensor on the meta device")
    assert ("an nn.Sequential body is called whole (`self.body(x)`)" in str(raised.value)) == (kind == "sequential")
