"""Layer-list bodies: blocks in an ``nn.ModuleList`` that the user's own loop calls.

The loop stays as written (``for i, block in enumerate(self.layers[:n]): x = block(x, cos, sin,
mask=mask)``): the stand-in behaves like the list for ``len``, iteration, indexing and slicing,
and hands out proxies of the blocks. The rule for a block call:

- its first positional argument is the hidden state, the only value that changes from block to
  block; a block returns it, or a tuple whose first element is it (what else such a tuple holds
  stays on the block's stage: only the final block's whole return value reaches the loop);
- every other argument is an *extra argument*. The user's step runs once per microbatch, so
  extra arguments are already the microbatch's (a padding mask is the microbatch's rows, a rotary
  table is whole): no splitting rule is needed. Blocks may get different ones (a sliding-window
  mask for some layers, a full one for others, as models alternating attention types pass
  them): the first stage then sends one set per block, else one for all. Tensors travel with the
  hidden state from stage to stage (gradients come back for those that require them); everything
  else (None, flags, numbers, the structure of tuples and dicts) travels once, as a
  content-addressed record in the job's store, and each message carries its 64-bit id. Other
  objects are values too: each run of a stage's blocks (a microbatch's forward, its recomputation
  under activation checkpointing) gets its own copy of them as they were at each block's call, so a
  stateful one (a Hugging Face key/value ``Cache``, which every block appends to) sees one
  microbatch's forward on every stage, as under DDP, never another microbatch's. What a block
  changes in such a copy stays there: a block that changes one (an auxiliary loss appended to it)
  is refused, but for a cache, whose layers read back only what each wrote. A dict, list or
  object the loop changes between the calls reaches each block as it was at that block's call; a
  tensor it changes in place after a call is refused (its version is noted at the call).

On the first stage the loop runs through, every call recorded, and the final block call runs the
stage's blocks, each with the extra arguments it was called with, and stops the step (in the
first pass the stage's blocks run as they are called instead, which shows what they return).
On the last stage the final block's call returns the final output. On both, every call is
checked (each block once, in order, each block given the hidden state the one before it
returned), and the calls that do not run a block return a stand-in for their hidden state
(:class:`HiddenStandIn`) that only the next block call may take: code of the loop that uses a
block's output otherwise (a residual added around the call, hidden states collected per block)
raises. So a loop that the pipeline cannot reproduce fails loudly instead of training something
else.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import pickle
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads
from torch.utils.hooks import RemovableHandle

from lightning_pipe.errors import BodyCallError
from lightning_pipe.lightning.body import BodyReached, StandIn, asks_for_gradient

_CHECKPOINT_FILE = torch.utils.checkpoint.__file__

Structure = Tuple[Any, tuple, tuple]  # (tree spec, non-tensor leaves, tensor slot per leaf or -1)
_PER_BLOCK = "lightning_pipe_calls_per_block"  # the only keyword of a call structure holding one call per block
_UNKNOWN = object()
_WATCHED_CALLS = 2  # calls of each block per mode whose attribute assignments are noted (PipelinedLayerList._call)


def split_call(args: tuple, kwargs: dict) -> Tuple[Structure, List[torch.Tensor]]:
    """The structure of a call's extra arguments and its distinct tensors, in order.

    Example:
        >>> mask = torch.ones(2, 2)
        >>> structure, tensors = split_call((mask, None), {"mask": mask, "causal": True})
        >>> len(tensors), structure[1:]
        (1, ((None, None, None, True), (0, -1, 0, -1)))
    """
    leaves, spec = tree_flatten((args, kwargs))
    tensors: List[torch.Tensor] = []
    slot_of: Dict[int, int] = {}
    constants, slots = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            slot = slot_of.setdefault(id(leaf), len(tensors))
            if slot == len(tensors):
                tensors.append(leaf)
            constants.append(None)
            slots.append(slot)
        else:
            constants.append(leaf)
            slots.append(-1)
    return (spec, tuple(constants), tuple(slots)), tensors


def join_call(structure: Structure, tensors: Sequence[torch.Tensor]) -> Tuple[tuple, dict]:
    """The ``(args, kwargs)`` that :func:`split_call` took apart."""
    spec, constants, slots = structure
    leaves = [tensors[slot] if slot >= 0 else value for value, slot in zip(constants, slots)]
    return tree_unflatten(leaves, spec)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # objects whose == is not a plain bool
        return False


# leaves of the extra arguments that no block can change: shared by every run; any other object is copied per run
_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, torch.layout,
           enum.Enum, type, slice, range, type(Ellipsis), types.FunctionType, types.BuiltinFunctionType)


def _copied_per_run(constants: tuple) -> bool:
    """Whether a call structure's non-tensor leaves hold an object that each run gets its own copy of."""
    return not all(isinstance(c, _VALUES) for c in constants)


