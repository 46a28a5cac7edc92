"""PipeStrategy's configuration checks and pieces, without starting processes."""

from __future__ import annotations

import re
from collections import OrderedDict
from datetime import timedelta
from types import SimpleNamespace
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_pipe import ConfigurationError, PipeStrategy
from lightning_pipe.lightning.body import PipelinedSequential, find_body


class TwoBodies(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(2, 2))
        self.decoder = nn.Sequential(nn.Linear(2, 2))
        self.head = nn.Linear(2, 1)


class OneBody(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))  # nested: one candidate
        self.head = nn.Linear(2, 1)


def test_find_body_detects_the_only_sequential():
    path, body = find_body(OneBody())
    assert path == "blocks" and len(body) == 2


def test_find_body_lists_the_candidates_when_ambiguous():
    with pytest.raises(ConfigurationError, match=r"several bodies to choose from: \['encoder', 'decoder'\], none holding "
                                                 r"most of the parameters. Name the one to pipeline with PipeStrategy\(body=...\)"):
        find_body(TwoBodies())
    assert find_body(TwoBodies(), "decoder")[0] == "decoder"


def test_blocks_held_in_a_module_dict_are_named_instead_of_an_inner_list():
    """Review HHH: blocks in an nn.ModuleDict (looped over with `.items()`) got the advice to pipeline one block's
    inner Sequential (`body='layers.h0.mlp'`); the message now names the ModuleDict."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    class DictBlocks(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({f"h{i}": Block() for i in range(3)})

    with pytest.raises(ConfigurationError, match=r"several bodies to choose from: \['layers.h0.mlp', .*; `self\.layers`, "
                                                 r"which holds most of them, is an nn\.ModuleDict, which cannot be a body"):
        find_body(DictBlocks())


def test_a_body_compiled_whole_is_refused_and_compiled_blocks_are_taken():
    """Regression: `self.blocks = torch.compile(self.blocks)` stopped the first step with 'Tensor device mismatch'
    (its graph spans every layer, most of them meta on a stage), and a LightningModule given to fit compiled with
    a recursion error inside dynamo."""
    model = OneBody()
    model.blocks = torch.compile(model.blocks)
    with pytest.raises(ConfigurationError, match=r"`self\.blocks` is torch\.compile'd whole: .* Compile the blocks "
                                                 r"instead, each on its own"):
        find_body(model)
    with pytest.raises(ConfigurationError, match=r"`self\.blocks` is torch\.compile'd whole"):
        find_body(model, "blocks._orig_mod")
    model = OneBody()
    model._compiler_ctx = {"compiler": "dynamo"}  # what Lightning keeps of `trainer.fit(torch.compile(model))`
    with pytest.raises(ConfigurationError, match=r"OneBody was given to the Trainer torch\.compile'd whole"):
        find_body(model)
    # review JJ: a module holding the body compiled (here the LightningModule in place, or a wrapper) failed in the
    # first step with dynamo's RecursionError
    model = OneBody()
    model.compile()
    with pytest.raises(ConfigurationError, match=r"OneBody is compiled in place \(`\.compile\(\)`\): .* body `self\.blocks`"):
        find_body(model)
    model = OneBody()
    model.net = torch.compile(nn.ModuleDict({"blocks": model.blocks}))
    del model.blocks
    with pytest.raises(ConfigurationError, match=r"`self\.net` is torch\.compile'd whole: .* `self\.net\._orig_mod\.blocks`"):
        find_body(model)
    model = OneBody()  # review LL: a compiled method of a module holding the body (a Hugging Face pattern)
    model.forward = torch.compile(model.forward)
    with pytest.raises(ConfigurationError, match=r"OneBody's `forward` is torch\.compile'd: .* body `self\.blocks`"):
        find_body(model)
    model = OneBody()
    model.training_step = torch.compile(model.training_step)
    with pytest.raises(ConfigurationError, match=r"OneBody's `training_step` is torch\.compile'd"):
        find_body(model)
    model = OneBody()
    model.blocks = nn.Sequential(*[torch.compile(block) for block in model.blocks])
    model.blocks[1].compile()
    assert find_body(model)[0] == "blocks"  # blocks compiled one by one: each stage runs its own
    model = OneBody()
    model.blocks.compile()  # in place: the step calls the body's stand-in, which is not compiled
    assert find_body(model)[0] == "blocks"


def test_a_backward_hook_on_the_body_itself_is_refused_and_forward_hooks_are_taken():
    """Forward hooks on the body run on its stand-in (tests/lm_app.py BodyHooks, against DDP); a backward hook needs
    the gradients of the whole body's input and output in one process, which none holds."""
    model = OneBody()
    model.blocks.register_forward_hook(lambda module, args, out: out)
    assert find_body(model)[0] == "blocks"
    model.blocks.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    with pytest.raises(ConfigurationError, match=r"`self\.blocks`, the body, has a backward hook of its own"):
        find_body(model)


