"""Finding a LightningModule's sequential body and standing in for it on each stage.

The body is the one ``nn.Sequential`` attribute of the LightningModule that gets pipelined. On
every rank it is replaced by a :class:`PipelinedBody` that holds only the local stage's layers,
under their original names (so ``state_dict`` keys stay those of the unpartitioned model). What a
call to the body does depends on where the step is: run the local layers, stop the user's step on
the first stage once the body is reached, or return the output that the pipeline computed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Optional, Tuple

from torch import nn

from lightning_pipe.checkpoint import checkpointed
from lightning_pipe.errors import ConfigurationError
from lightning_pipe.partition import SequentialModel
from lightning_pipe.skip.tracker import current_tracker, use_tracker


def find_body(module: nn.Module, body: Optional[str] = None) -> Tuple[str, nn.Sequential]:
    path, found = _find(module, body)
    if isinstance(found, PipelinedBody):
        raise ConfigurationError(
            f"`{path}` holds only stage {found.stage_index} of a body split by an earlier PipeStrategy run with "
            "gather_full_model=False; build the module anew or load it from a checkpoint"
        )
    return path, found


def _find(module: nn.Module, body: Optional[str]) -> Tuple[str, nn.Sequential]:
    """Return ``(attribute path, module)`` of the body: ``body`` if given, else the only candidate.

    Candidates are the ``nn.Sequential`` submodules not nested inside another ``nn.Sequential``.

    Raises:
        ConfigurationError: the named body is not an ``nn.Sequential``, or there is none or several.
    """
    if body is not None:
        try:
            found = module.get_submodule(body)
        except AttributeError as exc:
            raise ConfigurationError(f"PipeStrategy(body={body!r}): {type(module).__name__} has no submodule {body!r}") from exc
        if not isinstance(found, nn.Sequential):
            raise ConfigurationError(
                f"PipeStrategy(body={body!r}) names a {type(found).__name__}; the body must be an nn.Sequential "
                "(or lightning_pipe.SequentialModel) whose children are the layers to split"
            )
        return body, found
    candidates = _candidates(module)
    if len(candidates) == 1:
        return candidates[0], module.get_submodule(candidates[0])
    if not candidates:
        raise ConfigurationError(
            f"{type(module).__name__} has no nn.Sequential attribute to pipeline. Put the layers to split into an "
            "nn.Sequential (e.g. `self.body = nn.Sequential(...)`) and call it from training_step"
        )
    raise ConfigurationError(
        f"{type(module).__name__} has several nn.Sequential attributes: {candidates}. Name the one to pipeline "
        f"with PipeStrategy(body=...), e.g. PipeStrategy(body={candidates[0]!r})"
    )


def _candidates(module: nn.Module) -> List[str]:
    found = []
    for name, child in module.named_modules():
        if not name or not isinstance(child, nn.Sequential):
            continue
        if any(name.startswith(outer + ".") for outer in found):
            continue
        found.append(name)
    return found


def set_submodule(root: nn.Module, path: str, value: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, value)


class BodyReached(Exception):
    """Raised inside the user's step on the first stage once the body has produced its output."""

    def __init__(self, outputs: tuple) -> None:
        super().__init__("the first stage reached the end of its part of the body")
        self.outputs = outputs


class PipelinedBody(nn.Sequential):
    """This stage's layers of the body, called from the user's unchanged step.

    Modes: ``"local"`` runs the local layers; ``"stop"`` runs them and raises
    :class:`BodyReached` with the result (first stage); ``"replace"`` ignores its input and
    returns ``replacement`` (last stage: the output the pipeline computed); ``"released"`` refuses
    to run (after ``fit`` without gathering the whole model). With
    ``checkpoint_layers`` set, the local layers run under activation checkpointing: on the first
    stage only the layers are recomputed, never the user's code around the body call.
    """

    def __init__(self, layers: "OrderedDict[str, nn.Module]", multi_value: bool, stage_index: int, num_stages: int) -> None:
        super().__init__(layers)
        self.multi_value = multi_value
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.mode = "local"
        self.replacement: Optional[tuple] = None
        self.checkpoint_layers = False

    def run_layers(self, *inputs):
        if self.multi_value:
            return SequentialModel.forward(self, *inputs)
        if len(inputs) != 1:
            raise ConfigurationError(
                f"the body is an nn.Sequential, which takes one input, but stage {self.stage_index} got {len(inputs)}; "
                "use lightning_pipe.SequentialModel for layers that pass several values"
            )
        return nn.Sequential.forward(self, inputs[0])

    def forward(self, *inputs):
        if self.mode == "released":
            raise ConfigurationError(
                f"this body was trained under PipeStrategy(gather_full_model=False) and this process holds only "
                f"stage {self.stage_index} of {self.num_stages}; load the whole model from a checkpoint "
                "(Module.load_from_checkpoint) or train with gather_full_model=True"
            )
        if self.mode == "replace":
            outputs = self.replacement
            return outputs[0] if len(outputs) == 1 else outputs
        if self.checkpoint_layers:
            tracker = current_tracker()  # the recomputation runs later, in backward: bind it again then

            def run(*args):
                with use_tracker(tracker):
                    return self.run_layers(*args)

            outputs = checkpointed(run, *inputs)
        else:
            outputs = self.run_layers(*inputs)
        if self.mode == "stop":
            raise BodyReached(outputs if isinstance(outputs, tuple) else (outputs,))
        return outputs