class CallChannel:
    """Call structures by content id, through the job's key-value store (written once each).

    :meth:`lookup` gives each run a fresh copy of the objects in a structure that are not plain values
    (see the module docstring), unpickled from the record.
    """

    KEPT = 1024  # structures kept here; older ones are read back from the store

    def __init__(self, store: Optional[dist.Store]) -> None:
        self.store = store
        self._by_key: Dict[int, Structure] = {}
        self._records: Dict[int, bytes] = {}  # the records of structures holding objects copied per run
        self._last: Optional[Tuple[Structure, int]] = None
        self._assigned: Dict[Tuple[int, bool], frozenset] = {}  # per block and mode: what its forward sets

    def publish(self, structure: Structure) -> int:
        spec, constants, slots = structure
        copied = _copied_per_run(constants)
        # the shortcut compares objects by identity: one the loop may change between calls is pickled again (caches
        # pass: the loop gives every block the same one, which only the blocks' own copies change)
        if not _watched(constants) and self._last is not None and _same_structure(self._last[0], structure):
            return self._last[1]
        try:  # the tree spec in torch's own serialized form (pickling a TreeSpec is deprecated)
            data = pickle.dumps((treespec_dumps(spec), constants, slots))
        except Exception as exc:
            raise BodyCallError(
                f"the blocks' extra arguments hold a value that cannot be sent to other stages ({exc}); pass "
                "tensors, numbers, strings, None or tuples/dicts of them"
            ) from exc
        key = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
        if key not in self._by_key and self.store is not None:
            self.store.set(f"{key:x}", data)
        self._remember(key, structure, data if copied else None)
        self._last = (structure, key)
        return key

    def _remember(self, key: int, structure: Structure, record: Optional[bytes]) -> None:
        """Keep ``structure`` (and its record) under ``key``, forgetting the oldest beyond ``KEPT``: an object whose
        contents change every step (`self.ctx.step = n` given to the blocks) makes a structure per step; one
        forgotten here is read from the store again if asked for."""
        self._by_key.pop(key, None)
        self._by_key[key] = structure
        if record is not None:
            self._records[key] = record
        while len(self._by_key) > self.KEPT:
            oldest = next(iter(self._by_key))
            del self._by_key[oldest]
            self._records.pop(oldest, None)

    def note_assigned(self, index: int, training: bool, paths: Set[str]) -> None:
        """Note the plain attributes a call of block ``index`` in that mode set, and tell every process when that is
        the first note or adds to it (see :meth:`PipelinedLayerList.sets_as_it_runs`)."""
        known = self._assigned.get((index, training))
        if known is not None and paths <= known:
            return
        self._assigned[index, training] = merged = frozenset(paths) | (known or frozenset())
        if self.store is not None:
            self.store.set(_assigned_key(index, training), pickle.dumps(sorted(merged)))

    def assigned_of(self, index: int, training: bool) -> Optional[frozenset]:
        """The attributes block ``index``'s forward sets in that mode, as the process running it noted them; None
        while unknown (the block has not run so yet: the stages before the last run their blocks' first calls before
        the last stage runs the step on their output)."""
        key, name = (index, training), _assigned_key(index, training)
        if key not in self._assigned and self.store is not None and self.store.check([name]):
            self._assigned[key] = frozenset(pickle.loads(self.store.get(name)))
        return self._assigned.get(key)

    def lookup(self, key: int) -> Structure:
        """The structure published under ``key``, with its own copy of every object that is not a plain value."""
        if key not in self._by_key:
            data = self.store.get(f"{key:x}")
            spec, constants, slots = pickle.loads(data)
            copied = _copied_per_run(constants)
            self._remember(key, (treespec_loads(spec), constants, slots), data if copied else None)
            if copied:
                return self._by_key[key]  # just unpickled: a copy no run has had yet
        record = self._records.get(key)
        if record is None:
            return self._by_key[key]
        spec, _, slots = self._by_key[key]
        return spec, pickle.loads(record)[1], slots


def _assigned_key(index: int, training: bool) -> str:
    return f"assigned/{index}/{int(training)}"


def _frozen(value: Any) -> bool:
    """Whether ``value`` is a tensor, a plain value, a cache (see :func:`_is_cache`) or a tuple of them: what the loop
    cannot change in place but through a tensor's own in-place operations, which its version counts."""
    return isinstance(value, (torch.Tensor, *_VALUES)) or _is_cache(value) or \
        type(value) is tuple and all(map(_frozen, value))


def _watched(constants: tuple) -> bool:
    """Whether a call structure's non-tensor leaves hold an object the loop may change between calls (one not
    :func:`_frozen`): pickled at each call, as the block would see it."""
    return not all(map(_frozen, constants))


def _same_structure(a: Structure, b: Structure) -> bool:
    return a[0] == b[0] and a[2] == b[2] and all(_same(x, y) for x, y in zip(a[1], b[1]))


