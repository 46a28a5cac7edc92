"""Interleaved 1F1B, ZB-H1, ZB-H2 and ZB-V run by the engine, against the same model in one process.

Loss, outputs, every gradient and the weights after 3 optimizer steps, over p in {1, 2, 3, 4}
ranks, m in {p, 2p, 2p + 1} microbatches, v in {2, 3} stages per rank where the schedule takes v,
and every checkpoint mode; with skip connections (some between stages on one rank), tied weights
(held by one rank twice under ZB-V, by two ranks otherwise) and deferred BatchNorm. Cases are
grouped so that each test starts its processes once.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import NamedTuple, Optional

import pytest
import torch
from torch import nn

from lightning_pipe import (
    ConfigurationError, Interleaved1F1B, PartitionError, Pipeline, ZeroBubbleH1, ZeroBubbleH2, ZeroBubbleV, partition,
)
from lightning_pipe.errors import BodyCallError, PipelineStepError
from lightning_pipe.batchnorm import DeferredBatchNorm, commit_deferred_batch_norm
from lightning_pipe.partition import balance_by_layers
from lightning_pipe.schedule import ALL_SCHEDULES
from tests import distributed
from tests.models import mlp, resnet, unet
from tests.test_ties_and_rng import tied_lm

MODES = ("never", "except_last", "always")
NEW = (("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zb_h1", None), ("zb_h2", None), ("zbv", None))


class Case(NamedTuple):
    model: str  # "mlp", "unet", "tied", "resnet"
    schedule: str
    virtual_stages: Optional[int]
    chunks: int
    checkpoint: str = "never"
    batch: int = 10
    api: str = "pipeline"  # or "named": Interleaved1F1B / ZeroBubbleH1 / ZeroBubbleH2 / ZeroBubbleV


def _cross_entropy(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))


MODELS = {  # builder, criterion, deferred BatchNorm
    "mlp": (lambda: mlp(num_layers=8), nn.functional.mse_loss, False),
    "unet": (unet, nn.functional.mse_loss, False),
    "tied": (lambda: tied_lm(depth=6), _cross_entropy, False),
    "resnet": (lambda: resnet(depth=7), nn.functional.mse_loss, True),
}


def _batch(model: str, batch: int, gen: torch.Generator):
    if model == "tied":
        return torch.randint(0, 7, (batch, 5), generator=gen), torch.randint(0, 7, (batch, 5), generator=gen)
    return torch.randn(batch, 6, generator=gen, dtype=torch.float64), torch.randn(batch, 6, generator=gen, dtype=torch.float64)


def _reference_step(model, criterion, x, y, chunks):
    """The plain model on the same microbatches in sequence (BatchNorm sees each one)."""
    n = min(chunks, len(x))
    loss, outputs = 0.0, []
    for px, py in zip(torch.tensor_split(x, n), torch.tensor_split(y, n)):
        out = model(px)
        part = criterion(out, py) * (len(px) / len(x))
        part.backward()
        loss = loss + part.detach()
        outputs.append(out.detach())
    return loss, torch.cat(outputs)


def _pipeline(case: Case, parts, world: int):
    spec = ALL_SCHEDULES[case.schedule]
    deferred = MODELS[case.model][2]
    if case.api == "named":
        named = {"interleaved_1f1b": Interleaved1F1B, "zb_h1": ZeroBubbleH1, "zb_h2": ZeroBubbleH2,
                 "zbv": ZeroBubbleV}[case.schedule]
        return named(parts if spec.stages_per_rank != 1 else parts[0], chunks=case.chunks,
                     checkpoint=case.checkpoint, deferred_batch_norm=deferred, count_activations=True)
    return Pipeline(parts, chunks=case.chunks, schedule=case.schedule, checkpoint=case.checkpoint,
                    virtual_stages=case.virtual_stages, deferred_batch_norm=deferred, count_activations=True)


def _compare(rank: int, world: int, case: Case) -> None:
    build, criterion, deferred = MODELS[case.model]
    full = build()
    reference = copy.deepcopy(full)
    if deferred:
        reference = DeferredBatchNorm.convert_deferred_batch_norm(reference)
    spec = ALL_SCHEDULES[case.schedule]
    v = spec.virtual_stages(case.virtual_stages)
    balance = balance_by_layers(len(full), world * v)
    parts = partition(full, rank, world, balance, num_model_chunks=v, placement=spec.placement)
    pipe = _pipeline(case, parts, world)
    params = list({id(p): p for part in parts for p in part.parameters()}.values())
    opt = torch.optim.SGD(params, lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        x, y = _batch(case.model, case.batch, gen)
        ref_opt.zero_grad()
        opt.zero_grad()
        ref_loss, ref_out = _reference_step(reference, criterion, x, y, case.chunks)
        commit_deferred_batch_norm(reference)
        loss, out = pipe.forward_backward(x, criterion=criterion, labels=(y,), return_outputs=True)
        if pipe.holds_last:
            torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"{case} loss, step {step}: {m}")
            torch.testing.assert_close(out, ref_out, msg=lambda m: f"{case} outputs, step {step}: {m}")
        else:
            assert loss is None and out is None
        ref_params = dict(reference.named_parameters(remove_duplicate=False))
        for part in parts:
            for name, p in part.named_parameters():
                torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"{case} {name}, step {step}: {m}")
        opt.step()
        ref_opt.step()
    expected = reference.state_dict()
    for part in parts:
        for name, value in part.state_dict().items():
            torch.testing.assert_close(value, expected[name], msg=lambda m: f"{case} {name}: {m}")
    assert pipe.meter.held_bytes == 0, f"{case}: {pipe.meter.held_bytes} activation bytes held after the step"
    for part in parts:
        part.eval()
    reference.eval()
    with torch.no_grad():
        x, _ = _batch(case.model, 4, gen)
        out = pipe.forward(x)
        if pipe.holds_last:
            torch.testing.assert_close(out, reference(x), msg=lambda m: f"{case} eval: {m}")


def _grid(rank: int, world: int, cases) -> int:
    for case in cases:
        _compare(rank, world, case)
    return len(cases)


def _mlp_cases(p: int) -> list:
    cases = []
    for schedule, v in NEW:
        if schedule == "interleaved_1f1b" and v == 3 and p > 2:
            continue  # 16 layers: 12 stages at most keep every stage non-empty
        for k, m in enumerate((p, 2 * p, 2 * p + 1)):
            cases.append(Case("mlp", schedule, v, m, MODES[k]))
    return cases


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_new_schedules_match_one_process(p):
    """Every new schedule, m in {p, 2p, 2p+1}, each with another checkpoint mode."""
    cases = _mlp_cases(p)
    if p == 2:  # every checkpoint mode with every m, and the named classes
        cases += [Case("mlp", s, v, m, c) for s, v in NEW for m in (2, 5) for c in MODES if (m, c) != (2, "never")]
        cases += [Case("mlp", s, v, 4, api="named") for s, v in NEW if v != 3]
        cases.append(Case("mlp", "zbv", None, 8, batch=3))  # fewer samples than microbatches
    distributed.run(_grid, p, cases, timeout=300)


@pytest.mark.parametrize("p", [2, 4])
def test_skips_ties_and_batch_norm_on_new_schedules(p):
    """Skips crossing ranks and staying on one rank, a tie held twice by one rank or by two ranks,
    deferred BatchNorm; every checkpoint mode."""
    cases = []
    for schedule, v in NEW:
        if v == 3 and p == 4:
            continue  # unet has 8 layers
        for k, model in enumerate(("unet", "tied", "resnet")):
            cases.append(Case(model, schedule, v, 2 * p + 1, MODES[(k + p) % 3], batch=4 * p + 2))
    distributed.run(_grid, p, cases, timeout=300)


# -- bad combinations, named on every rank before any communication ------------------------------
def _bad(rank: int, world: int) -> list:
    errors = []
    model = mlp(num_layers=2)  # 4 layers
    attempts = [
        lambda: partition(model, rank, world, num_model_chunks=3),  # 12 stages, 4 layers
        lambda: partition(model, rank, world, num_model_chunks=3, placement="v"),
        lambda: Pipeline(partition(model, rank, world), chunks=2, schedule="interleaved_1f1b"),
        lambda: Pipeline(partition(model, rank, world), chunks=2, schedule="zbv"),
        lambda: Pipeline(partition(model, rank, world, num_model_chunks=2), chunks=2, schedule="zb_h1"),
        lambda: Pipeline(partition(model, rank, world, num_model_chunks=2), chunks=2, schedule="interleaved_1f1b",
                         virtual_stages=3),
        lambda: Pipeline(partition(model, rank, world), chunks=2, schedule="pipedream"),
    ]
    for attempt in attempts:
        try:
            attempt()
        except ConfigurationError as error:
            errors.append((type(error).__name__, str(error)))
        else:
            errors.append(None)
    return errors


def test_bad_combinations_are_named_on_every_rank_before_any_communication():
    per_rank = distributed.run(_bad, 2, timeout=60)
    assert per_rank[0] == per_rank[1]
    (chunks, v_chunks, interleaved, zbv, h1, mismatch, unknown) = per_rank[0]
    assert chunks[0] == PartitionError.__name__ and "cannot split 4 layers into 6 stages" in chunks[1]
    assert "2 stages on each rank" in v_chunks[1] and "placement='v'" in v_chunks[1]
    assert "needs virtual_stages" in interleaved[1]
    assert "runs 2 stages per rank, but this rank was given 1 module" in zbv[1]
    assert "placement='v'" in zbv[1]
    assert "runs 1 stage per rank, but this rank was given 2 modules" in h1[1]
    assert "runs 3 stages per rank, but this rank was given 2 modules" in mismatch[1]
    assert "schedule must be one of" in unknown[1]


# -- tracing: the recorder sees every action, I and W included -----------------------------------
def _traced(rank: int, world: int, out: str) -> dict:
    import os

    from lightning_pipe.schedule import make_table

    seen = {}
    for schedule, v in NEW[1:]:
        spec = ALL_SCHEDULES[schedule]
        parts = partition(mlp(num_layers=6), rank, world, num_model_chunks=spec.virtual_stages(v),
                          placement=spec.placement)
        pipe = Pipeline(parts, chunks=4, schedule=schedule, virtual_stages=v)
        recorder = pipe.trace_steps()
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
        for _ in range(2):
            pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
        plan = [str(a) for a in make_table(schedule, world, 4, v)[rank]]
        row = pipe._row(schedule, 4)
        receives = sum(1 for a in row if a.is_recv)
        for record in recorder.records:
            assert [str(a) for a, _, _ in record.compute] == plan, (schedule, rank, record.step)
            assert len(record.waits) == receives, (schedule, rank, len(record.waits), receives)
        path = pipe.export_trace(os.path.join(out, f"{schedule}.json"))
        png = pipe.save_timeline_png(os.path.join(out, f"{schedule}.png"))
        seen[schedule] = (sorted({a.kind for a, _, _ in recorder.records[0].compute}), path, png)
    return seen


def test_the_recorder_sees_input_and_weight_gradient_actions(tmp_path):
    per_rank = distributed.run(_traced, 2, str(tmp_path), timeout=120)
    assert per_rank[0]["zb_h1"][0] == per_rank[0]["zb_h2"][0] == per_rank[0]["zbv"][0] == ["F", "I", "W"]
    assert per_rank[1]["interleaved_1f1b"][0] == ["B", "F"]
    for schedule, (_, path, png) in per_rank[0].items():
        assert path.endswith(f"{schedule}.json") and png.endswith(f"{schedule}.png")
        assert (tmp_path / f"{schedule}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- work of the caller's run where the rank first waits -------------------------------------------
class _Slow(nn.Module):
    """Sleeps in every forward: the other rank's receives of this rank's messages surely wait."""

    def forward(self, x):
        import time

        time.sleep(0.2)
        return x


def _idle_tasks(rank: int, world: int) -> dict:
    import time

    torch.manual_seed(0)
    stage = nn.Sequential(_Slow(), nn.Linear(6, 6))
    pipe = Pipeline(stage, chunks=4, schedule="1f1b")
    recorder = pipe.trace_steps()
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    ran = []
    pipe.forward_backward(*((x,) if rank == 0 else ()), criterion=nn.functional.mse_loss if rank else None,
                          labels=(y,) if rank else (), when_idle=[lambda: ran.append(("a", time.perf_counter())),
                                                              lambda: ran.append(("b", time.perf_counter()))])
    (record,) = recorder.records
    return {"ran": [name for name, _ in ran], "at": ran[0][1], "compute": [(str(a), b, e) for a, b, e in record.compute],
            "waits": [(str(a), b, e) for a, b, e in record.waits]}


def _idle_alone(rank: int, world: int) -> list:
    import time

    pipe = Pipeline(nn.Sequential(nn.Linear(6, 6)), chunks=2)
    recorder = pipe.trace_steps()
    ran = []
    pipe.forward_backward(torch.randn(4, 6), criterion=nn.functional.mse_loss, labels=(torch.randn(4, 6),),
                          when_idle=[lambda: ran.append(time.perf_counter())])
    (record,) = recorder.records
    return [ran, record.compute[-1][2]]


def test_when_idle_runs_where_the_rank_first_waits_for_a_message_or_at_the_steps_end():
    """The Lightning glue's work that need not delay the pipeline's start (the fingerprint of the batch, posting
    the receive of the step's results) runs there: in order, once, after the compute before the first wait."""
    first, last = distributed.run(_idle_tasks, 2, timeout=120)
    assert first["ran"] == last["ran"] == ["a", "b"]
    computed_before = [a for a, _, end in first["compute"] if end <= first["at"]]
    assert computed_before == [a for a, _, _ in first["compute"]][:len(computed_before)] and computed_before
    assert first["at"] <= first["waits"][0][2]  # before rank 0's first wait (for a gradient) ended
    assert all(first["at"] <= begin for a, begin, _ in first["compute"] if a not in computed_before)
    assert last["compute"][0][0] == "1F0" and last["at"] <= last["compute"][0][1]  # before its first forward
    (ran, end_of_last_action), = distributed.run(_idle_alone, 1, timeout=60)
    assert len(ran) == 1 and ran[0] >= end_of_last_action  # no message to wait for: after the step's actions


# per step, the Linear layers (of 8) that are frozen: all but the last two, then two more unfrozen (on later ranks
# only), then every layer trains, then the first six are frozen again
FREEZING = ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3], [], [], [0, 1, 2, 3, 4, 5])


