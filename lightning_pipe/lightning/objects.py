"""A Python object from one rank to the others of a group, its tensors carried as NumPy arrays.

``torch.distributed.broadcast_object_list`` pickles a tensor through ``torch.save``'s reductions
and unpickles it through ``torch.load``'s, about 0.2 ms a tensor on this project's CPUs; the
strategy sends the last stage's loss, logs and metric states to the whole pipeline every step
(:func:`share_object`), so that cost sits on every step's critical path. Here a tensor whose
dtype NumPy has travels as an array (exact, a copy of its bytes); any other tensor (bfloat16, one
requiring grad, a subclass) as torch pickles it. Tensors arrive on the CPU: the receiver moves
them where it needs them.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist

_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool, torch.complex64, torch.complex128}


def _array_to_tensor(array: Any) -> torch.Tensor:
    return torch.from_numpy(array)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.dtype in _NUMPY_DTYPES and obj.layout is torch.strided \
                and not obj.requires_grad:
            return _array_to_tensor, (obj.detach().cpu().resolve_conj().resolve_neg().numpy(),)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` with plain tensors as NumPy arrays.

    Example:
        >>> restored = pickle.loads(dumps({"loss": torch.tensor(0.5, dtype=torch.float64), "n": 3}))
        >>> restored["loss"].dtype, restored["loss"].item(), restored["n"]
        (torch.float64, 0.5, 3)
    """
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def broadcast_object(obj: Any, src: int, group: Any, device: Optional[torch.device] = None) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (a collective); ``src`` gets ``obj`` back.

    Args:
        obj: the object on ``src`` (ignored elsewhere).
        src: the global rank that sends.
        group: the process group.
        device: where the bytes are staged (the GPU under NCCL, see
            :func:`~lightning_pipe.lightning.layout.object_device`); default the CPU.
    """
    sending = dist.get_rank() == src
    device = device if device is not None else torch.device("cpu")
    data = dumps(obj) if sending else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if sending:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    return obj if sending else pickle.loads(buffer.cpu().numpy().tobytes())


def share_object(obj: Any, transport: Any, src: int, posted: Any = None, wait: bool = True) -> Any:
    """``obj`` of pipeline rank ``src`` on every rank of the pipeline (each calls this); ``src`` gets ``obj`` back.

    Over gloo it travels point to point on the pipeline's transport, which lets a receiver post
    its receive early (``posted``, from :func:`post_share`): stage 0 finishes its backward after
    the last stage, so the results are usually there when it asks: in ``benchmarks/glue_cost.py``
    its wait went from 2.3-3.5 ms (receives posted when needed: two thread hand-offs and two round
    trips) to 0.07 ms. A receiver also fails fast if a rank failed. Under NCCL it is one
    :func:`broadcast_object` over the pipeline's group.

    Args:
        obj: the object on ``src`` (ignored elsewhere).
        transport: the pipeline's :class:`~lightning_pipe.transport.Transport`.
        src: the pipeline rank that sends.
        posted: what :func:`post_share` returned on this rank for this call, if it was called.
        wait: whether ``src`` waits until its message has left (gloo); without, the next step waits
            for it (see :meth:`~lightning_pipe.transport.Transport.send_bytes`): only where a step follows.
    """
    if transport.batched:
        return broadcast_object(obj, transport.ranks[src], transport.group, transport.device)
    what = f"what pipeline rank {src} shares (a step's results, or the state its steps built)"
    if transport.pp_rank == src:
        transport.send_bytes(dumps(obj), [r for r in range(transport.num_ranks) if r != src], what if wait else None)
        return obj
    return pickle.loads(transport.recv_bytes(src, what, posted))


def post_share(transport: Any, src: int) -> Any:
    """Post this rank's receive of the next :func:`share_object` from pipeline rank ``src``, ahead of it.

    Returns what to pass to that call as ``posted`` (None where nothing is posted: on ``src``
    itself, and under NCCL). Every posted receive must be taken by its ``share_object`` call:
    the next message from ``src`` fills it.
    """
    if transport.batched or transport.pp_rank == src:
        return None
    return transport.post_bytes(src)