class BlockProxy:
    """What the loop gets for block ``index``: calling it goes through the stand-in; attributes are the block's."""

    __slots__ = ("_owner", "_index")

    def __init__(self, owner: "PipelinedLayerList", index: int) -> None:
        self._owner = owner
        self._index = index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._owner.mode != "local" and _inside_checkpoint(sys._getframe(1)):
            raise BodyCallError(
                f"block {self._index} was called inside torch.utils.checkpoint (e.g. by transformers 4's "
                "gradient_checkpointing_enable(); transformers 5 checkpoints inside each block, which works); under "
                "PipeStrategy each stage runs its own blocks, so checkpoint them with PipeStrategy(checkpoint="
                "'except_last' or 'always') and call the blocks directly"
            )
        return self._owner.call_block(self._index, args, kwargs)

    # No __iter__: code that takes any iterable apart (Lightning's BaseFinetuning.flatten_modules) would iterate a
    # block. Unpacking one (`attn, ff = block`) falls back to indexing, refused here with what to do instead.
    def __getitem__(self, index: Any) -> Any:
        if self._owner.mode == "local" and hasattr(type(self._owner.blocks[self._index]), "__getitem__"):
            return self._owner.blocks[self._index][index]
        raise BodyCallError(
            f"the loop unpacked or indexed block {self._index} of the layer list; under PipeStrategy each element "
            "of the list is one block, called whole with the hidden state (`x = block(x, ...)`). Wrap the parts "
            "(e.g. attention and feed-forward) in one module per block"
        )

    def __getattr__(self, name: str) -> Any:
        block = self._owner.blocks[self._index]
        value = getattr(block, name)
        if self._owner.mode != "local":
            if isinstance(value, nn.Module):
                return _PartOfBlock(value, self._index, name, self._owner)
            _refuse_run_state(block, name, value, self._index, name, self._owner)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if name in BlockProxy.__slots__:
            object.__setattr__(self, name, value)
            return
        if self._owner.mode != "local":
            raise BodyCallError(
                f"the step set `{name}` on block {self._index}; under PipeStrategy the blocks run on their stages, and "
                "a stage that holds neither the body's start nor its end never runs your step, so its blocks would not "
                "see it. Set it from a hook that runs before the step (on_train_batch_start), which every process runs"
            )
        setattr(self._owner.blocks[self._index], name, value)  # a hook: every process sets it on its copy

    def __repr__(self) -> str:
        return f"BlockProxy({self._index}: {type(self._owner.blocks[self._index]).__name__})"


def _inside_checkpoint(frame: Any, depth: int = 4) -> bool:
    """Whether one of the ``depth`` innermost callers is torch.utils.checkpoint (the block called by it directly,
    or through a lambda or a small wrapper)."""
    while frame is not None and depth > 0:
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


def _refuse_run_state(module: nn.Module, name: str, value: Any, index: int, path: str,
                      owner: "PipelinedLayerList") -> None:
    """Refuse a plain attribute of a block (not a parameter, buffer or submodule) read by the loop while the
    pipeline runs, where it is a tensor or one the block's forward sets (an auxiliary loss that starts as None,
    see :meth:`PipelinedLayerList.sets_as_it_runs`): such a value is set as the block runs (an auxiliary loss, a
    router's load), and the blocks run on their stages, outside the step."""
    if name not in vars(module):
        return
    tensor = isinstance(value, torch.Tensor)
    if tensor or owner.sets_as_it_runs(index, path):
        what = "a tensor the block keeps as a plain attribute" if tensor else "a plain attribute the block's forward sets"
        raise BodyCallError(
            f"the loop read `{path}` of block {index}, {what} (one it sets as it runs, such as an auxiliary loss); "
            "under PipeStrategy the blocks run on their stages, outside your step, so this process's value is not "
            "this microbatch's, or is the block's initial value where another stage holds it. Let the blocks return "
            "only the hidden state (an auxiliary loss can reach the backward through it); a constant tensor can be a "
            "buffer (`register_buffer(name, tensor, persistent=False)`)"
        )


def _assigned_by(run: Callable[[], Any], block: nn.Module) -> Tuple[Any, Set[str]]:
    """``run()`` (a call of ``block``) and the paths (``"aux_loss"``, ``"router.load"``) of the plain attributes that
    the block or one of its submodules set during it (to a new object)."""
    modules = list(block.named_modules())
    before = [dict(vars(m)) for _, m in modules]
    out = run()
    paths = {f"{prefix}.{name}" if prefix else name for (prefix, module), state in zip(modules, before)
             for name, value in vars(module).items() if state.get(name, _UNKNOWN) is not value}
    return out, paths


class _PartOfBlock:
    """A submodule of a block, read through the loop's proxy while the pipeline runs: its attributes
    are the submodule's; calling it is refused (the block may live on another stage, as meta tensors)."""

    __slots__ = ("_module", "_index", "_name", "_owner")

    def __init__(self, module: nn.Module, index: int, name: str, owner: "PipelinedLayerList") -> None:
        self._module, self._index, self._name, self._owner = module, index, name, owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise BodyCallError(
            f"the loop called `{self._name}` of block {self._index} ({type(self._module).__name__}) directly; under "
            "PipeStrategy each element of the list is one block, called whole with the hidden state "
            "(`x = block(x, ...)`), and runs on its own stage. Call the block, or wrap the parts in one module per block"
        )

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if isinstance(value, nn.Module):
            return _PartOfBlock(value, self._index, f"{self._name}.{name}", self._owner)
        _refuse_run_state(self._module, name, value, self._index, f"{self._name}.{name}", self._owner)
        return value


