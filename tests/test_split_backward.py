"""The backward split in two (I: input gradients, W: weight gradients) equals one backward, for any module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.checkpoint import Recomputation
from lightning_pipe.split_backward import backward_input


class Albert(nn.Module):
    """One layer applied three times: a parameter at several depths of the input path."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.out = nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(self.layer(x))
        return self.out(x)


class LossWithPenalty(nn.Module):
    """A root whose node mixes the input path and a term of parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.scale = nn.Linear(5, 5), nn.Parameter(torch.randn(5))

    def forward(self, x):
        return ((self.layer(x) - 1) ** 2).mean() + (self.scale ** 2).sum()


class ManyOutputs(nn.Module):
    """Two inputs, BatchNorm, a multi-output op (chunk), a root that is a parameter's function."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.bn = nn.Linear(5, 6), nn.Linear(3, 5), nn.BatchNorm1d(6)

    def forward(self, x, y):
        h = self.bn(self.a(x))
        left, right = h.chunk(2, dim=1)
        mixed = left * torch.sigmoid(right) * y[:, :3]
        return mixed, self.b(mixed).relu(), self.b.weight * 2


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.embedding = nn.LSTM(5, 5, batch_first=True), nn.Embedding(7, 5)

    def forward(self, x, index):
        out, _ = self.lstm(x.view(3, 1, 5) + self.embedding(index).view(3, 1, 5))
        return out.reshape(3, 5), x  # the second output is the input itself


def _mlp():
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(5, 5), nn.Tanh())])


def _float(rg=True):
    return torch.randn(3, 5, dtype=torch.double, requires_grad=rg)


CASES = {  # module, inputs, which outputs are roots
    "mlp": (_mlp, lambda: [_float()], slice(None)),
    "first stage (inputs need no gradient)": (_mlp, lambda: [_float(False)], slice(None)),
    "albert": (Albert, lambda: [_float()], slice(None)),
    "loss with penalty": (LossWithPenalty, lambda: [_float()], slice(None)),
    "many outputs": (ManyOutputs, lambda: [_float(), _float()], slice(None)),
    "an input that needs no gradient": (ManyOutputs, lambda: [_float(), _float(False)], slice(0, 2)),
    "lstm, embedding, identity output": (Recurrent, lambda: [_float(), torch.randint(0, 7, (3,))], slice(None)),
}


def _as_list(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("checkpoint", [False, True])
def test_input_then_weight_gradients_equal_one_backward(name, checkpoint):
    build, make_inputs, which = CASES[name]
    torch.manual_seed(1)
    module = build().double()
    inputs = make_inputs()
    roots = _as_list(module(*inputs))[which]
    grads = [torch.randn_like(r) if r.numel() > 1 else None for r in roots]
    torch.autograd.backward(roots, [g if g is not None else torch.ones_like(r) for g, r in zip(grads, roots)])
    expected = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    expected_inputs = [x.grad for x in inputs if x.requires_grad]
    module.zero_grad(set_to_none=True)

    leaves = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
    recomputation = Recomputation(lambda *a: module(*a), lambda: torch.manual_seed(1)) if checkpoint else None
    outputs = recomputation.run(*leaves) if checkpoint else module(*leaves)
    wanted = [x for x in leaves if x.requires_grad]
    input_grads, weights = backward_input(_as_list(outputs)[which], grads, wanted)
    assert all(p.grad is None for p in module.parameters()), "I touched a weight gradient"
    weights.run()
    for got, want in zip(input_grads, expected_inputs):
        torch.testing.assert_close(got, want)
    got = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for n in got:
        torch.testing.assert_close(got[n], expected[n], msg=lambda m: f"{name}: {n}: {m}")
    if checkpoint:
        assert recomputation.recomputed == 1


def _activations_left_after_steps(rank, world_size, schedule, checkpoint, count):
    import gc
    import weakref

    import torch.nn.functional as F

    from lightning_pipe import Pipeline

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())
    outputs = []  # each ReLU/Tanh output: its node saves it, the case that made a cycle
    for layer in (model[1], model[3]):
        layer.register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))
    pipe = Pipeline(model, chunks=4, schedule=schedule, checkpoint=checkpoint, count_activations=count)
    for _ in range(3):
        pipe.forward_backward(torch.randn(8, 8), criterion=F.mse_loss, labels=(torch.randn(8, 8),))
    gc.collect()
    return len(outputs), sum(ref() is not None for ref in outputs)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("count", [True, False], ids=["counted", "uncounted"])
