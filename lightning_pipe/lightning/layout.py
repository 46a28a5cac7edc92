"""Where PipeStrategy cuts the LightningModule, decided once per fit on every rank.

:func:`plan` finds the body, makes every rank start from global rank 0's weights, chooses the
balance (given, counted, or measured on one batch by global rank 0, see :mod:`.profile`), gives
this stage of a model built on the meta device its initial values, and builds the
:class:`~.split.SplitModel`. The strategy keeps what it returns. After ``fit``,
:func:`gather_whole_model` undoes the cut where every rank has room for the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_pipe import gradients
from lightning_pipe.batchnorm import DeferredBatchNorm
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.init import materialize
from lightning_pipe.lightning import profile, release
from lightning_pipe.lightning.body import find_body
from lightning_pipe.lightning.layer_list import CallChannel
from lightning_pipe.lightning.split import SplitModel, balance_of
from lightning_pipe.partition import balance_by_cost, split_points


@dataclass
class Layout:
    """What :func:`plan` decided.

    Attributes:
        split: the module split for this stage.
        costs: each layer's measured or counted cost when balanced by measurement, else None.
        sharded: whether checkpoints are written sharded (``state_dict_type``, or by default
            whether the model was built on the meta device).
    """

    split: SplitModel
    costs: Optional[List[float]]
    sharded: bool


def object_device(group: Any, device: torch.device) -> Optional[torch.device]:
    """Where ``broadcast_object_list`` stages its bytes: the device under NCCL, the CPU otherwise."""
    return device if dist.get_backend(group) == "nccl" else None


def plan(strategy: Any, module: nn.Module, trainer: Any) -> Layout:
    """Cut ``module`` as ``strategy`` (a :class:`~.strategy.PipeStrategy` after its environment is set up) asks."""
    if strategy.deferred_batch_norm:
        DeferredBatchNorm.convert_deferred_batch_norm(module)
    path, body = find_body(module, strategy.body)
    lazy = [name for name, t in list(module.named_parameters()) + list(module.named_buffers())
            if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    if lazy:  # every rank has the same module here: all raise, before any collective
        more = f" and {len(lazy) - 4} more" if len(lazy) > 4 else ""
        raise ConfigurationError(
            f"the model has uninitialized (lazy) parameters or buffers: {lazy[:4]}{more}. "
            "PipeStrategy splits the model by its parameters before the first step, as DDP wraps it; run a dummy "
            "forward in __init__ (or give the layers their sizes: nn.Linear instead of nn.LazyLinear)")
    _refuse_router_logits(module)
    built_on_meta = any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))
    gradients.broadcast_module(module, strategy.root_device)  # every stage and replica starts from rank 0's weights
    balance, costs = strategy.balance, None
    if isinstance(balance, str) and balance != "parameters":
        if built_on_meta and balance != "flops":
            raise ConfigurationError(f"PipeStrategy(balance={balance!r}) runs the whole model on one device, but it "
                                     "was built on the meta device; use balance='flops' or layer counts")
        if built_on_meta and strategy.global_rank == 0:
            # the step runs up to the body on real values of the code before it (Hugging Face's mask code reads its
            # embeddings' output); rank 0, the first stage, materializes the modules outside the body anyway
            _materialize_outside(module, path)
        costs = _measure(strategy, balance, module, path, body, trainer)
        balance = balance_by_cost(costs, len(strategy.stage_ranks))
    balance = balance_of(body, None if balance == "parameters" else balance, strategy.pp_size, path,
                         strategy.stages_per_rank)
    if built_on_meta:
        _materialize(strategy, module, path, body, balance)
    channel = CallChannel(dist.PrefixStore("lightning_pipe/calls/", dist.distributed_c10d._get_default_store()))
    split = SplitModel(module, path, body, balance, strategy.stage_index, strategy.stage_ranks, channel)
    sharded = strategy.state_dict_type == "sharded" or strategy.state_dict_type is None and built_on_meta
    return Layout(split, costs, sharded)


def _refuse_router_logits(module: nn.Module) -> None:
    """A Hugging Face mixture-of-experts model set to return its router logits collects them with forward hooks
    inside its blocks, for a load-balancing loss the step computes from all of them; the blocks run on their stages,
    outside the step, so the loss would see none (transformers then fails with an IndexError). Named here, on every
    rank before any collective."""
    routed = [name for name, m in module.named_modules()
              if getattr(getattr(m, "config", None), "output_router_logits", False) is True]
    if routed:
        raise ConfigurationError(
            f"`{routed[0]}` has config.output_router_logits=True: this mixture-of-experts model then collects every "
            "layer's router logits from inside the blocks for its load-balancing (auxiliary) loss, and under "
            "PipeStrategy the blocks run on their stages, outside the step that computes the loss, so none would reach "
            "it. Set config.output_router_logits=False (the routers still train through the experts' weighted "
            "outputs, without the auxiliary loss), or train the model without PipeStrategy")


def _materialize(strategy: Any, module: nn.Module, path: str, body: nn.Module, balance: List[int]) -> None:
    """Give this rank's layers, and the modules outside the body if it runs them, their initial values.

    The values are the modules' own ``reset_parameters()`` under a seed per module name (see
    :func:`lightning_pipe.materialize`): the same for every layout, and the same as
    ``materialize(model, device, seed)`` on one device, with ``seed`` global rank 0's
    ``torch.initial_seed()`` (what ``seed_everything`` set).
    """
    box = [torch.initial_seed() if strategy.global_rank == 0 else None]
    dist.broadcast_object_list(box, src=0, device=object_device(dist.group.WORLD, strategy.root_device))
    ranks, names = strategy.stage_ranks, list(body._modules)
    local = {f"{path}.{name}" for s, (start, stop) in enumerate(split_points(balance)) if ranks[s] == strategy.stage_index
             for name in names[start:stop]}
    runs_outside = strategy.stage_index in (ranks[0], ranks[-1])

    def include(name: str) -> bool:
        if _in_body(name, path):
            return any(name == n or name.startswith(n + ".") for n in local)
        return runs_outside

    materialize(module, strategy.root_device, seed=box[0] % (1 << 63), include=include)


def _materialize_outside(module: nn.Module, path: str) -> None:
    """The modules outside the body, on the CPU, as :func:`_materialize` gives them (the same seed, global rank 0's
    ``torch.initial_seed()``): that later call leaves them as they are, having no meta tensors left."""
    materialize(module, "cpu", seed=torch.initial_seed() % (1 << 63), include=lambda name: not _in_body(name, path))


def _in_body(name: str, path: str) -> bool:
    """Whether the module named ``name`` is the body at ``path`` or inside it."""
    return name == path or name.startswith(path + ".")


def _measure(strategy: Any, kind: str, module: nn.Module, path: str, body: nn.Module, trainer: Any) -> List[float]:
    """Global rank 0 costs each layer on a sample batch; every rank gets its numbers (see :mod:`.profile`)."""
    box: List[Any] = [None]
    if strategy.global_rank == 0:
        # FLOPs are counted on meta stand-ins: that model stays where it is, meta parts included
        device = strategy.root_device if kind != "flops" else torch.device("cpu")
        if kind != "flops":
            module.to(device)
        try:
            with strategy.precision_plugin.train_step_context():
                batch = strategy.batch_to_device(profile.sample_batch(trainer), device)
                box = [profile.layer_costs(kind, module, path, body, batch)]
        finally:
            if kind != "flops":
                module.to("cpu")
    dist.broadcast_object_list(box, src=0, device=object_device(dist.group.WORLD, strategy.root_device))
    return box[0]


def gather_whole_model(strategy: Any, checkpoints: Any) -> None:
    """Put the whole model back into the LightningModule on every rank (a collective), if every rank has room.

    Otherwise each rank keeps its stage, the module refuses to run, and a warning points to the
    checkpoints, which always hold the whole model. ``checkpoints`` is the strategy's
    :class:`~.state.Checkpoints`, which gathers the weights into global rank 0.
    """
    module, device, split = strategy.lightning_module, strategy.root_device, strategy.split
    fits = torch.tensor(int(2 * release.model_bytes(module) < release.available_bytes(device)))
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if not fits.item():
        split.stand_in.mode = "released"
        rank_zero_warn("PipeStrategy: the whole model does not fit on every rank, so it was not gathered after "
                       "fit; each rank keeps its stage. Load the whole model from a checkpoint instead")
        return
    box = [checkpoints.module_state()]
    dist.broadcast_object_list(box, src=0, device=object_device(dist.group.WORLD, device))
    split.install(whole=True)
    split.drop_hooks()  # the whole model runs anywhere now: released modules and stage-owned gradients alike
    strategy.precision_plugin.convert_module(module)  # other stages' layers were never converted
    release.unrelease(module, device)
    module.to(device)
    module.load_state_dict(box[0])
    split.take_layer_state_from_owners()  # what hooks set on the stages' layers, each on its owners' copies