class PipelinedLayerList(StandIn, nn.ModuleList):
    """This rank's blocks of a layer-list body, in a stand-in the user's loop iterates as the list.

    Args:
        blocks: every block of the list, in order (only those of this rank's stages are registered here).
        ranges: ``(start, stop)`` of each stage this rank holds, in stage order.
        stages: the stages this rank holds.
        num_stages: the number of stages.
        channel: where call structures are published and looked up.
    """

    passes_inputs_on = True  # every stage's message carries every extra tensor on (see Stage._warn_unused)

    # an nn.ModuleList to the user's code (`isinstance(self.layers, nn.ModuleList)` as the original), whose
    # ModuleList methods that change the list StandIn refuses, and whose reads this class answers
    def __init__(self, blocks: Sequence[nn.Module], ranges: Sequence[Tuple[int, int]], stages: Sequence[int],
                 num_stages: int, channel: CallChannel) -> None:
        nn.Module.__init__(self)
        self.init_stand_in(stages, num_stages)
        for start, stop in ranges:
            for i in range(start, stop):
                self.add_module(str(i), blocks[i])
        self.__dict__["blocks"] = list(blocks)  # not registered: proxies read the attributes of other stages' blocks
        self.ranges = [tuple(r) for r in ranges]
        self.length = len(blocks)
        self.channel = channel
        # per block call: (index, structure, tensors), and on the first stage its content key (for structures
        # holding objects the loop may change, see _watched; else None) and the tensors' versions at the call
        self._seen: List[tuple] = []
        self._handed: Optional[torch.Tensor] = None  # the stand-in (or hidden state) the last call returned
        # learned on the first stage from the loop's first pass: what a block returns besides the hidden state
        self._tail: Any = _UNKNOWN  # None (the hidden state alone) or (tuple type, the other elements)
        self._input: Optional[torch.Tensor] = None  # the first block's hidden state in this pass (first stage)
        self._output: Optional[torch.Tensor] = None  # the stage's output, in the first pass
        self._learning = False  # this pass is the first: the stage's blocks run as they are called
        self._first_hook = 0  # the id torch gives the first hook registered after the step began
        self._calls_watched = [[0, 0] for _ in blocks]  # per block: calls noted in eval mode, in training mode
        # not registered: the blocks' names stay the list's own
        self.__dict__["chunks"] = [self] if len(ranges) == 1 else [LayerListChunk(self, k) for k in range(len(ranges))]

    __repr__ = nn.Module.__repr__  # the blocks held here (ModuleList's would print the proxies of every block)

    def __len__(self) -> int:
        return self.length

    def every_layer(self) -> Sequence[nn.Module]:
        return self.blocks

    def layer_names(self) -> List[str]:
        return [str(i) for i in range(self.length)]

    def __iter__(self):
        return (BlockProxy(self, i) for i in range(self.length))

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [BlockProxy(self, i) for i in range(self.length)[index]]
        if not -self.length <= index < self.length:
            raise IndexError(f"index {index} is out of range for a list of {self.length} blocks")
        return BlockProxy(self, index % self.length)

    def begin_step(self, mode: str, replacement: Optional[tuple] = None, checkpoint_layers: bool = False) -> None:
        super().begin_step(mode, replacement, checkpoint_layers)
        # straight into __dict__ (per call, so kept cheap): nn.Module.__setattr__ first looks for a parameter,
        # buffer or submodule of the name, and tensors are what these hold
        self.__dict__.update(_seen=[], _handed=None, _input=None, _output=None, _last_split=None,
                             _first_hook=RemovableHandle.next_id)

    def reached(self) -> bool:
        return bool(self._seen)  # the loop's first block call (calls counts the Sequential stand-in's)

    def end_step(self, hook: str, path: str) -> None:
        self.refuse_changed_modes(hook, "during the step")
        mode, seen = self.mode, self._seen
        self.begin_step("local")
        if mode != "replace" and not (mode == "stop" and seen):  # the first stage stops at the final call
            return
        order = [call[0] for call in seen]
        if order != list(range(self.length)):
            raise BodyCallError(
                f"{hook} called the blocks of `self.{path}` in the order {order}; under PipeStrategy the loop must call "
                f"every block once, in order (0..{self.length - 1}), in one pass"
            )

    def call_block(self, index: int, args: tuple, kwargs: dict) -> Any:
        """One call of the user's loop."""
        self.refuse_if_released()
        if self.mode == "local":
            self.refuse_if_partial()
            return self.blocks[index](*args, **kwargs)
        if not args or not isinstance(args[0], torch.Tensor):
            raise BodyCallError(
                f"block {index} was called without a tensor as its first positional argument; under PipeStrategy "
                "the hidden state is the first positional argument of every block call"
            )
        if index == 0:
            if args[0].is_nested:  # made before the loop (later calls get stand-ins)
                raise BodyCallError(
                    "block 0 was given a nested tensor as its hidden state. torch's nn.TransformerEncoder makes one in "
                    "evaluation when it gets a `src_key_padding_mask` (its fast path, `enable_nested_tensor=True` by "
                    "default), deciding from its first layer, which only the first stage holds; under PipeStrategy the "
                    "hidden state crosses stages as one dense tensor. Build the encoder with "
                    "`enable_nested_tensor=False` (the outputs at padded positions are then computed instead of zeroed "
                    "before `norm`; those at the other positions, and a loss that ignores the padding, stay the same)"
                )
            self.refuse_changed_modes("the step", "before calling the blocks")
            self.note_changed_attributes()
        if RemovableHandle.next_id != self._first_hook:  # a hook was registered somewhere since the step began
            _refuse_hooks_put_in_step(self.blocks[index], index, self._first_hook)
        self.note_call_context(first=index == 0)
        structure, tensors = self._split(args[1:], kwargs)
        if self.mode == "replace":
            if index == 0:  # see .steps: an autograd error through the body is explained only if the input asked
                self.__dict__["input_asks_grad"] = torch.is_grad_enabled() and asks_for_gradient(args[:1])
            if self._seen and index == self._seen[-1][0] + 1:  # the order is end_step's to check
                self._refuse_changed_hidden(index, args[0])
            self._seen.append((index, structure, tensors))
            if index == self.length - 1:
                return self.replacement[0]
            hidden = _hidden_of(self.replacement[0], index)
            self.__dict__["_handed"] = HiddenStandIn.of(hidden, index)
            out = self.replacement[0]
            return self._handed if isinstance(out, torch.Tensor) else type(out)((self._handed, *out[1:]))
        return self._first_stage_call(index, args, structure, tensors)

    def _refuse_changed_hidden(self, index: int, hidden: torch.Tensor) -> None:
        """Block ``index`` must get what the call of block ``index - 1`` returned (on the first and the last stage)."""
        if hidden is not self._handed:
            raise BodyCallError(
                f"block {index} was not given the hidden state block {index - 1} returned: the loop changed it between "
                "the calls (e.g. `x = x + block(x)`, or a function of the block's output). Under PipeStrategy each "
                "block's output goes straight to the next block, so that code would not run; move it into the block "
                "(wrap the block in a module doing it)"
            )

    def _split(self, args: tuple, kwargs: dict) -> Tuple[Structure, List[torch.Tensor]]:
        """:func:`split_call`, reusing the previous call's result when the loop passes the very same objects
        (a loop gives every block the same mask, the same rotary tuple: flattening them again per block is most
        of a call's cost), if they are tensors, plain values or tuples of them: a dict, a list or another object
        may have been changed in place since (`ctx["layer"] += 1`), and is taken apart again."""
        last = self.__dict__.get("_last_split")
        if last is not None and len(last[0]) == len(args) and last[1].keys() == kwargs.keys() \
                and all(a is b for a, b in zip(last[0], args)) and all(last[1][k] is v for k, v in kwargs.items()):
            return last[2], last[3]
        structure, tensors = split_call(args, kwargs)
        frozen = all(map(_frozen, args)) and all(map(_frozen, kwargs.values()))
        self.__dict__["_last_split"] = (args, kwargs, structure, tensors) if frozen else None
        for tensor in tensors:
            if isinstance(tensor, HiddenStandIn) or tensor is self._handed:
                raise BodyCallError(
                    "the loop gave a block's output to the next block as an extra argument besides the hidden state "
                    "(e.g. `block(x, prev=x)`); under PipeStrategy only the hidden state crosses from block to block. "
                    "Compute what the block needs from its first argument inside the block"
                )
        return structure, tensors

    def _first_stage_call(self, index: int, args: tuple, structure: Structure, tensors: List[torch.Tensor]) -> Any:
        """A block call of the loop on the first stage ("stop" mode), recorded: at the final call the stage's
        blocks run, each with the extra arguments it was called with, and the step stops.

        Every call before the final one returns a stand-in for the hidden state, shaped as the blocks return
        it. The first pass learns that shape from the stage's own blocks: they run as they are called.
        """
        seen = self._seen
        if index != len(seen):
            raise BodyCallError(f"the loop's block call {len(seen)} went to block {index}; it must call every block "
                                f"once, in order, starting at block 0")
        if seen:
            self._refuse_changed_hidden(index, args[0])
        # objects the loop may change are pickled now, as the block would see them, tensors' versions noted
        key = self.channel.publish(structure) if _watched(structure[1]) else None
        seen.append((index, structure, tensors, key, [t._version for t in tensors]))
        start, stop = self.ranges[0]
        if index == 0:
            self.__dict__.update(_input=args[0], _learning=self._tail is _UNKNOWN)
        if index == stop and self._learning:
            self.__dict__["_output"] = args[0]  # what the stage's blocks returned, run as they were called
        if index == self.length - 1:
            self._reach(seen, learned=self._output if self._learning else None)
        if self._learning and index < stop:  # the first pass: this stage's block runs now
            key = key if key is not None else self.channel.publish(structure)

            def run(hidden: torch.Tensor) -> Any:  # its own copy of the arguments, the recomputation's too
                return self._on_copy(key, lambda call: self._call(index, hidden, join_call(call, tensors)),
                                     f"block {index}")

            out = self.run_checkpointed(run, args[0])
            for call in seen:  # what the block changed in place (a tensor every block gets), it changes for all
                call[4][:] = [t._version for t in call[2]]
            self.__dict__["_handed"] = _hidden_of(out, index)
            if index == stop - 1:
                self._tail = None if isinstance(out, torch.Tensor) else (type(out), tuple(out[1:]))
            return out if isinstance(out, torch.Tensor) else type(out)((self._handed, *out[1:]))
        self.__dict__["_handed"] = HiddenStandIn.of(args[0], index)
        tail = self._tail if self._tail is not _UNKNOWN else None
        return self._handed if tail is None else tail[0]((self._handed, *tail[1]))

    def _reach(self, seen: List[tuple], learned: Optional[torch.Tensor]) -> None:
        """At the loop's final block call on the first stage: the stage's output and the message for the next
        stage (one set of extra arguments when every block got the same, else one per block); the step stops.

        Args:
            learned: in the first pass, the stage's output (its blocks ran as they were called).
        """
        for index, _, tensors, _, versions in seen:
            changed = [k for k, (t, v) in enumerate(zip(tensors, versions)) if t._version != v]
            if changed:
                raise BodyCallError(
                    f"the loop changed a tensor in place after giving it to block {index} (its extra tensor argument "
                    f"{changed[0]}, e.g. `scale.mul_(0.5)` between the calls); under PipeStrategy the blocks run after "
                    f"the loop's last call, so block {index} would see the changed value. Give each block its own "
                    "tensor (`scale = scale * 0.5`)"
                )
        _, first, tensors, key, _ = seen[0]
        same = all((structure is first and others is tensors) or (
            (key is None and other_key is None and _same_structure(first, structure) or
             key is not None and other_key == key) and len(tensors) == len(others)
            and all(a is b for a, b in zip(tensors, others))) for _, structure, others, other_key, _ in seen[1:])
        if not same:  # objects as each block's call saw them: their copies from the records
            calls = tuple(join_call(self.channel.lookup(k) if k is not None else structure, others)
                          for _, structure, others, k, _ in seen)
            first, tensors = split_call((), {_PER_BLOCK: calls})
            key = None
        key = key if key is not None else self.channel.publish(first)
        hidden = learned if learned is not None else self.run_checkpointed(
            lambda h: self._run_message_blocks(key, tensors, h, *self.ranges[0]), self._input)
        raise BodyReached((hidden, *tensors, torch.tensor([key], dtype=torch.int64, device=hidden.device)))

    def run_blocks(self, hidden: torch.Tensor, call: Tuple[tuple, dict], start: int, stop: int) -> Any:
        """Blocks ``start..stop-1`` on ``hidden`` with the extra arguments ``call`` (one ``(args, kwargs)`` for all,
        or one per block); the final block's whole return value if it is among them."""
        args, kwargs = call
        per_block = kwargs.get(_PER_BLOCK) if not args and len(kwargs) == 1 else None
        for i in range(start, stop):
            if per_block is not None:
                args, kwargs = per_block[i]
            out = self._call(i, hidden, (args, kwargs))
            if i == self.length - 1:
                return out
            hidden = _hidden_of(out, i)
        return hidden

    def _call(self, index: int, hidden: torch.Tensor, call: Tuple[tuple, dict]) -> Any:
        """Block ``index`` called (see :func:`_call_block`); its first calls in each mode note the attributes it sets
        (in training mode too after validation calls: `if self.training: self.aux_loss = ...`)."""
        block = self.blocks[index]
        watched = self._calls_watched[index]
        if watched[block.training] >= _WATCHED_CALLS:
            return _call_block(block, index, hidden, call)
        watched[block.training] += 1
        out, paths = _assigned_by(lambda: _call_block(block, index, hidden, call), block)
        self.channel.note_assigned(index, block.training, paths)  # the others' reads wait for the first call's note
        return out

    def sets_as_it_runs(self, index: int, path: str) -> bool:
        """Whether block ``index``'s forward sets its plain attribute ``path``: noted from its first calls by the
        process that runs it (this one, or another through the call channel; unknown, so False, before it ran). The
        loop reading such an attribute of a block another stage runs gets the block's initial value (an auxiliary
        loss's None), and where this process runs it, a value the step does not order against its run."""
        return path in (self.channel.assigned_of(index, self.blocks[index].training) or ())

    def _run_message_blocks(self, key: int, tensors: Sequence[torch.Tensor], hidden: torch.Tensor, start: int,
                            stop: int) -> Any:
        return self._on_copy(key, lambda call: self.run_blocks(hidden, join_call(call, tensors), start, stop),
                             f"block {start}" if stop == start + 1 else f"one of blocks {start}..{stop - 1}")

    def _on_copy(self, key: int, run: Any, blocks: str) -> Any:
        """``run(call)`` with the call structure ``key`` holding this run's own copy of its objects (see the
        module docstring), refusing a block that changed one of them: the change would stay in this run's copy,
        unseen by the blocks of other stages and by the loop (an auxiliary loss appended to an attribute, a counter
        the blocks share). A cache's interface (``update`` and ``get_seq_length``, as Hugging Face's caches) is let
        through: each layer writes its own entries and reads back only those."""
        call = self.channel.lookup(key)
        objects = [c for c in call[1] if not isinstance(c, _VALUES) and not _is_cache(c)]
        if not objects:
            return run(call)
        before = [_attributes(o) for o in objects]
        out = run(call)
        for obj, state in zip(objects, before):
            after = _attributes(obj)
            changed = [name for name in {**state, **after} if state.get(name) != after.get(name)]
            if changed:
                raise BodyCallError(
                    f"{blocks} changed the {type(obj).__name__} object the loop gave it (its `{changed[0]}`); under "
                    "PipeStrategy each run of a stage's blocks gets its own copy of such an object, so the change "
                    "would reach neither the blocks of other stages nor your loop (an auxiliary loss appended to it "
                    "would be lost, a count shared by the blocks would restart on every stage). Keep what crosses "
                    "blocks in the hidden state; objects with a cache's interface (`update` and `get_seq_length`, "
                    "as Hugging Face's caches), where each layer reads back only what it wrote, may change"
                )
        return out

    def run_message(self, k: int, hidden: torch.Tensor, *message: torch.Tensor) -> tuple:
        """This rank's ``k``-th stage on a received message ``(hidden, *extra tensors, call id)``."""
        *tensors, key = message
        start, stop = self.ranges[k]
        out = self._run_message_blocks(int(key.item()), tensors, hidden, start, stop)
        if stop == self.length:
            return (out,)  # the last stage: the final block's return value, whole, for the user's loop
        return (out, *tensors, key)

    def forward(self, hidden: torch.Tensor, *message: torch.Tensor) -> tuple:
        """The stage's part of the body on a received message (one stage on this rank)."""
        return self.run_message(0, hidden, *message)