def _frozen_between_steps(rank: int, world: int, schedule: str, plan) -> int:
    """Layers frozen or unfrozen between steps, on one process and in the pipeline: gradients and weights."""
    full = mlp(num_layers=8)
    reference = copy.deepcopy(full)
    v = ALL_SCHEDULES[schedule].virtual_stages(None)
    parts = partition(full, rank, world, balance_by_layers(len(full), world * v), num_model_chunks=v,
                      placement=ALL_SCHEDULES[schedule].placement)
    pipe = Pipeline(parts, chunks=3, schedule=schedule)
    gen = torch.Generator().manual_seed(3)
    for step, frozen in enumerate(plan):
        for model in (reference, *parts):
            for name, p in model.named_parameters():
                p.requires_grad_(int(name.split(".")[0]) // 2 not in frozen)
                p.grad = None
        x, y = _batch("mlp", 9, gen)
        _reference_step(reference, nn.functional.mse_loss, x, y, 3)
        pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
        ref_params = dict(reference.named_parameters())
        for part in parts:
            for name, p in part.named_parameters():
                assert (p.grad is None) == (ref_params[name].grad is None), f"{schedule} {name}, step {step}"
                if p.grad is not None:
                    torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"{name}, step {step}: {m}")
        with torch.no_grad():  # SGD on every copy: the reference's whole model, this rank's part
            for p in [*reference.parameters(), *(p for part in parts for p in part.parameters())]:
                if p.grad is not None:
                    p -= 0.1 * p.grad
    return step


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "zbv", "zbv_late"])
def test_layers_frozen_and_unfrozen_between_steps_train_as_in_one_process(schedule):
    """Regression (review S; BackboneFinetuning under PipeStrategy): a body frozen whole, its input needing no
    gradient, and unfrozen later made stage 0 send outputs that require grad where the last step's did not, and
    the step failed ("what a stage sends must depend only on the shapes of the pipeline's inputs"). Each rank now
    tells the step header that its stages changed; a change on later ranks only (the top half unfrozen first) is
    announced from there on, where every rank holds one stage."""
    plan = {"zbv": FREEZING[:1] + FREEZING[2:],  # rank 0 holds stage 0 and changes with every step here
            # rank 1 alone freezes layers whose inputs need a gradient: nothing it sends changes (review U: refused)
            "zbv_late": ([], [4, 5], [], [4, 5])}.get(schedule, FREEZING)
    world = 2 if schedule.startswith("zbv") else 3
    assert distributed.run(_frozen_between_steps, world, schedule[:3] if schedule == "zbv_late" else schedule,
                           plan) == [len(plan) - 1] * world


