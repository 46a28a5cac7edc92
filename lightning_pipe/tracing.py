"""The pipeline's timelines: record steps, gather every rank's records, export them.

A mixin of :class:`lightning_pipe.Pipeline`; it needs the pipeline's ``executor``, ``group`` and
``transport``.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

from lightning_pipe.errors import ConfigurationError
from lightning_pipe.trace import Recorder, StepRecord, gather_records


class Tracing:
    """Timeline methods of a pipeline (see :meth:`trace_steps`)."""

    def trace_steps(self, steps: Optional[Iterable[int]] = None, keep: int = 64) -> Recorder:
        """Record the timeline of ``steps`` (default: every step from now on, the last ``keep`` kept).

        Steps are counted by the pipeline from 0; each ``forward_backward`` and ``forward`` call is
        one. Every stage should record the same steps. Recording costs about a microsecond per
        action; when it is off (the default) the executor pays one ``is not None`` test per action.
        Export with :meth:`export_trace` and :meth:`save_timeline_png`, or gather the records with
        :meth:`gather_trace` for :func:`lightning_pipe.trace.pipeline_metrics`.

        Example (one process; more stages need one process each):
            >>> import os, tempfile, torch, torch.distributed as dist
            >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            >>> from lightning_pipe import GPipe
            >>> pipe = GPipe(torch.nn.Sequential(torch.nn.Linear(3, 1)), chunks=2)
            >>> recorder = pipe.trace_steps(range(1, 3))  # steps 1 and 2
            >>> for _ in range(4):
            ...     _ = pipe.forward_backward(torch.ones(4, 3), criterion=torch.nn.functional.mse_loss,
            ...                               labels=(torch.zeros(4, 1),))
            >>> [record.step for record in recorder.records]
            [1, 2]
            >>> [str(action) for action, begin, end in recorder.records[0].compute]
            ['0F0', '0F1', '0B1', '0B0']
            >>> path = pipe.export_trace(os.path.join(tempfile.mkdtemp(), "trace.json"))  # ui.perfetto.dev
            >>> pipe.stop_tracing() is recorder
            True
            >>> dist.destroy_process_group()
        """
        self.executor.recorder = Recorder(steps, keep)
        return self.executor.recorder

    def stop_tracing(self) -> Optional[Recorder]:
        """Stop recording; return the recorder (its records stay readable), None if none was set."""
        recorder, self.executor.recorder = self.executor.recorder, None
        return recorder

    @property
    def recorder(self) -> Optional[Recorder]:
        """The recorder set by :meth:`trace_steps`, or None when no step is being recorded."""
        return self.executor.recorder

    def gather_trace(self, records: Optional[Sequence[StepRecord]] = None) -> Optional[List[StepRecord]]:
        """Every stage's records (default: its recorder's) on stage 0, clocks aligned.

        A collective over the pipeline's group: every stage must call it. Returns None elsewhere.
        """
        if records is None:
            if self.executor.recorder is None:
                raise ConfigurationError("no steps were recorded: call pipe.trace_steps() on every stage before the steps")
            records = self.executor.recorder.records
        return gather_records(records, self.group, 0, self.transport.device)

    def export_trace(self, path: str) -> Optional[str]:
        """Write every stage's recorded steps as one Chrome trace JSON (opens in ui.perfetto.dev).

        A collective over the pipeline's group: every stage calls it; stage 0 writes ``path`` and
        returns it, the others return None.
        """
        from lightning_pipe.timeline import write_chrome_trace

        records = self.gather_trace()
        return write_chrome_trace(records, path) if records is not None else None

    def save_timeline_png(self, path: str, step: Optional[int] = None) -> Optional[str]:
        """Draw a recorded step of every stage above its simulated plan as a PNG (needs matplotlib).

        A collective over the pipeline's group: every stage calls it; stage 0 writes ``path`` and
        returns it, the others return None. ``step`` defaults to the last step recorded.
        """
        from lightning_pipe.timeline import save_timeline_png

        records = self.gather_trace()
        return save_timeline_png(records, path, step) if records is not None else None