class LayerListModel(pl.LightningModule):
    """Blocks in a ModuleList (the body), plus a small nn.Sequential head: the list holds most parameters."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
        self.head = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 5))


def test_find_body_takes_a_module_list_and_prefers_the_candidate_holding_most_parameters():
    path, body = find_body(LayerListModel())
    assert path == "layers" and isinstance(body, nn.ModuleList) and len(body) == 3
    assert find_body(LayerListModel(), "head")[0] == "head"


def test_find_body_errors_name_the_fix():
    with pytest.raises(ConfigurationError, match="has no nn.Sequential or nn.ModuleList attribute to pipeline"):
        find_body(nn.Linear(2, 2))
    with pytest.raises(ConfigurationError, match=r"body='head'\) names a Linear; the body must be an nn.Sequential .* or an nn.ModuleList"):
        find_body(TwoBodies(), "head")
    with pytest.raises(ConfigurationError, match="TwoBodies has no submodule 'missing'"):
        find_body(TwoBodies(), "missing")


def test_a_released_body_fails_loudly_and_cannot_be_split_again():
    module = OneBody()
    module.blocks = PipelinedSequential([OrderedDict(first=nn.Linear(2, 2))], False, (0,), 2)
    module.blocks.mode = "released"
    with pytest.raises(ConfigurationError, match="holds only stage 0 of 2"):
        module.blocks(torch.ones(1, 2))
    with pytest.raises(ConfigurationError, match="gather_full_model=False"):
        find_body(module)


@pytest.mark.parametrize("kwargs, message", [
    ({"pipe_size": 0}, r"pipe_size=0\): give a positive integer"),
    ({"num_microbatches": 2.5}, r"num_microbatches=2.5\)"),
    ({"schedule": "zb"}, r"schedule='zb'\): choose one of \['1f1b', 'gpipe', 'interleaved_1f1b', 'zb_h1', 'zb_h2', 'zbv'\]"),
    ({"schedule": "zbv", "virtual_stages": 3}, r"schedule='zbv', virtual_stages=3\): 'zbv' runs exactly 2 stages per "
                                               r"rank; .*leave virtual_stages out"),
    ({"schedule": "interleaved_1f1b"}, r"schedule='interleaved_1f1b', virtual_stages=None\): the schedule runs several "
                                       r"stages per rank; pass virtual_stages >= 2"),
    ({"schedule": "interleaved_1f1b", "virtual_stages": 1}, r"virtual_stages=1\): .*pass virtual_stages >= 2"),
    ({"virtual_stages": 2}, r"schedule='1f1b', virtual_stages=2\): '1f1b' runs one stage per rank; for several use "
                            r"schedule='interleaved_1f1b'"),
    ({"schedule": "zb_h1", "virtual_stages": 2}, r"'zb_h1' runs one stage per rank"),
    ({"schedule": "interleaved_1f1b", "virtual_stages": 0}, r"virtual_stages=0\): give a positive integer"),
    ({"schedule": "interleaved_1f1b", "virtual_stages": True}, r"virtual_stages=True\): give a positive integer"),
    ({"checkpoint": "sometimes"}, r"checkpoint must be one of"),
    ({"start_method": "spawn"}, r"start_method='spawn'\): choose one of \['popen'\]; the spawn and fork launchers"),
    ({"loss_reduction": "token_mean"}, r"loss_reduction='token_mean'\): choose one of \['mean', 'sum'\]"),
    ({"timeout": "30s"}, r"timeout='30s'\): give a datetime.timedelta or a positive number of seconds"),
    ({"timeout": -1}, r"timeout=-1\): give a datetime.timedelta or a positive number of seconds"),
    ({"timeout": float("inf")}, r"timeout=inf\): give a datetime.timedelta or a positive number of seconds"),
    # review SS: accepted here, then a bare TypeError at fit (balance) or taken as true (the flags)
    ({"balance": 3}, r"balance=3\): give layer counts or one of \['parameters', 'time', 'memory', 'flops'\]"),
    ({"balance": [2, 2.5]}, r"balance=\[2, 2.5\]\): give layer counts"),
    ({"deferred_batch_norm": "yes"}, r"deferred_batch_norm='yes'\) takes True or False"),
    ({"gather_full_model": "no"}, r"gather_full_model='no'\) takes True or False"),
    ({"log_pipeline_metrics": 3}, r"log_pipeline_metrics=3\) takes True or False"),
])
def test_bad_arguments_raise_named_errors(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        PipeStrategy(**kwargs)


def test_layer_counts_and_flags_from_configs_are_taken():
    """Review TT: a balance given as any sequence of integers (a tuple, numpy's, a Hydra/OmegaConf ListConfig, here a
    UserList) and numpy's bools are what configs pass; they were refused once PipeStrategy checked its arguments."""
    import collections

    import numpy as np

    for balance in ((3, 5), np.array([3, 5]), collections.UserList([3, 5]), [np.int64(3), 5]):
        strategy = PipeStrategy(balance=balance, deferred_batch_norm=np.True_)
        assert strategy.balance == [3, 5] and type(strategy.balance[0]) is int
    assert PipeStrategy(balance="flops").balance == "flops"