def _unfrozen_on_a_later_rank(rank: int, world: int) -> str:
    try:
        _frozen_between_steps(rank, world, "zbv", FREEZING)
    except Exception as error:  # noqa: BLE001 (the named error, or the abort it causes on the other rank)
        return f"{type(error).__name__}: {error}"
    return "trained"


def test_a_later_rank_alone_changing_what_it_sends_under_zbv_is_named():
    """Where a rank holds several stages, data flows back to lower ranks, which cannot learn of a later rank's
    change from the header: named where the changed message is sent, and reported to every rank (review U: named
    up front, it was not reported, and it refused changes that send nothing new)."""
    first, second = distributed.run(_unfrozen_on_a_later_rank, 2)
    assert "the stages on pp rank 1 changed which of their parameters require grad since then" in second, second
    assert "PipelineAbortedError" in first and "pp rank 1 changed" in first, first


class _AddOneInPlace(nn.Module):
    def forward(self, x):
        return x.add_(1.0)  # in place, with no `inplace` attribute to tell


def _in_place_first_layer(rank: int, world: int, schedule: str, checkpoint: str, first: str) -> str:
    torch.manual_seed(0)
    head = nn.ReLU(inplace=True) if first == "relu" else _AddOneInPlace()
    full = nn.Sequential(nn.Linear(6, 6), head, nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 6)).double()
    reference = copy.deepcopy(full)
    part = partition(full, rank, world, balance=[1, 4])
    pipe = Pipeline(part, chunks=3, schedule=schedule, checkpoint=checkpoint)
    x, y = _batch("mlp", 9, torch.Generator().manual_seed(3))
    _reference_step(reference, nn.functional.mse_loss, x, y, 3)
    try:
        pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
    except Exception as error:  # noqa: BLE001 (the named error, or the abort it causes on the other rank)
        return f"{type(error).__name__}: {error}"
    ref_params = dict(reference.named_parameters())
    for name, p in part.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, msg=lambda m: f"{schedule} {checkpoint} {name}: {m}")
    return "trained"