class LayerListChunk(nn.Module):
    """One stage of a rank holding several: that stage's blocks, run by the pipeline on messages.

    It registers the same block objects as the stand-in, but it is no part of the LightningModule.
    """

    passes_inputs_on = True

    def __init__(self, owner: PipelinedLayerList, k: int) -> None:
        super().__init__()
        start, stop = owner.ranges[k]
        for i in range(start, stop):
            self.add_module(str(i), owner.blocks[i])
        self.__dict__["owner"] = owner  # not a submodule
        self.k = k

    def forward(self, hidden: torch.Tensor, *message: torch.Tensor) -> tuple:
        self.owner.refuse_if_released()
        return self.owner.run_message(self.k, hidden, *message)


_METADATA = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.ndim.__get__,
             torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
             torch.Tensor.is_nested.__get__, torch.Tensor.size, torch.Tensor.dim,
             torch.Tensor.numel, torch.Tensor.is_floating_point, torch.Tensor.__len__}
_DEVICE = torch.Tensor.device.__get__


class HiddenStandIn(torch.Tensor):
    """What a block call before the final one returns to the user's loop on the last stage.

    The pipeline ran those blocks on other stages; the real hidden state between them is not here.
    The stand-in has the hidden state's shape, dtype, device and ``requires_grad``, so the loop can
    read them, and it may be passed to the next block call; any other use raises
    :class:`~lightning_pipe.errors.BodyCallError` instead of computing with a wrong value.
    Written with ``__torch_function__`` because torch offers no tensor that refuses to be used.

    Example:
        >>> h = HiddenStandIn.of(torch.zeros(2, 3), index=0)
        >>> h.shape, h.dtype
        (torch.Size([2, 3]), torch.float32)
        >>> h + 1
        Traceback (most recent call last):
        ...
        lightning_pipe.errors.BodyCallError: the loop used the output of block 0 ...
    """

    @staticmethod
    def of(hidden: torch.Tensor, index: int) -> "HiddenStandIn":
        if isinstance(hidden, HiddenStandIn):  # the first stage's loop passes stand-ins on: their meta data again
            meta, device, requires_grad = hidden._meta, hidden._device, hidden._requires_grad
        else:  # (empty_like of a meta tensor subclass goes through torch's slow reference path: 60 µs)
            meta, device, requires_grad = torch.empty_like(hidden, device="meta"), hidden.device, hidden.requires_grad
        stand_in = torch.Tensor._make_subclass(HiddenStandIn, meta, requires_grad)
        stand_in._block, stand_in._device, stand_in._meta, stand_in._requires_grad = index, device, meta, requires_grad
        return stand_in

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func == _DEVICE:  # a new method-wrapper object on every attribute access: compared, not identical
            return args[0]._device
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        refuse_stand_ins((args, kwargs), getattr(func, "__name__", func))
        raise AssertionError("unreachable: a stand-in is among the arguments")

    def __repr__(self) -> str:
        return f"HiddenStandIn(block {self._block}, shape={tuple(self.shape)})"


