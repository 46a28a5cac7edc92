"""Point-to-point transport of activations and gradients between stages on different ranks.

Messages are tuples of tensors. Their shapes, dtypes and ``requires_grad`` flags ("meta") are
exchanged only when they may have changed: each step starts with one small header that stage 0
sends down the pipeline, carrying the number of microbatches, their sizes, and whether stage 0's
inputs differ in meta from the previous step. If not, every stage reuses the meta it cached per
microbatch (so the steady state moves only data); if so, each activation message is preceded by
its meta for that step (so variable sequence lengths work). Gradients never need a meta: they
have the shapes of the activations this stage sent.

A message is named by its tag, the sending and receiving stages and the microbatch; a stage's
rank comes from the schedule's placement (``stage_ranks``), so a rank may hold several stages.
Per link (pair of ranks), direction and tag, messages are matched in FIFO order whichever stages
they belong to, which the schedule validator proves both ends follow. On gloo, receives are posted ahead of need, and operations go straight to the process group's
``send``/``recv`` (``dist.isend`` adds ~15 µs of checks per call, which an overhead-bound
pipeline feels); on NCCL, where a pair's operations share one stream, the communication of
consecutive actions is issued as one ``batch_isend_irecv`` group instead (as Megatron does), so
opposite sends cannot block each other.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lightning_pipe.arrivals import Arrival, Arrivals
from lightning_pipe.errors import PipelineStepError
from lightning_pipe.faults import ErrorChannel

_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
META_SIZE = 256  # int64 slots in a meta message: room for about 40 tensors of 4 dimensions


def encode_meta(tensors: Sequence[torch.Tensor]) -> Tuple[int, ...]:
    """``(n, dtype, requires_grad, ndim, *shape, ...)`` for a tuple of tensors."""
    codes = [len(tensors)]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise PipelineStepError(
                f"stages pass tensors to each other, but this stage's output holds a {type(t).__name__}; "
                "return a tensor or a tuple of tensors"
            )
        if t.dtype not in _CODE:
            raise PipelineStepError(f"cannot send a tensor of dtype {t.dtype} between stages")
        codes.extend((_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape))
    if len(codes) > META_SIZE:
        raise PipelineStepError(f"a stage output with {len(tensors)} tensors is too large to describe in {META_SIZE} slots")
    return tuple(codes)


def decode_meta(codes: Sequence[int]) -> List[Tuple[torch.dtype, bool, Tuple[int, ...]]]:
    out, pos = [], 1
    for _ in range(codes[0]):
        dtype, requires_grad, ndim = codes[pos : pos + 3]
        out.append((_DTYPES[dtype], bool(requires_grad), tuple(codes[pos + 3 : pos + 3 + ndim])))
        pos += 3 + ndim
    return out


class _Op(NamedTuple):
    """One point-to-point operation: a lighter ``dist.P2POp`` (which is built only for NCCL groups)."""

    is_send: bool
    tensor: torch.Tensor
    peer: int  # the peer's rank in the group
    tag: int


class _Works:
    """Several works waited as one (one hand-off to the error channel's helper thread for all)."""

    __slots__ = ("works",)

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class PendingRecv:
    """Buffers being received for one message, and the works that fill them."""

    __slots__ = ("buffers", "ops", "works", "requires_grad", "arrival")

    def __init__(self, buffers: List[torch.Tensor], ops: list, requires_grad: List[bool]) -> None:
        self.buffers = buffers
        self.ops = ops
        self.works: list = []
        self.requires_grad = requires_grad
        self.arrival: Optional[Arrival] = None  # gloo: waited for by the link's helper thread


# Message tags: one FIFO stream per kind of message and direction on each link. gloo matches a
# receive to a send by (peer, tag) in posting order, so posting receives ahead is safe per tag.
ACTIVATIONS, GRADIENTS, SKIPS, SKIP_GRADIENTS, HEADER, OBJECTS = 0, 1, 2, 3, 4, 5
FIRST_BYTES = 4096  # the first message of Transport.send_bytes: the length (8 bytes), then the data's start
_DATA_OF_GRADIENT = {GRADIENTS: ACTIVATIONS, SKIP_GRADIENTS: SKIPS}


class Transport:
    """Sends and receives one rank's messages over ``group``.

    A message is identified by its tag (``ACTIVATIONS``, ``GRADIENTS``, ``SKIPS``,
    ``SKIP_GRADIENTS``), the local stage, the peer stage and the microbatch.

    Args:
        group: the pipeline's process group.
        pp_rank: this rank in ``group``.
        num_ranks: the size of ``group``.
        device: where received tensors are allocated.
        errors: the pipeline's error channel, used while waiting.
        stage_ranks: the group rank of each stage (default: stage ``s`` on rank ``s``).
    """

    def __init__(self, group, pp_rank: int, num_ranks: int, device: torch.device, errors: ErrorChannel,
                 stage_ranks: Optional[Sequence[int]] = None) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.pp_rank = pp_rank
        self.num_ranks = num_ranks
        self.stage_ranks = tuple(stage_ranks) if stage_ranks is not None else tuple(range(num_ranks))
        self._global = list(self.ranks)  # global rank of each group rank (for NCCL's P2POp)
        self._process_group = group if group is not None else dist.group.WORLD
        self.device = device
        self.errors = errors
        self.batched = dist.get_backend(group) == "nccl"
        self.arrivals = None if self.batched else Arrivals(errors)
        self.fresh = True  # whether this rank's data messages carry their meta this step
        self.fresh_from = 0  # the lowest pp rank whose data messages carry their meta this step (num_ranks: none)
        self._in_rank_order = self.stage_ranks == tuple(range(num_ranks))  # data flows only to higher ranks
        self._unannounced = False  # this rank's parameters changed requires_grad, and the header could not say so
        self._recv_meta: Dict[tuple, List] = {}
        self._sent_meta: Dict[tuple, Tuple[int, ...]] = {}
        self._sends: list = []

    # -- step header ---------------------------------------------------------------------------
    def exchange_header(self, header: Optional[List[int]], length: int, changed: bool = False) -> List[int]:
        """Rank 0 passes its header; other ranks receive it. Every rank forwards it on.

        ``header[1]`` is the lowest pp rank whose data messages carry their meta this step (``num_ranks``: none).
        A rank whose stages send other meta than in the last step although stage 0's inputs kept theirs
        (``changed``: parameters frozen or unfrozen since) lowers it to its own before forwarding: the messages of
        every rank from it on carry their meta, and the ranks before it still know which do, since data flows only
        to higher ranks where each rank holds one stage in order. Where a rank holds several stages, data also flows
        back to lower ranks, which cannot know of a later rank's change: only rank 0's counts there, and a later
        rank's change that does alter what it sends is named when it sends (see :meth:`send`).
        """
        if self.pp_rank > 0:
            buffer = torch.empty(length, dtype=torch.int64, device=self.device)
            work = dist.irecv(buffer, self.ranks[self.pp_rank - 1], group=self.group, tag=HEADER)
            self.errors.wait(work, f"the step header from pp rank {self.pp_rank - 1}")
            header = buffer.tolist()
            if changed and header[1] > self.pp_rank and self._in_rank_order:
                header[1] = self.pp_rank
        if self.pp_rank < self.num_ranks - 1:
            tensor = torch.tensor(header, dtype=torch.int64, device=self.device)
            self._sends.append((dist.isend(tensor, self.ranks[self.pp_rank + 1], group=self.group, tag=HEADER), tensor))
        self.fresh_from = header[1]
        self.fresh = self.fresh_from <= self.pp_rank
        self._unannounced = changed and not self.fresh  # several stages per rank: see send's error
        if self.fresh:
            self._sent_meta.clear()
        if self.fresh_from < self.num_ranks:  # what fresh senders send anew
            self._recv_meta = {key: meta for key, meta in self._recv_meta.items()
                               if self.stage_ranks[key[2]] < self.fresh_from}
        return header

    # -- data (activations and skip tensors) -----------------------------------------------------
    def send(self, tag: int, stage: int, peer: int, microbatch_index: int, tensors: Sequence[torch.Tensor]) -> list:
        """The ops that send data tensors of one microbatch from ``stage`` to stage ``peer``."""
        rank = self.stage_ranks[peer]
        if tag in _DATA_OF_GRADIENT:
            return [_Op(True, t.contiguous(), rank, tag) for t in tensors]
        meta = encode_meta(tensors)
        key = (tag, stage, peer, microbatch_index)
        ops = []
        if self.fresh:
            meta_tensor = torch.zeros(META_SIZE, dtype=torch.int64, device=self.device)
            meta_tensor[: len(meta)] = torch.tensor(meta, dtype=torch.int64)
            ops.append(_Op(True, meta_tensor, rank, tag))
        elif self._sent_meta.get(key) != meta:
            if self._unannounced:
                raise PipelineStepError(
                    f"stage {stage} sends microbatch {microbatch_index} to stage {peer} with meta {meta}, not "
                    f"{self._sent_meta.get(key)} as in the previous step: the stages on pp rank {self.pp_rank} changed "
                    "which of their parameters require grad since then (layers frozen or unfrozen), and so which of "
                    "their outputs do. Where a rank holds several stages (interleaved_1f1b, zbv), data also flows to "
                    "lower ranks, and only a change on pp rank 0 (or a step after an evaluation loop) announces new "
                    "messages to every rank: change stage 0's layers in the same step (e.g. unfreeze the whole body at "
                    "once), or use a schedule with one stage per rank ('1f1b', 'zb_h1')"
                )
            raise PipelineStepError(
                f"stage {stage} sends microbatch {microbatch_index} to stage {peer} with meta {meta}, "
                f"not {self._sent_meta.get(key)} as in the previous step, although stage 0's inputs kept theirs and "
                "no stage changed which parameters require grad; what a stage sends (shapes, dtypes, requires_grad) "
                "must depend only on the shapes of the pipeline's inputs, or pass variable_messages=True"
            )
        self._sent_meta[key] = meta
        ops.extend(_Op(True, t.detach().contiguous(), rank, tag) for t in tensors)
        return ops

    def recv(self, tag: int, stage: int, peer: int, microbatch_index: int) -> PendingRecv:
        """Prepare to receive one message for ``stage`` from stage ``peer`` (waits for its meta on a fresh step)."""
        rank = self.stage_ranks[peer]
        if tag in _DATA_OF_GRADIENT:
            # gradients of what this stage sent: the shapes are known, only those requiring grad come
            meta = decode_meta(self._sent_meta[(_DATA_OF_GRADIENT[tag], stage, peer, microbatch_index)])
            meta = [(dtype, False, shape) for dtype, requires_grad, shape in meta if requires_grad]
        else:
            key = (tag, stage, peer, microbatch_index)
            if self.fresh_from <= rank and key not in self._recv_meta:
                meta_tensor = torch.empty(META_SIZE, dtype=torch.int64, device=self.device)
                work = self._process_group.recv([meta_tensor], rank, tag)
                self.errors.wait(work, f"the meta of microbatch {microbatch_index} from stage {peer}")
                self._recv_meta[key] = decode_meta(meta_tensor.tolist())
            meta = self._recv_meta[key]
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, _, shape in meta]
        ops = [_Op(False, b, rank, tag) for b in buffers]
        return PendingRecv(buffers, ops, [rg for _, rg, _ in meta])

    def can_post(self, tag: int, stage: int, peer: int, microbatch_index: int) -> bool:
        """Whether a receive can be posted now, ahead of need (never on NCCL)."""
        if self.batched:
            return False
        if tag in _DATA_OF_GRADIENT:
            return (_DATA_OF_GRADIENT[tag], stage, peer, microbatch_index) in self._sent_meta
        return self.fresh_from > self.stage_ranks[peer] and (tag, stage, peer, microbatch_index) in self._recv_meta

    # -- issuing and waiting -------------------------------------------------------------------
    def issue(self, ops: list, pending: Sequence[PendingRecv] = ()) -> None:
        """Start ``ops`` (one NCCL group when batched); remember sends until the step ends."""
        if not ops:
            return
        if self.batched:
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend if op.is_send else dist.irecv, op.tensor, self._global[op.peer], self.group, op.tag)
                for op in ops
            ])
        else:
            group = self._process_group
            works = [group.send([op.tensor], op.peer, op.tag) if op.is_send else group.recv([op.tensor], op.peer, op.tag)
                     for op in ops]
        if pending:
            by_tensor = {id(op.tensor): w for op, w in zip(ops, works)}
            for recv in pending:
                recv.works = [by_tensor[id(b)] for b in recv.buffers]
                if self.arrivals is not None and recv.works:
                    recv.arrival = self.arrivals.watch((self.ranks[recv.ops[0].peer], recv.ops[0].tag), recv.works)
        for op, work in zip(ops, works):
            if op.is_send:
                # kept until the step ends: a gloo Work only learns it completed inside wait()
                self._sends.append((work, op.tensor))

    def take(self, recv: PendingRecv, what: str) -> tuple:
        """Wait for a receive and return its tensors (floating ones requiring grad as sent)."""
        if recv.arrival is not None:
            self.arrivals.take(recv.arrival, what)
        elif recv.works:
            self.errors.wait(recv.works[0] if len(recv.works) == 1 else _Works(recv.works), what)
        return tuple(b.requires_grad_(True) if rg else b for b, rg in zip(recv.buffers, recv.requires_grad))

    # -- bytes (what the Lightning glue shares each step) ------------------------------------------
    def send_bytes(self, data: bytes, peers: Sequence[int], what: Optional[str] = None) -> None:
        """Send ``data`` to the group ranks ``peers`` (gloo), waiting until it has left if ``what`` names it.

        The first message has a fixed size, :data:`FIRST_BYTES`: the data's length, then its start;
        the rest, if any, follows in a second message. A receiver can therefore post the first
        receive before the data exists (:meth:`post_bytes`). Without ``what`` it is not waited for
        here: the next :meth:`finish` waits for it with the next step's sends (a wait of its own is
        one more hand-off to a helper thread). Only for what is sure to be followed by a step or a
        :meth:`finish` (PipeStrategy's teardown calls it): gloo sends the data only once the
        receiver asks for it.
        """
        framed = bytearray(len(data).to_bytes(8, "little")) + data
        framed += bytes(max(FIRST_BYTES - len(framed), 0))
        whole = torch.frombuffer(framed, dtype=torch.uint8)
        tensors = [whole[:FIRST_BYTES]] + ([whole[FIRST_BYTES:]] if len(whole) > FIRST_BYTES else [])
        group = self._process_group
        works = [group.send([tensor], peer, OBJECTS) for peer in peers for tensor in tensors]
        if what is not None:
            self.errors.wait(_Works(works), what)
        else:
            self._sends.extend((work, whole) for work in works)

    def post_bytes(self, peer: int) -> PendingRecv:
        """Post the receive of the first message of group rank ``peer``'s next :meth:`send_bytes`.

        Posted before the data is sent, it is waited for by the link's helper thread, so that
        :meth:`recv_bytes` finds it arrived instead of waiting for two thread hand-offs and a round
        trip (gloo only: NCCL shares objects by broadcast).
        """
        head = torch.empty(FIRST_BYTES, dtype=torch.uint8)
        posted = PendingRecv([head], [_Op(False, head, peer, OBJECTS)], [False])
        self.issue(posted.ops, [posted])
        return posted

    def recv_bytes(self, peer: int, what: str, posted: Optional[PendingRecv] = None) -> bytes:
        """The bytes group rank ``peer`` sends with :meth:`send_bytes`; ``posted`` from :meth:`post_bytes`, if any."""
        (head,) = self.take(posted if posted is not None else self.post_bytes(peer), what)
        size = int.from_bytes(head[:8].numpy().tobytes(), "little")
        start = head[8:8 + size].numpy().tobytes()
        if size == len(start):
            return start
        rest = torch.empty(size - len(start), dtype=torch.uint8)
        self.errors.wait(self._process_group.recv([rest], peer, OBJECTS), what)
        return start + rest.numpy().tobytes()

    def finish(self) -> None:
        """Wait until every send issued since the last call (the step's, and :meth:`send_bytes`' before it) has left."""
        if self._sends:
            self.errors.wait(_Works([work for work, _ in self._sends]), "this rank's sends to finish")
        self._sends.clear()