@pytest.mark.parametrize("schedule, checkpoint", [("1f1b", "never"), ("zb_h1", "never"), ("1f1b", "always"),
                                                  ("zb_h1", "always")])
def test_a_stage_starting_with_an_in_place_activation_trains_as_in_one_process(schedule, checkpoint):
    """Regression (review S): a cut between a Linear and its nn.ReLU(inplace=True) (torchvision writes activations
    that way) failed with autograd's "a leaf Variable that requires grad is being used in an in-place operation":
    what a stage receives is a leaf. Such a stage now gets copies; an in-place first operation it cannot see
    (`x.add_(1)`) is named with the fix."""
    assert distributed.run(_in_place_first_layer, 2, schedule, checkpoint, "relu") == ["trained", "trained"]
    if checkpoint == "never":
        first, second = distributed.run(_in_place_first_layer, 2, schedule, checkpoint, "add")
        assert "PipelineStepError: stage 1 writes into its input in place" in second and "balance=[...]" in second, second
        assert "PipelineAbortedError" in first, first


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kept, self.unused = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return torch.tanh(self.kept(x)), self.unused(x)  # the second needs a gradient but no later stage uses it


class _FirstOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, a, b):
        return self.linear(a)


def _unused_output(rank: int, world: int, schedule: str) -> list:
    from lightning_pipe import SequentialModel

    torch.manual_seed(0)
    part = partition(SequentialModel(_TwoOutputs(), _FirstOnly()).double(), rank, world, balance=[1, 1])
    pipe = Pipeline(part, chunks=3, schedule=schedule)
    x, y = _batch("mlp", 9, torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning, match=r"stage 1 computed no gradient for its input\(s\) \[1\]") if rank == 1 \
            else contextlib.nullcontext() as record:
        pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y,))
    return [] if record is None else [str(w.message)[:40] for w in record if "no gradient" in str(w.message)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_an_output_no_later_stage_uses_is_warned_about_once(schedule):
    """Review S: a stage output that needs a gradient but that no later stage uses gets zeros back (messages have
    fixed shapes), so the parameters feeding only it get zero gradients where one process leaves them without one,
    and AdamW's weight decay moved them (8e-3 in 2 steps). Warned once, on the stage that finds it."""
    assert distributed.run(_unused_output, 2, schedule) == [[], ["lightning_pipe: stage 1 computed no grad"]]


def _pipeline_after_a_failed_step(rank: int, world: int, peer_builds: bool) -> str:
    _in_place_first_layer(rank, world, "1f1b", "never", "add")  # fails on rank 1, aborts rank 0
    if rank == 1 and not peer_builds:  # gone, or busy elsewhere
        return "did not build"
    start = time.monotonic()
    try:
        Pipeline(partition(mlp(num_layers=2), rank, world), chunks=2, schedule="1f1b")
    except ConfigurationError as error:
        return f"{error} ({time.monotonic() - start:.1f} s)"
    return "built"


@pytest.mark.parametrize("peer_builds", [True, False])
def test_a_new_pipeline_on_a_group_a_step_failed_on_is_refused_on_every_rank(peer_builds):
    """Regression (review S): after a failed step, a new Pipeline on the same process group waited for good (the
    failed step's posted receives and sends pair with the new pipeline's by peer and tag). Review TT: it is refused
    before the constructor's first collective, so also where the peer builds nothing."""
    results = distributed.run(_pipeline_after_a_failed_step, 2, peer_builds, timeout=60)
    refused = results if peer_builds else results[:1]
    assert all("a pipeline step on this process group failed in this process" in r and "new_group" in r
               and r.endswith("(0.0 s)") for r in refused), results


def _labels_refused_on_one_rank(rank: int, world: int) -> str:
    pipe = Pipeline(partition(mlp(num_layers=2), rank, world), chunks=2, schedule="1f1b")
    x, y = _batch("mlp", 8, torch.Generator().manual_seed(3))
    with pytest.raises(ConfigurationError, match="labels split into microbatches of sizes"):
        pipe.forward_backward(x, criterion=nn.functional.mse_loss, labels=(y[:6],))
    Pipeline(partition(mlp(num_layers=2), rank, world), chunks=2, schedule="1f1b")  # the group is not marked failed
    return "built"


def test_labels_of_another_batch_size_on_one_rank_leave_the_group_usable():
    """Review TT: with one rank no message is in flight, so the refusal marks neither the group nor the process
    failed (it did: every later Pipeline on the default group was refused)."""
    assert distributed.run(_labels_refused_on_one_rank, 1) == ["built"]


class _Refusing(nn.Module):
    def forward(self, x):
        raise BodyCallError("refused inside the step")


def _named_error_in_a_step(rank: int, world: int) -> tuple:
    torch.manual_seed(0)
    part = partition(nn.Sequential(nn.Linear(6, 6), _Refusing()).double(), rank, world, balance=[1, 1])
    pipe = Pipeline(part, chunks=2, schedule="1f1b")
    try:
        pipe.forward_backward(torch.randn(4, 6, dtype=torch.float64), criterion=lambda out: out.sum())
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, isinstance(error, BodyCallError), isinstance(error, PipelineStepError)
    return ("trained",)


def test_a_named_error_raised_inside_a_step_is_still_that_error_on_its_rank():
    """Review W: README's "raises BodyCallError" for refusals met inside a step was true of the message only: the
    failing rank raised a plain PipelineStepError. It is now also the named error there (the others stop with
    PipelineAbortedError, naming it)."""
    assert distributed.run(_named_error_in_a_step, 2) == [("PipelineAbortedError", False, False),
                                                          ("PipelineStepError", True, True)]
