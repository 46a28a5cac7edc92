"""Argument checks shared by the schedule generators."""

from lightning_pipe.errors import ConfigurationError


def check_grid(num_stages: int, num_microbatches: int) -> None:
    check_positive(num_stages=num_stages, num_microbatches=num_microbatches)


def check_positive(**values: int) -> None:
    """Raise unless every value is a positive integer (``bool`` is not one)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
