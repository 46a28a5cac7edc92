"""The exceptions lightning_pipe raises.

Every error derives from :class:`PipelineError` and from the built-in that fits, so that both
``except PipelineError`` and ``except ValueError`` keep working.
"""


class PipelineError(Exception):
    """Base class of every error raised by lightning_pipe."""


class ConfigurationError(PipelineError, ValueError):
    """A pipeline was configured with values that cannot work (raised before any communication)."""


class PartitionError(ConfigurationError):
    """A module cannot be split into stages as asked."""


class ScheduleError(PipelineError, ValueError):
    """A schedule table is malformed, mismatched or would deadlock."""


class PipelineStepError(PipelineError, RuntimeError):
    """An action failed on this rank during a pipeline step."""


class PipelineAbortedError(PipelineError, RuntimeError):
    """Another rank of the pipeline failed (or died), so this rank stopped its step too."""


class BodyCallError(ConfigurationError):
    """The user's step called the pipelined body in a way the pipeline cannot reproduce."""


class SideEffectError(PipelineError, RuntimeError):
    """The user's step changed state that, under pipelining, it would change more than once per batch."""


class StaleValueError(PipelineError, RuntimeError):
    """The last stage computed a value from its out-of-date copy of a module the first stage trains, and used it."""


class BatchMismatchError(ConfigurationError):
    """The processes of one pipeline loaded different batches (data sharded or randomized per process)."""


_STEP_ERRORS: dict = {}


def step_error(cause: BaseException, message: str) -> PipelineStepError:
    """The :class:`PipelineStepError` a failed action raises on its rank: also an instance of ``cause``'s class when
    that is one of lightning_pipe's named errors, so that ``except BodyCallError`` catches a refusal raised inside a
    step as it catches one raised outside.

    Example:
        >>> error = step_error(BodyCallError("no"), "[pp_rank 1 | step 0 | 1F0] BodyCallError: no")
        >>> isinstance(error, PipelineStepError), isinstance(error, BodyCallError), type(error).__name__
        (True, True, 'PipelineStepError')
        >>> import pickle; type(pickle.loads(pickle.dumps(error))) is PipelineStepError
        True
    """
    kind = type(cause)
    if not issubclass(kind, PipelineError) or issubclass(kind, (PipelineStepError, PipelineAbortedError)):
        return PipelineStepError(message)
    if kind not in _STEP_ERRORS:  # pickled (a spawn launcher sends it to its parent) as the plain PipelineStepError
        _STEP_ERRORS[kind] = type("PipelineStepError", (PipelineStepError, kind),
                                  {"__module__": __name__, "__reduce__": lambda self: (PipelineStepError, self.args)})
    return _STEP_ERRORS[kind](message)
