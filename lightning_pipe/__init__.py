"""lightning_pipe: pipeline parallelism for PyTorch and PyTorch Lightning."""

from lightning_pipe.batchnorm import DeferredBatchNorm
from lightning_pipe.checkpoint import is_checkpointing, is_recomputing
from lightning_pipe.errors import (
    BatchMismatchError,
    BodyCallError,
    ConfigurationError,
    PartitionError,
    PipelineAbortedError,
    PipelineError,
    PipelineStepError,
    ScheduleError,
    SideEffectError,
    StaleValueError,
)
from lightning_pipe.init import MaterializationError, materialize
from lightning_pipe.microbatch import NoChunk
from lightning_pipe.partition import (
    SequentialModel,
    balance_by_cost,
    balance_by_flops,
    balance_by_layers,
    balance_by_memory,
    balance_by_parameters,
    balance_by_time,
    partition,
)
from lightning_pipe.pipeline import Pipeline
from lightning_pipe.pipelines import GPipe, Interleaved1F1B, PipeDream, ZeroBubbleH1, ZeroBubbleH2, ZeroBubbleV
from lightning_pipe.sharded import (
    CheckpointError,
    CheckpointMismatchError,
    MissingShardError,
    load_sharded,
    save_sharded,
)
from lightning_pipe.lightning.strategy import PipeStrategy
from lightning_pipe.lightning.tracing import PipelineTrace
from lightning_pipe.topology import make_subgroups  # registers the "pipe..." strategy names

__version__ = "0.1.0"

__all__ = [
    "BatchMismatchError",
    "BodyCallError",
    "CheckpointError",
    "CheckpointMismatchError",
    "ConfigurationError",
    "DeferredBatchNorm",
    "GPipe",
    "Interleaved1F1B",
    "MaterializationError",
    "MissingShardError",
    "NoChunk",
    "PartitionError",
    "PipeDream",
    "PipeStrategy",
    "PipelineTrace",
    "Pipeline",
    "PipelineAbortedError",
    "PipelineError",
    "PipelineStepError",
    "ScheduleError",
    "SequentialModel",
    "SideEffectError",
    "StaleValueError",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "ZeroBubbleV",
    "balance_by_cost",
    "balance_by_flops",
    "balance_by_layers",
    "balance_by_memory",
    "balance_by_parameters",
    "balance_by_time",
    "is_checkpointing",
    "is_recomputing",
    "load_sharded",
    "make_subgroups",
    "materialize",
    "partition",
    "save_sharded",
]