def refuse_stand_ins(values: Any, use: Any) -> None:
    """Raise :class:`~lightning_pipe.errors.BodyCallError` if ``values`` (any pytree) hold a :class:`HiddenStandIn`:
    the loop's output of a block, used for ``use`` (a torch function's name, a module call) instead of the next
    block's input."""
    block = next((a._block for a in tree_flatten(values)[0] if isinstance(a, HiddenStandIn)), None)
    if block is None:
        return
    raise BodyCallError(
        f"the loop used the output of block {block} for something other than the next block's input ({use}). Under "
        "PipeStrategy the hidden states between blocks stay on the stages that compute them: only the final block's "
        "output reaches your code. Code using per-block outputs (hidden states collected per layer, a residual around "
        f"the call) must move into the blocks. (If the loop stopped after block {block}, before the body's last "
        "block, every block must run, in order, once per call: a loop over part of the list, or one that breaks "
        "early or runs fewer blocks in some steps, is not supported)"
    )


def _refuse_hooks_put_in_step(block: nn.Module, index: int, first: int) -> None:
    """Refuse forward hooks put on ``block`` or its submodules since the step began (hook ids count up globally):
    Hugging Face records per-layer values that way (``output_hidden_states``, ``output_attentions``,
    ``output_router_logits``), and the blocks run on their stages, outside the step, so such a hook records nothing
    there and the step sees an empty tuple. Hooks put before the step (a profiler's) are left alone."""
    for name, module in block.named_modules():
        if any(key >= first for key in itertools.chain(module._forward_hooks, module._forward_pre_hooks)):
            where = f"block {index}" + (f" (its `{name}`)" if name else "")
            raise BodyCallError(
                f"a forward hook was put on {where} during the step (Hugging Face records output_hidden_states, "
                "output_attentions and output_router_logits that way); under PipeStrategy the blocks run on their "
                "stages, outside the step, so it would record nothing and the step would see an empty tuple. Drop "
                "the option (or the hook), or compute what it is needed for inside the blocks"
            )


