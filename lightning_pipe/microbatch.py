"""Splitting a batch into microbatches and merging outputs back.

Any pytree (tuples, lists, dicts) of tensors is split along ``batch_dim``. Non-tensor leaves and
tensors wrapped in :class:`NoChunk` are given whole to every microbatch. ``torch.tensor_split``
decides the sizes, so 10 samples in 4 microbatches are 3, 3, 2, 2, and a batch smaller than the
requested number of microbatches gives one microbatch per sample.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import torch
# torch's pytree helpers are private but stable and used throughout torch.distributed; a public
# replacement (optree) would be one more dependency for the same few calls.
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_pipe.errors import ConfigurationError


class NoChunk:
    """Wrap a tensor so that every microbatch gets all of it instead of a slice.

    Example:
        >>> mask = torch.ones(3)
        >>> [m[1].shape for m in scatter((torch.zeros(4, 2), NoChunk(mask)), chunks=2)]
        [torch.Size([3]), torch.Size([3])]
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"NoChunk wraps a tensor, got {type(tensor).__name__}")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"NoChunk({self.tensor!r})"


def batch_size_of(inputs: Any, batch_dim: int = 0) -> int:
    """The size of the batch dimension shared by every splittable tensor in ``inputs``.

    Raises:
        ConfigurationError: no tensor to split, or tensors disagree on the batch size.
    """
    leaves, _ = tree_flatten(inputs)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    short = [tuple(t.shape) for t in tensors if not -t.dim() <= batch_dim < t.dim()]
    if short:
        raise ConfigurationError(
            f"tensors of shapes {short} have no dimension batch_dim={batch_dim} to split into microbatches; "
            "wrap tensors that every microbatch needs whole in NoChunk, or set batch_dim"
        )
    sizes = {tuple(t.shape): t.shape[batch_dim] for t in tensors}
    found = set(sizes.values())
    if not found:
        raise ConfigurationError(
            "the inputs hold no tensor with a batch dimension to split into microbatches; "
            "wrap tensors that every microbatch needs whole in NoChunk and pass at least one batched tensor"
        )
    if len(found) > 1:
        raise ConfigurationError(
            f"the inputs disagree on the batch size along batch_dim={batch_dim}: shapes {sorted(sizes)}; "
            "wrap tensors that are not batched in NoChunk, or set batch_dim"
        )
    return found.pop()


def scatter(inputs: Any, chunks: int, batch_dim: int = 0) -> List[Any]:
    """Split ``inputs`` into ``min(chunks, batch size)`` microbatches of the same structure.

    Example:
        >>> parts = scatter((torch.arange(10), "tag"), chunks=4)
        >>> [p[0].tolist() for p in parts], parts[0][1]
        ([[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]], 'tag')
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ConfigurationError(f"chunks (the number of microbatches) must be a positive integer, got {chunks!r}")
    leaves, spec = tree_flatten(inputs, is_leaf=lambda x: isinstance(x, NoChunk))
    num_microbatches = min(chunks, batch_size_of(inputs, batch_dim))
    columns = []
    for leaf in leaves:
        if isinstance(leaf, NoChunk):
            columns.append([leaf.tensor] * num_microbatches)
        elif isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            columns.append(torch.tensor_split(leaf, num_microbatches, dim=batch_dim))
        else:
            columns.append([leaf] * num_microbatches)
    return [tree_unflatten([column[i] for column in columns], spec) for i in range(num_microbatches)]


def microbatch_sizes(batch_size: int, chunks: int) -> List[int]:
    """The sizes :func:`scatter` gives: ``microbatch_sizes(10, 4) == [3, 3, 2, 2]``."""
    m = min(chunks, batch_size)
    return [batch_size // m + (1 if i < batch_size % m else 0) for i in range(m)]


def gather(outputs: Sequence[Any], batch_dim: int = 0) -> Any:
    """Merge microbatch outputs of the same structure back into one batch.

    Tensors are concatenated along ``batch_dim`` (0-dim tensors are stacked); other leaves are
    taken from the first microbatch.

    Example:
        >>> gather([torch.zeros(2), torch.ones(1)]).tolist()
        [0.0, 0.0, 1.0]
    """
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    merged = []
    for column in zip(*(leaves for leaves, _ in flat)):
        first = column[0]
        if isinstance(first, torch.Tensor):
            merged.append(torch.stack(column) if first.dim() == 0 else torch.cat(column, dim=batch_dim))
        else:
            merged.append(first)
    return tree_unflatten(merged, spec)