def test_a_timeout_in_seconds_is_taken_as_a_timedelta():
    """Regression: a number (as a LightningCLI yaml gives it) reached init_process_group and failed there with
    torch's TypeError, after the processes had started."""
    assert PipeStrategy(timeout=90)._timeout == timedelta(seconds=90)
    assert PipeStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(minutes=2)


def test_registered_names_pick_the_schedule():
    for name, schedule, ranks in (("pipe", "1f1b", (0, 1)), ("pipe_1f1b", "1f1b", (0, 1)), ("pipe_gpipe", "gpipe", (0, 1)),
                                  ("pipe_zb_h1", "zb_h1", (0, 1)), ("pipe_zb_h2", "zb_h2", (0, 1)),
                                  ("pipe_interleaved_1f1b", "interleaved_1f1b", (0, 1, 0, 1)),
                                  ("pipe_zbv", "zbv", (0, 1, 1, 0))):
        assert name in StrategyRegistry
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert isinstance(trainer.strategy, PipeStrategy) and trainer.strategy.schedule == schedule
        assert trainer.strategy.stage_ranks == ranks


def _environment(devices, rank):
    environment = LightningEnvironment()
    environment.set_world_size(devices)
    environment.set_global_rank(rank)
    return environment


def _strategy(devices, pipe_size, rank):
    return PipeStrategy(pipe_size=pipe_size, parallel_devices=[torch.device("cpu")] * devices,
                        cluster_environment=_environment(devices, rank))


def test_layout_puts_pp_outermost_and_shards_data_over_replicas():
    # 4 processes, 2 stages x 2 replicas: ranks 0,1 are stage 0; ranks 2,3 stage 1
    layout = [(s.stage_index, s.dp_rank, s.distributed_sampler_kwargs) for s in (_strategy(4, 2, r) for r in range(4))]
    assert layout == [
        (0, 0, {"num_replicas": 2, "rank": 0}), (0, 1, {"num_replicas": 2, "rank": 1}),
        (1, 0, {"num_replicas": 2, "rank": 0}), (1, 1, {"num_replicas": 2, "rank": 1}),
    ]


def test_interleaving_needs_a_pipeline_of_several_processes_before_any_collective():
    environment = LightningEnvironment()
    strategy = PipeStrategy(schedule="interleaved_1f1b", virtual_stages=2, parallel_devices=[torch.device("cpu")] * 2,
                            pipe_size=1, cluster_environment=environment)
    with mock.patch("torch.distributed.init_process_group") as init:
        with pytest.raises(ConfigurationError, match=r"virtual_stages=2\) places 2 stages on each process of a pipeline "
                                                     r"of several, but pipe_size is 1 \(2 processes\); use "
                                                     r"pipe_size >= 2"):
            strategy.setup_environment()
    init.assert_not_called()