def _is_cache(obj: Any) -> bool:
    return callable(getattr(type(obj), "update", None)) and callable(getattr(type(obj), "get_seq_length", None))


def _attributes(obj: Any) -> Dict[str, Any]:
    """A shallow view of ``obj``'s attributes to tell a change: plain values by value, containers by identity and
    length, anything else by identity (empty for objects without a ``__dict__``)."""
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict):
        return {}
    return {name: value if isinstance(value, _VALUES) else
            (id(value), len(value) if isinstance(value, (list, dict, set)) else None) for name, value in state.items()}


def _holds_container(values: Any) -> bool:
    """Whether ``values`` hold a list or dict (directly, or in tuples): containers a block could fill that the call
    structure takes apart (any other object reaches the block as its run's own copy, as the module docstring says)."""
    return any(isinstance(v, (list, dict)) or isinstance(v, tuple) and _holds_container(v) for v in values)


def _call_block(block: nn.Module, index: int, hidden: torch.Tensor, call: Tuple[tuple, dict]) -> Any:
    """``block(hidden, *args, **kwargs)``, refusing a block that changes a container it was given: under
    PipeStrategy each run of a stage's blocks gets its own copy of the extra arguments, so what a block puts in a
    list the loop passes (an auxiliary loss per block) would never reach the loop."""
    args, kwargs = call
    if not (_holds_container(args) or _holds_container(kwargs.values())):
        return block(hidden, *args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    out = block(hidden, *args, **kwargs)
    after, spec_after = tree_flatten((args, kwargs))
    if spec_after != spec or any(a is not b for a, b in zip(after, leaves)):
        raise BodyCallError(
            f"block {index} changed a list or dict the loop gave it (e.g. appended an auxiliary loss to it); under "
            "PipeStrategy the blocks run on their stages, each on its own copy of the extra arguments, so what a block "
            "puts there never reaches your loop and would be silently lost. Let the blocks return only the hidden "
            "state; an auxiliary loss can reach the backward through it (an autograd function that returns the hidden "
            "state and gives the loss its gradient in backward, as Megatron's MoE layers do)"
        )
    return out


def _hidden_of(out: Any, index: int) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        rest, _ = tree_flatten(list(out[1:]))
        if any(isinstance(leaf, torch.Tensor) for leaf in rest):
            raise BodyCallError(
                f"block {index} returned {len(out)} values with tensors besides the hidden state; under PipeStrategy "
                "only the hidden state crosses stages, so per-block outputs such as attention maps, key/value caches "
                "or auxiliary losses would be lost: switch them off (e.g. use_cache=False, output_attentions=False). "
                "A loop that hands such an output to the next block (T5's position bias) is not supported: pipeline "
                "another part of the model, or move that value into the blocks"
            )
        return out[0]
    raise BodyCallError(
        f"block {index} returned a {type(out).__name__}; a block must return the hidden state (a tensor) or a tuple "
        "whose first element is the hidden state"
    )