def test_no_activation_outlives_its_step(schedule, checkpoint, count):
    """Regression: under a split backward every step leaked its activations (ZB-H1 and ZB-V, plain
    API and PipeStrategy; +8 MiB a step on the efficiency benchmark's stages, steps slowing as memory
    grew): the activation meter's saved-tensor hook kept each saved output, whose grad_fn is the node
    that saved it, and a graph kept for W is never freed by a backward, so the cycle stayed."""
    from tests.distributed import run

    ((made, alive),) = run(_activations_left_after_steps, 1, schedule, checkpoint, count, timeout=60)
    assert made >= 3 * 4 * 2 and alive == 0, (made, alive)


class _ExpThenAddInPlace(nn.Module):
    def forward(self, x):
        y = x.exp()  # exp saves its output for the backward...
        y.add_(1)  # ...which this changes: autograd refuses the backward
        return y


def _backward_after_an_in_place_change(rank, world_size, schedule, count):
    import torch.nn.functional as F

    from lightning_pipe import Pipeline

    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4), _ExpThenAddInPlace()), chunks=2, schedule=schedule,
                    count_activations=count)
    pipe.forward_backward(torch.randn(4, 4), criterion=F.mse_loss, labels=(torch.randn(4, 4),))


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
@pytest.mark.parametrize("count", [True, False], ids=["counted", "uncounted"])
def test_a_saved_tensor_changed_in_place_fails_as_without_a_pipeline(schedule, count):
    """Regression: autograd skips its in-place check for tensors saved through hooks, and every stage
    saves through the activation meter's, so such a model trained on wrong gradients in a pipeline
    where plain PyTorch raises."""
    from tests.distributed import run

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _ExpThenAddInPlace()(torch.zeros(2, requires_grad=True)).sum().backward()
    ((outcome, (name, message, _)),) = run(_backward_after_an_in_place_change, 1, schedule, count, timeout=60,
                                           expect_errors=True)
    assert outcome == "error" and "modified by an inplace operation" in message, (outcome, name, message)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_reentrant_checkpoint_inside_a_layer_is_named_with_the_fix(reentrant):
    """Hugging Face's gradient_checkpointing_enable() on transformers 4.x checkpoints each layer with
    use_reentrant=True, which autograd.grad with inputs refuses: say which schedules split the backward and what
    to use instead. Non-reentrant checkpointing splits as any layer does."""
    from torch.utils.checkpoint import checkpoint

    from lightning_pipe.errors import ConfigurationError

    layer = nn.Linear(3, 3)
    x = torch.ones(2, 3, requires_grad=True)
    out = checkpoint(layer, x, use_reentrant=reentrant).sum()
    if reentrant:
        with pytest.raises(ConfigurationError, match=r"use_reentrant=True.*'zb_h1'.*use_reentrant': False"):
            backward_input([out], [None], [x])
        embedded = nn.Linear(3, 3)(torch.ones(2, 3))  # a first stage: no input gradients, the backward all in W
        first_stage = checkpoint(layer, embedded, use_reentrant=True).sum()
        _, weights = backward_input([first_stage], [None], [])
        with pytest.raises(ConfigurationError, match=r"use_reentrant=True"):
            weights.run()
    else:
        (dx,), weights = backward_input([out], [None], [x])
        weights.run()
        torch.testing.assert_close(dx, layer.weight.sum(0).expand(2, 3))
        torch.testing.assert_close(layer.weight.grad, torch.full((3, 3), 2.0))