@pytest.mark.parametrize("schedule, virtual_stages", [("zb_h2", None), ("zbv", None), ("interleaved_1f1b", 2)])
def test_schedules_the_nccl_transport_could_deadlock_are_refused_over_nccl_before_any_collective(schedule, virtual_stages):
    """The NCCL transport groups the sends and receives between two compute actions; under these schedules
    two ranks' groups can each wait for the other's (ZB-H2, p=2, m=4: rank 0 groups SF3 with RB1 and then
    posts RB2, rank 1 sends SB2 before it posts RF3)."""
    strategy = PipeStrategy(schedule=schedule, virtual_stages=virtual_stages, process_group_backend="nccl",
                            parallel_devices=[torch.device("cpu")] * 2, cluster_environment=_environment(2, 0))
    with mock.patch("torch.distributed.init_process_group") as init:
        with pytest.raises(ConfigurationError, match=rf"schedule '{schedule}' does not run over NCCL yet: .*use a gloo "
                                                     r"process group, or 'gpipe', '1f1b' or 'zb_h1'"):
            strategy.setup_environment()
    init.assert_not_called()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pipe_size_that_does_not_divide_the_processes_is_refused_before_any_collective(rank):
    """Every rank refuses it before the process group exists; reporting the failure names the rank (it
    raised ZeroDivisionError over the ConfigurationError: no stage exists with 0 replicas)."""
    strategy = _strategy(2, 3, rank)
    with mock.patch("torch.distributed.init_process_group") as init:
        with pytest.raises(ConfigurationError, match=r"PipeStrategy\(pipe_size=3\) must divide the number of processes "
                                                     r"\(devices x num_nodes = 2\); use a pipe_size among \[1, 2\]") as error:
            strategy.setup_environment()
    init.assert_not_called()
    with mock.patch("lightning_pipe.lightning.strategy.note_failure"):  # this test process keeps its exit handler
        strategy.on_exception(error.value)


def test_interleaved_and_v_placements_and_the_first_and_last_stage():
    """Megatron order: process r of the pipeline holds stages r, r + p, ...; the last stage is on process p - 1."""
    strategies = [PipeStrategy(pipe_size=2, schedule="interleaved_1f1b", virtual_stages=3,
                               parallel_devices=[torch.device("cpu")] * 4, cluster_environment=_environment(4, r))
                  for r in range(4)]
    assert strategies[0].stage_ranks == (0, 1, 0, 1, 0, 1)
    assert [(s.stage_index, s.is_first_stage, s.is_last_stage) for s in strategies] == [
        (0, True, False), (0, True, False), (1, False, True), (1, False, True)]
    # ZB-V: process r holds stages r and 2p - 1 - r; the first and the last stage are both on process 0
    strategies = [PipeStrategy(pipe_size=3, schedule="zbv", parallel_devices=[torch.device("cpu")] * 3,
                               cluster_environment=_environment(3, r)) for r in range(3)]
    assert strategies[0].stage_ranks == (0, 1, 2, 2, 1, 0)
    assert [(s.is_first_stage, s.is_last_stage) for s in strategies] == [(True, True), (False, False), (False, False)]


def test_a_body_with_fewer_layers_than_stages_or_a_short_balance_is_refused_with_the_counts():
    from lightning_pipe import PartitionError
    from lightning_pipe.lightning.split import balance_of

    with pytest.raises(PartitionError, match=r"PipeStrategy\(pipe_size=2\) with 2 stages per process cuts the body into "
                                             r"4 stages and needs at least 4 layers, but the body `blocks` has 3; use "
                                             r"pipe_size \* 2 <= 3"):
        balance_of(nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)]), None, 2, "blocks", virtual_stages=2)
    assert balance_of(nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]), None, 2, "blocks", virtual_stages=2) == [1] * 4
    with pytest.raises(PartitionError, match=r"PipeStrategy\(balance=\[2, 2\]\) has 2 entries, but pipe_size=2 with 2 "
                                             r"stages per process makes 4 stages; give one layer count per stage"):
        balance_of(nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]), [2, 2], 2, "blocks", virtual_stages=2)


def test_lazy_parameters_are_refused_by_name_before_any_collective():
    """Regression: torch's "Attempted to use an uninitialized parameter" from the split (DDP refuses them too)."""
    from lightning_pipe.lightning.layout import plan

    class Lazy(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(*[nn.LazyLinear(4) for _ in range(6)])

    with pytest.raises(ConfigurationError, match=r"uninitialized \(lazy\) parameters or buffers: \['body\.0\.weight', "
                                                 r"'body\.0\.bias', 'body\.1\.weight', 'body\.1\.bias'\] and 8 more\. "
                                                 r".*run a dummy forward in __init__"):
        plan(SimpleNamespace(deferred_batch_norm=False, body=None), Lazy(), None)  # no process group: none used


def test_a_mixture_of_experts_returning_its_router_logits_is_refused_by_name_before_any_collective():
    """Regression: Mixtral with output_router_logits=True crashed in the last stage's step with transformers'
    IndexError (the router logits are recorded by hooks inside the blocks, which run outside the step)."""
    transformers = pytest.importorskip("transformers")
    from lightning_pipe.lightning.layout import plan

    class Moe(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
                vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1, output_router_logits=True))

    with pytest.raises(ConfigurationError, match=r"`model` has config.output_router_logits=True.*"
                                                 r"Set config.output_router_logits=False"):
        plan(SimpleNamespace(deferred_batch_norm=False, body=None), Moe(), None)  # no process group: none used


