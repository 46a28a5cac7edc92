"""Seeing a PipeStrategy run's steps: a callback that writes timelines, and metrics for the logger.

:class:`PipelineTrace` records chosen training batches on every rank and writes one Chrome trace
(``pipeline_trace.json``, opens in ui.perfetto.dev and chrome://tracing) and a picture
(``pipeline_timeline.png``: the measured step above its simulated plan) into the logger's folder.
:func:`step_metrics` turns one recorded step into the ``pipe/`` values PipeStrategy logs every
``log_every_n_steps`` steps.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.trace import Recorder, StepRecord, pipeline_metrics


def step_metrics(records: List[StepRecord], batch_size: int) -> Dict[str, float]:
    """``pipe/`` metrics of the recorded steps of every stage of a pipeline.

    ``pipe/bubble_fraction`` (the share of stage-time not spent computing), per stage
    ``pipe/busy_fraction/stage_<s>`` and ``pipe/wait_seconds/stage_<s>`` (time in communication
    per step), ``pipe/step_seconds`` and ``pipe/samples_per_second`` (``batch_size`` is the
    samples of one step over all replicas).
    """
    metrics = pipeline_metrics(records, batch_size)
    out = {"pipe/bubble_fraction": metrics.bubble_fraction, "pipe/step_seconds": metrics.step_seconds,
           "pipe/samples_per_second": metrics.samples_per_second}
    for s, (busy, wait) in enumerate(zip(metrics.busy_fraction, metrics.wait_seconds)):
        out[f"pipe/busy_fraction/stage_{s}"] = busy
        out[f"pipe/wait_seconds/stage_{s}"] = wait
    return out


class PipelineTrace(Callback):
    """Record training batches ``first .. first + count - 1`` of a PipeStrategy run and draw them.

    Every rank records its actions (compute, sends, receives, waits); after the last of those
    batches the records meet on global rank 0, which writes ``pipeline_trace.json`` and, when
    matplotlib is installed (``pip install lightning-pipe[plot]``), ``pipeline_timeline.png`` into
    ``dirpath`` (default: the trainer's ``log_dir``). Batches count from 0 at the start of ``fit``.

    Args:
        first: the first batch to record (later than the first few, which warm up).
        count: how many batches to record.
        dirpath: where to write; default the trainer's log folder.

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning_pipe import PipeStrategy, PipelineTrace
        >>> trainer = pl.Trainer(strategy=PipeStrategy(), callbacks=[PipelineTrace(first=10, count=2)])  # doctest: +SKIP
    """

    def __init__(self, first: int = 10, count: int = 2, dirpath: Optional[str] = None) -> None:
        if first < 0 or count < 1:
            raise ConfigurationError(f"PipelineTrace(first={first}, count={count}): first >= 0 and count >= 1")
        self.first, self.count, self.dirpath = first, count, dirpath
        self.paths: List[str] = []
        self._seen = 0
        self._recorder = Recorder(keep=count)
        self._active = False

    def _tracing(self) -> bool:
        return self.first <= self._seen < self.first + self.count

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # the same config run without the pipeline (to compare) keeps working: nothing to record there
        self._active = hasattr(trainer.strategy, "pipeline")
        if not self._active:
            rank_zero_warn(f"PipelineTrace records PipeStrategy runs; this trainer runs "
                           f"{type(trainer.strategy).__name__}, so nothing is recorded")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._active and self._tracing():
            trainer.strategy.pipeline.executor.recorder = self._recorder

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._active:
            return
        if not self._tracing():
            self._seen += 1
            return
        pipeline = trainer.strategy.pipeline
        pipeline.executor.recorder = None
        self._seen += 1
        if self._seen == self.first + self.count:
            records = pipeline.gather_trace(self._recorder.records)
            # trainer.log_dir is a collective (a broadcast over every rank): asked for on every rank
            folder = self.dirpath or trainer.log_dir or trainer.default_root_dir
            self._write(trainer, records, folder)

    def _write(self, trainer: Any, records: Optional[List[StepRecord]], folder: str) -> None:
        if records is None or trainer.global_rank != 0:
            return
        from lightning_pipe import timeline

        os.makedirs(folder, exist_ok=True)
        self.paths = [timeline.write_chrome_trace(records, os.path.join(folder, "pipeline_trace.json"))]
        try:
            self.paths.append(timeline.save_timeline_png(records, os.path.join(folder, "pipeline_timeline.png")))
        except ImportError as exc:
            rank_zero_warn(f"PipelineTrace: no picture ({exc}); the Chrome trace is written")
        rank_zero_info(f"PipelineTrace: batches {self.first}..{self.first + self.count - 1} written to "
                       + " and ".join(self.paths))