class _FirstInputOnly(nn.Module):
    def __init__(self, passes_inputs_on: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.passes_inputs_on = passes_inputs_on

    def forward(self, a, b):
        return self.linear(a)


@pytest.mark.parametrize("split", [False, True])
def test_a_received_input_without_a_gradient_is_warned_about_unless_the_stage_passes_inputs_on(split):
    """Review U: a layer list's stage passes every extra tensor on to later stages, used here or not: no warning
    there. Elsewhere an input nothing uses gets zeros back instead of no gradient: warned once."""
    import warnings

    from lightning_pipe.stage import Stage

    for passes_on in (False, True):
        stage = Stage(_FirstInputOnly(passes_on), 1, 2, split_backward=split)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(2):
                inputs = (torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True))
                stage.forward(i, inputs, 2, loss_fn=lambda i, out: out[0].sum())
                grads, _ = (stage.backward_input if split else stage.backward)(i, None)
                if split:
                    stage.backward_weight(i)
                assert grads[1].abs().sum() == 0
        warned = [str(w.message) for w in caught if "computed no gradient" in str(w.message)]
        assert len(warned) == (0 if passes_on else 1), warned


def _stage_backward(stage, i: int, split: bool) -> None:
    """Microbatch ``i``'s whole backward: one action, or its input part then its weight part."""
    (stage.backward_input if split else stage.backward)(i, None)
    if split:
        stage.backward_weight(i)


def _assert_same_state_and_grads(module: nn.Module, reference: nn.Module) -> None:
    for (name, got), want in zip(module.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}")
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("split", [False, True])
def test_a_checkpointed_batch_norm_updates_its_statistics_once_per_microbatch(split):
    """Regression (review V): under checkpoint="always" a plain BatchNorm's recomputation in backward updated its
    running statistics a second time (num_batches_tracked 16 where DDP has 8; running_mean 0.081 against 0.057)."""
    import copy

    from lightning_pipe.stage import Stage

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2), nn.BatchNorm1d(2, momentum=None))
    reference = copy.deepcopy(module)
    stage = Stage(module, 1, 2, checkpoint="always", split_backward=split)
    for i in range(3):
        x = torch.randn(5, 3)
        reference(x).sum().backward()
        stage.forward(i, (x.requires_grad_(),), 3, loss_fn=lambda i, out: out[0].sum())
        _stage_backward(stage, i, split)
    _assert_same_state_and_grads(module, reference)


@pytest.mark.parametrize("split", [False, True])
def test_a_recomputed_batch_norm_leaves_the_graph_of_an_uncheckpointed_microbatch_usable(split):
    """Regression (review MM): under checkpoint="except_last" and 1F1B or ZB-H1, stage 0 runs the last microbatch's
    forward (kept, not checkpointed), then an earlier microbatch's backward, which recomputes its forward; putting the
    running statistics back bumped their version, and the last microbatch's backward failed ("modified by an inplace
    operation"). They are put back as BatchNorm's own update writes them, without a version bump."""
    import copy

    from lightning_pipe.stage import Stage

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(module)
    stage = Stage(module, 1, 2, checkpoint="except_last", split_backward=split)
    xs = [torch.randn(5, 3) for _ in range(2)]
    for x in xs:
        reference(x).sum().backward()
    for i, x in enumerate(xs):  # microbatch 0 checkpointed, microbatch 1 (the last) not
        stage.forward(i, (x.clone().requires_grad_(),), 2, loss_fn=lambda i, out: out[0].sum())
    for i in range(2):  # microbatch 0's backward recomputes, then microbatch 1's uses what its forward saved
        _stage_backward(stage, i, split)
    _assert_same_state_and_grads(module, reference)