def test_a_collective_over_every_process_from_inside_the_step_is_refused_by_name():
    """Regression: trainer.strategy.barrier() after the body ran on the last stage only and waited until the
    timeout, then failed with gloo's "Connection closed by peer"."""
    strategy = PipeStrategy()
    strategy._runner = SimpleNamespace(in_step=True, hook="training_step")
    with mock.patch.object(PipeStrategy, "world_size", 2):
        for call, name in ((lambda: strategy.barrier(), "trainer.strategy.barrier()"),
                           (lambda: strategy.broadcast(1), "trainer.strategy.broadcast()"),
                           (lambda: strategy.reduce_boolean_decision(True), "trainer.strategy.reduce_boolean_decision()"),
                           (lambda: strategy.save_checkpoint({}, "x.ckpt"), "trainer.save_checkpoint()")):
            with pytest.raises(ConfigurationError, match=rf"training_step called {re.escape(name)}, a collective over "
                                                         r"every process\. Under PipeStrategy the step runs on the first"):
                call()
        strategy._runner.in_step = False
        strategy.barrier()  # outside the step: the collective (no process group here: nothing to wait for)


def test_pipe_size_must_divide_the_world_before_any_collective():
    strategy = _strategy(4, 3, 0)
    with mock.patch("torch.distributed.init_process_group") as init:
        with pytest.raises(ConfigurationError, match=r"pipe_size=3\) must divide the number of processes "
                                                     r"\(devices x num_nodes = 4\); use a pipe_size among \[1, 2, 4\]"):
            strategy.setup_environment()
    init.assert_not_called()


def _setup(strategy, module, precision=None, **trainer):
    strategy.accelerator = mock.Mock()
    strategy.connect(module)
    if precision is not None:
        strategy.precision_plugin = precision
    strategy.setup(SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), **trainer))


def test_manual_optimization_is_refused():
    module = OneBody()
    module.automatic_optimization = False
    with pytest.raises(ConfigurationError, match="supports automatic optimization only"):
        _setup(_strategy(2, 2, 0), module)


def test_a_backward_override_is_refused_where_the_pipeline_would_skip_it():
    """The pipeline computes the gradients itself: a LightningModule.backward override would never run (a review
    probe's `(loss * 3).backward()` trained unlike DDP, without a word)."""
    class OwnBackward(OneBody):
        def backward(self, loss, *args, **kwargs):
            (loss * 3).backward()

    with pytest.raises(ConfigurationError, match="overrides LightningModule.backward"):
        _setup(_strategy(2, 2, 0), OwnBackward())


def test_a_time_based_validation_interval_is_refused_where_the_stages_would_disagree():
    """Review N: Lightning decides a time-based val_check_interval on each process's clock (training_epoch_loop.py,
    2.6.6), so one stage could start validating while another trains on: refused at setup, on every rank."""
    with pytest.raises(ConfigurationError, match=r"validates after 3600.0 seconds, which each process measures"):
        _setup(_strategy(2, 2, 0), OneBody(), _val_check_time_interval=3600.0)


def test_sync_batchnorm_over_replicas_is_refused_and_over_one_replica_changes_nothing():
    """Review MM: Trainer(sync_batchnorm=True) was ignored without a word (2 stages x 2 replicas trained as without
    it); over one replica it is plain BatchNorm, as under DDP on one device."""
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    strategy = _strategy(4, 2, 0)
    strategy._layer_sync = TorchSyncBatchNorm()
    with pytest.raises(ConfigurationError, match=r"sync_batchnorm=True\) .* over 2 replicas: .* Remove sync_batchnorm"):
        _setup(strategy, OneBody())
    strategy = _strategy(2, 2, 0)
    strategy._layer_sync = TorchSyncBatchNorm()
    with pytest.raises(AttributeError, match="callbacks"):  # past the check, to what this stand-in trainer lacks
        _setup(strategy, OneBody())


def test_fp16_loss_scaler_is_shared_by_the_job_in_the_same_state():
    """The plugin's GradScaler becomes a ShardedGradScaler over the world, keeping its settings and scale."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from lightning_pipe.lightning.scaling import loss_scale, share_loss_scaler

    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    precision = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    share_loss_scaler(precision, torch.device("cpu"))
    shared = precision.scaler
    assert isinstance(shared, ShardedGradScaler) and shared.state_dict() == scaler.state_dict()
    assert loss_scale(precision, torch.device("cpu")) == 512.0
    assert loss_scale(MixedPrecision("bf16-mixed", device="cpu"), torch.device("cpu")) == 1.0
