"""lightning_pipe: pipeline parallelism for PyTorch and PyTorch Lightning."""

from lightning_pipe.batchnorm import DeferredBatchNorm
from lightning_pipe.checkpoint import is_checkpointing, is_recomputing
from lightning_pipe.errors import (
    BodyCallError,
    ConfigurationError,
    PartitionError,
    PipelineAbortedError,
    PipelineError,
    PipelineStepError,
    ScheduleError,
    SideEffectError,
)
from lightning_pipe.microbatch import NoChunk
from lightning_pipe.partition import SequentialModel, balance_by_layers, balance_by_parameters, partition
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.pipelines import GPipe, Interleaved1F1B, PipeDream, ZeroBubbleH1, ZeroBubbleV
from lightning_pipe.lightning.strategy import PipeStrategy
from lightning_pipe.topology import make_subgroups  # registers "pipe", "pipe_1f1b", "pipe_gpipe"

__version__ = "0.1.0"

__all__ = [
    "BodyCallError",
    "ConfigurationError",
    "DeferredBatchNorm",
    "GPipe",
    "Interleaved1F1B",
    "NoChunk",
    "PartitionError",
    "PipeDream",
    "PipeStrategy",
    "Pipeline",
    "PipelineAbortedError",
    "PipelineError",
    "PipelineStepError",
    "ScheduleError",
    "SequentialModel",
    "SideEffectError",
    "ZeroBubbleH1",
    "ZeroBubbleV",
    "balance_by_layers",
    "balance_by_parameters",
    "is_checkpointing",
    "is_recomputing",
    "make_subgroups",
    "partition",
]
