"""Sharded checkpoints: every rank writes and reads only its own tensors (``torch.distributed.checkpoint``).

The directory is the one Lightning's FSDPStrategy writes with ``state_dict_type="sharded"``, so
Lightning's own ``python -m lightning.pytorch.utilities.consolidate_checkpoint <dir>`` turns it into
one ordinary checkpoint; :func:`lightning_pipe.consolidate.consolidate` (``python -m lightning_pipe.consolidate``)
does the same and also stores tied weights once and numbers the optimizer state as a plain run does.

Layout of ``<dir>``::

    .metadata          DCP's index: every entry's shape, dtype and place (written last, so a
                       directory without it is an incomplete save)
    __<rank>_0.distcp  the entries rank <rank> wrote
    meta.pt            the rest of Lightning's checkpoint dict (epoch, loops, callbacks, ...), rank 0
    pipe.json          this format's version and the tied state-dict keys (alias -> key)

Entries are keyed by the *unpartitioned* model's names, so a checkpoint written under one layout
loads under any ``pipe_size`` x dp (resharding is loading other keys):

    model.<state-dict key>                               every tensor of the model
    current_model_state.<state-dict key>                 with a weight averaging callback (``model`` then
                                                         holds the averages): the current weights
    optimizer_<i>.state.<parameter name>.<state key>     e.g. ``optimizer_0.state.layers.3.weight.exp_avg``
    optimizer_<i>.param_groups.<g>.<hyperparameter>      ``params`` is the group's parameter names

Replicas (data-parallel copies of a stage) may all pass their tensors: DCP writes an entry that
several ranks hold once (on the rank with the least to write so far), so replicas share the writing.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from lightning_pipe.errors import PipelineError

FORMAT = 1
META = "meta.pt"  # Lightning's name (lightning.fabric.utilities.load._METADATA_FILENAME)
INFO = "pipe.json"
INDEX = ".metadata"  # DCP's name
CURRENT = "current_model_state"  # Lightning's WeightAveraging: the current weights beside the averaged ones

Problem = Tuple[str, str]  # ("missing" | "mismatch", text)


class CheckpointError(PipelineError, ValueError):
    """A checkpoint cannot be written or read as asked."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's keys, shapes or optimizers do not match the model (or it is not a checkpoint at all)."""


class MissingShardError(CheckpointError, FileNotFoundError):
    """A file of a sharded checkpoint is missing or truncated."""


# -- collectives and DCP ---------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _exchange(value: Any, group: Any) -> List[Any]:
    """Every rank's ``value`` on every rank (one small collective; just ``[value]`` alone)."""
    if not _distributed():
        return [value]
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _few(names: Sequence[str], limit: int = 8) -> str:
    """``"`a`, `b` and 3 more"`` (``"none"`` when empty)."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(f"`{n}`" for n in names[:limit]) + more if names else "none"


def _raise_if(per_rank: Sequence[Sequence[Problem]], what: str, common: Sequence[Problem] = ()) -> None:
    """One error on every rank listing each problem once, with the ranks that found it."""
    ranks: Dict[Problem, List[int]] = {tuple(p): [] for p in common}  # type: ignore[misc]
    for rank, problems in enumerate(per_rank):
        for problem in problems:
            ranks.setdefault(tuple(problem), []).append(rank)  # type: ignore[arg-type]
    if ranks:
        lines = [f"- {text}" + (f" (rank {', '.join(map(str, r))})" if r and len(per_rank) > 1 else "")
                 for (_, text), r in ranks.items()]
        error = MissingShardError if any(kind == "missing" for kind, _ in ranks) else CheckpointMismatchError
        raise error(f"{what}; nothing was changed:\n" + "\n".join(lines))


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # DCP warns on every single-process save and load
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # replacing one is intended
        yield


def _read(path: Path, requests: Dict[str, Any]) -> Dict[str, Any]:
    """Read the entries named by ``requests`` (fqn -> tensor to fill, or None for an object), alone.

    No collective: each rank reads its own entries. ``flatten_sharded_tensors=False``: with torch's
    default the planner puts the objects it reads into a copy of ``requests``, not into it.
    """
    if requests:
        with _quiet():
            dcp.load(requests, storage_reader=FileSystemReader(path),
                     planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    return requests


def _nest(root: Dict[Any, Any], keys: Sequence[Any], value: Any) -> None:
    """``root[k0][k1]... = value``, creating dicts below names and lists below indices."""
    node: Any = root
    for key, following in zip(keys[:-1], keys[1:]):
        present = node.get(key) if isinstance(node, dict) else (node[key] if key < len(node) else None)
        if present is None:
            present = [] if isinstance(following, int) else {}
            _put(node, key, present)
        node = present
    _put(node, keys[-1], value)


def _put(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
    node[key] = value


# -- what a checkpoint holds -----------------------------------------------------------------------
class Contents:
    """The entries of a sharded checkpoint, from its index alone (no tensor is read).

    Attributes:
        metadata: DCP's index.
        model: ``{state-dict key: fqn}``.
        current: ``{state-dict key: fqn}`` of the current weights saved beside averaged ones (else empty).
        state: per optimizer, ``{parameter name: [(fqn, path below the name)]}``.
        groups: per optimizer, ``[(fqn, path below param_groups)]``.
    """

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        self.model: Dict[str, str] = {}
        self.current: Dict[str, str] = {}
        state: Dict[int, Dict[str, List[Tuple[str, tuple]]]] = {}
        groups: Dict[int, List[Tuple[str, tuple]]] = {}
        for fqn, path in (metadata.planner_data or {}).items():  # fqn -> the keys that led to the entry
            head = str(path[0])
            if head == "model" and len(path) == 2:
                self.model[str(path[1])] = fqn
            elif head == CURRENT and len(path) == 2:
                self.current[str(path[1])] = fqn
            elif head.startswith("optimizer_") and head[len("optimizer_"):].isdigit() and len(path) > 2:
                index = int(head[len("optimizer_"):])
                if path[1] == "state" and len(path) > 3:
                    state.setdefault(index, {}).setdefault(str(path[2]), []).append((fqn, tuple(path[3:])))
                elif path[1] == "param_groups":
                    groups.setdefault(index, []).append((fqn, tuple(path[2:])))
        count = max([*state, *groups], default=-1) + 1
        self.state = [state.get(i, {}) for i in range(count)]
        self.groups = [groups.get(i, []) for i in range(count)]

    def template(self, fqn: str, device: torch.device) -> Optional[torch.Tensor]:
        """An empty tensor shaped like the entry (scalars on the CPU, as optimizers keep steps), or None."""
        entry = self.metadata.state_dict_metadata[fqn]
        if isinstance(entry, BytesStorageMetadata):
            return None
        where = device if len(entry.size) else torch.device("cpu")
        return torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device=where)

    def shards(self, path: Path) -> List[Problem]:
        """The files the index names that are missing or shorter than the entries they hold."""
        needed: Dict[str, Tuple[int, str]] = {}
        for index, info in (self.metadata.storage_data or {}).items():
            end, example = needed.get(info.relative_path, (0, index.fqn))
            needed[info.relative_path] = (max(end, info.offset + info.length), example)
        problems = []
        for name, (end, example) in sorted(needed.items()):
            file = path / name
            if not file.is_file():
                problems.append(("missing", f"shard file `{file}` is missing (it holds e.g. `{example}`); "
                                            "copy the whole checkpoint directory"))
            elif file.stat().st_size < end:
                problems.append(("missing", f"shard file `{file}` is truncated ({file.stat().st_size} bytes, its "
                                            f"entries need {end}); the save was interrupted or the copy incomplete"))
        return problems


def inspect(path: Union[str, Path]) -> Tuple[Optional[Contents], List[Problem]]:
    """What the sharded checkpoint at ``path`` holds, and what is wrong with its files."""
    path = Path(path)
    if not path.exists():
        return None, [("missing", f"there is no checkpoint at `{path}`")]
    for name, role in ((INDEX, "DCP's index, written last"), (META, "Lightning's metadata")):
        if not (path / name).is_file():
            return None, [("mismatch", f"`{path}` is not a complete sharded checkpoint: it has no `{name}` ({role}); "
                                       "pass the directory of a save that finished")]
    try:
        contents = Contents(FileSystemReader(path).read_metadata())
    except Exception as error:  # a corrupt index: report it as any other problem, on every rank
        return None, [("mismatch", f"cannot read `{path / INDEX}`: {type(error).__name__}: {error}")]
    return contents, contents.shards(path)


# -- save ------------------------------------------------------------------------------------------
def _save_problems(path: Path, module_state: Mapping[str, Any], optimizer_states: Sequence[Mapping[str, Any]],
                   layouts: Sequence[Sequence[Sequence[str]]]) -> List[Problem]:
    texts = []
    if path.is_file():
        texts.append(f"`{path}` is a file, and a sharded checkpoint is a directory: choose another path or remove it")
    meta = sorted(k for k, t in module_state.items() if isinstance(t, torch.Tensor) and t.is_meta)
    if meta:
        texts.append(f"entries on the meta device cannot be saved: {_few(meta)}; materialize them first")
    if len(optimizer_states) != len(layouts):
        texts.append(f"{len(optimizer_states)} optimizer states but {len(layouts)} layouts; pass one per optimizer")
    for i, (state, layout) in enumerate(zip(optimizer_states, layouts)):
        stray = sorted(set(state["state"]) - {n for group in layout for n in group})
        if stray:
            texts.append(f"optimizer {i} has state for parameters outside its layout: {_few(stray)}")
        if len(state["groups"]) != len(layout):
            texts.append(f"optimizer {i} has {len(state['groups'])} param groups but its layout {len(layout)}")
    return [("mismatch", text) for text in texts]


def _union_problems(keys_per_rank: Sequence[Sequence[str]], expected_keys: Sequence[str],
                    aliases: Mapping[str, str]) -> List[Problem]:
    union = {k for keys in keys_per_rank for k in keys}
    union |= {alias for alias, key in aliases.items() if key in union}
    missing = [k for k in expected_keys if k not in union]
    unexpected = sorted(union - set(expected_keys))
    if not (missing or unexpected):
        return []
    return [("mismatch", f"the ranks together hold other keys than the model's: no rank saves {_few(missing)}; "
                         f"not the model's: {_few(unexpected)}")]


def save_sharded(path: Union[str, Path], module_state: Mapping[str, Any],
                 optimizer_states: Sequence[Mapping[str, Any]] = (), layouts: Sequence[Sequence[Sequence[str]]] = (),
                 metadata: Optional[Mapping[str, Any]] = None, *, aliases: Optional[Mapping[str, str]] = None,
                 expected_keys: Optional[Sequence[str]] = None, current_state: Optional[Mapping[str, Any]] = None,
                 group: Any = None) -> None:
    """Write a sharded checkpoint; a collective over ``group``: every rank writes only what it passes.

    Args:
        path: the checkpoint directory (created; entries of an earlier save there are replaced).
        module_state: ``{unpartitioned state-dict key: tensor}`` this rank owns (replicas may pass
            the same keys: each entry is written once).
        optimizer_states: per optimizer, ``{"state": {parameter name: {key: tensor or number}},
            "groups": [hyperparameters of each param group]}`` for the parameters this rank owns
            (:func:`lightning_pipe.lightning.state.optimizer_contribution`).
        layouts: per optimizer, the parameter names of each param group in the unpartitioned order.
        metadata: the rest of Lightning's checkpoint dict; only rank 0 of ``group`` needs to pass it.
        aliases: ``{alias key: key}`` of tensors registered twice; an alias is written by the rank
            that passes its key, so the directory holds every key of the model.
        expected_keys: the unpartitioned model's keys (aliases included); if given, the ranks
            together must pass exactly these (checked before anything is written).
        current_state: with a weight averaging callback, whose averages ``module_state`` then
            holds: the current weights, under the same keys as ``module_state`` or more (a checkpoint
            hook may delete averaged entries, as it may under DDP).
        group: the process group of every rank that saves (default: the world).

    Raises:
        CheckpointMismatchError: on every rank, before anything is written: ``path`` is a file,
            a tensor is on the meta device, optimizer state outside its layout, or keys that
            differ from ``expected_keys``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:  # one process: no process group needed
        ...     save_sharded(folder, {"w": torch.ones(2)}, metadata={"epoch": 3})
        ...     loaded = load_sharded(folder, {"w": torch.zeros(2)})
        >>> loaded["epoch"], loaded["state_dict"]["w"]
        (3, tensor([1., 1.]))
    """
    path, aliases = Path(path), dict(aliases or {})
    try:  # whatever goes wrong here must reach the exchange, or the other ranks would wait forever
        problems = _save_problems(path, module_state, optimizer_states, layouts)
        current_keys = set(_with_aliases(current_state, aliases)) if current_state is not None else set()
        if current_state is not None and not set(module_state) <= current_keys:
            problems.append(("mismatch", "the averaged weights hold keys the current ones lack: "
                                         f"{_few(sorted(set(module_state) - current_keys))}"))
    except Exception as error:
        problems = [("mismatch", f"cannot check what to save: {type(error).__name__}: {error}")]
    verdicts = _exchange((problems, sorted(module_state) if expected_keys is not None else []), group)
    common = _union_problems([k for _, k in verdicts], expected_keys, aliases) if expected_keys is not None else []
    _raise_if([p for p, _ in verdicts], f"cannot save the sharded checkpoint `{path}`", common)
    path.mkdir(parents=True, exist_ok=True)
    first = not _distributed() or dist.get_rank(group) == 0
    if first:
        (path / INDEX).unlink(missing_ok=True)  # until the new index is written, the directory is incomplete
        torch.save(dict(metadata or {}), path / META)
        info = {"format": FORMAT, "aliases": aliases, "keys": list(expected_keys or [])}
        (path / INFO).write_text(json.dumps(info, indent=1))
    state: Dict[str, Any] = {"model": _with_aliases(module_state, aliases)}
    if current_state is not None:
        state[CURRENT] = _with_aliases(current_state, aliases)
    for i, (optimizer, layout) in enumerate(zip(optimizer_states, layouts)):
        state[f"optimizer_{i}"] = {"state": dict(optimizer["state"])}
        if first:  # the hyperparameters and the whole layout, once
            state[f"optimizer_{i}"]["param_groups"] = [dict(g, params=list(names))
                                                       for g, names in zip(optimizer["groups"], layout)]
    with _quiet():
        dcp.save(state, checkpoint_id=path, process_group=group, no_dist=not _distributed())


def _with_aliases(tensors: Mapping[str, Any], aliases: Mapping[str, str]) -> Dict[str, Any]:
    out = dict(tensors)
    out.update((alias, out[key]) for alias, key in aliases.items() if key in out and alias not in out)
    return out


# -- load ------------------------------------------------------------------------------------------
def _key_problems(saved: Mapping[str, str], module_state: Mapping[str, Any],
                  expected_keys: Optional[Sequence[str]], strict: bool) -> List[Problem]:
    wanted = list(expected_keys) if expected_keys is not None else list(module_state)
    missing = [k for k in wanted if k not in saved]
    unexpected = sorted(set(saved) - set(expected_keys)) if expected_keys is not None else []
    if wanted and len(missing) == len(wanted):
        return [("mismatch", f"none of the model's keys is in the checkpoint (it holds e.g. {_few(sorted(saved), 3)}): "
                             "it was saved from another model")]
    if strict and (missing or unexpected):
        return [("mismatch", f"the checkpoint's keys do not match the model's: missing {_few(missing)}; unexpected "
                             f"{_few(unexpected)}. Load a checkpoint of this model, or load with strict=False "
                             "(`strict_loading = False`) to skip them")]
    return []


def _model_problems(contents: Contents, module_state: Mapping[str, Any], expected_keys: Optional[Sequence[str]],
                    strict: bool) -> List[Problem]:
    problems = _key_problems(contents.model, module_state, expected_keys, strict)
    meta = sorted(k for k, t in module_state.items() if isinstance(t, torch.Tensor) and t.is_meta)
    if meta:
        problems.append(("mismatch", f"tensors to load into are on the meta device: {_few(meta)}; materialize "
                                     "them first (lightning_pipe.init.materialize, or torch.empty_like)"))
    differ = []
    for key, template in module_state.items():
        entry = contents.metadata.state_dict_metadata.get(contents.model.get(key, ""))
        if entry is None:
            continue
        if isinstance(template, torch.Tensor) == isinstance(entry, BytesStorageMetadata):
            differ.append(f"`{key}`: {'an object' if isinstance(entry, BytesStorageMetadata) else 'a tensor'} in the "
                          "checkpoint")
        elif isinstance(template, torch.Tensor) and tuple(entry.size) != tuple(template.shape):
            differ.append(f"`{key}`: checkpoint {tuple(entry.size)}, model {tuple(template.shape)}")
    if differ:
        more = f" and {len(differ) - 8} more" if len(differ) > 8 else ""
        problems.append(("mismatch", f"entries differ from the model's: {'; '.join(differ[:8])}{more}; the "
                                     "checkpoint was saved from another model (or configuration)"))
    return problems


def _read_groups(path: Path, contents: Contents) -> List[List[Dict[str, Any]]]:
    """Every optimizer's param groups (hyperparameters and parameter names: small, read by every rank)."""
    requests = _read(path, {fqn: None for entries in contents.groups for fqn, _ in entries})
    out: List[List[Dict[str, Any]]] = []
    for entries in contents.groups:
        groups: List[Dict[str, Any]] = []
        for fqn, below in entries:
            _nest(groups, below, requests[fqn])  # type: ignore[arg-type]
        out.append(groups)
    return out


def _layout_difference(index: int, layout: Sequence[Sequence[str]], saved: Sequence[Sequence[str]]) -> str:
    only_model = [n for group in layout for n in group if n not in {m for g in saved for m in g}]
    only_saved = [n for group in saved for n in group if n not in {m for g in layout for m in g}]
    return (f"optimizer {index}'s param groups differ: {[len(g) for g in layout]} parameters in the model's, "
            f"{[len(g) for g in saved]} in the checkpoint's; only in the model: {_few(only_model)}; only in the "
            f"checkpoint: {_few(only_saved)}; configure the param groups of the run that saved it")


def _optimizer_problems(groups: Sequence[Sequence[Mapping[str, Any]]], optimizer_names: Sequence[Sequence[str]],
                        layouts: Optional[Sequence[Sequence[Sequence[str]]]]) -> List[Problem]:
    if len(optimizer_names) != len(groups):
        return [("mismatch", f"the model has {len(optimizer_names)} optimizers but the checkpoint {len(groups)}: "
                             "configure the optimizers of the run that saved it")]
    problems: List[Problem] = []
    for i, (names, saved) in enumerate(zip(optimizer_names, groups)):
        saved_layout = [list(g.get("params", [])) for g in saved]
        known = {n for group in saved_layout for n in group}
        stray = [n for n in names if n not in known]
        if stray:
            problems.append(("mismatch", f"optimizer {i}: the checkpoint has no parameter named {_few(stray)}"))
        if layouts is not None and list(map(list, layouts[i])) != saved_layout:
            problems.append(("mismatch", _layout_difference(i, layouts[i], saved_layout)))
    return problems


def _optimizer_requests(contents: Contents, optimizer_names: Sequence[Sequence[str]],
                        device: torch.device) -> Dict[str, Any]:
    return {fqn: contents.template(fqn, device) for i, names in enumerate(optimizer_names)
            for name in names for fqn, _ in contents.state[i].get(name, [])}


def load_sharded(path: Union[str, Path], module_state: Dict[str, Any],
                 optimizer_names: Optional[Sequence[Sequence[str]]] = None, *,
                 layouts: Optional[Sequence[Sequence[Sequence[str]]]] = None,
                 expected_keys: Optional[Sequence[str]] = None, strict: bool = True,
                 device: Optional[torch.device] = None, group: Any = None,
                 weights_only: Optional[bool] = None) -> Dict[str, Any]:
    """Read this rank's part of a sharded checkpoint (any layout wrote it); checks are agreed on by ``group``.

    Args:
        path: the checkpoint directory.
        module_state: ``{unpartitioned state-dict key: tensor}`` this rank needs; the tensors are
            filled in place (they must be real, not meta).
        optimizer_names: per optimizer, the parameter names whose state this rank needs; None to
            skip optimizer state (not fitting).
        layouts: per optimizer, the model's param groups by name (unpartitioned); if given, they
            must equal the checkpoint's.
        expected_keys: every key of the unpartitioned model, so that every rank checks all of them
            (else each checks its own).
        strict: refuse keys that are missing or unexpected (shapes always have to match).
        device: where optimizer state goes (default: the device of ``module_state``'s tensors).
        group: the ranks that load together: a problem any of them finds is raised on all of them
            (one small collective); None for the world.
        weights_only: passed to ``torch.load`` for ``meta.pt`` (None is False, as in Lightning).

    Returns:
        Lightning's checkpoint dict for this rank: the metadata, ``"state_dict"`` (``module_state``)
        and, with ``optimizer_names``, ``"optimizer_states"``: per optimizer
        ``{"state": {name: {...}}, "param_groups": [...]}`` keyed by parameter name, with this
        rank's names only and each group's ``params`` listing the checkpoint's names; and, when the
        checkpoint holds current weights beside averaged ones (``"state_dict"`` then holds the
        averages), ``"current_model_state"``: new tensors like ``module_state``'s, under its keys (those
        of them saved: all, where a checkpoint hook deleted some averaged entries).

    Raises:
        MissingShardError: a shard file is missing or truncated, or nothing is at ``path``.
        CheckpointMismatchError: keys, shapes, optimizers or param groups differ from the model's,
            or ``path`` is not a complete sharded checkpoint. Raised on every rank of ``group``
            before any tensor is changed.
    """
    path = Path(path)
    contents, problems = inspect(path)
    groups: List[List[Dict[str, Any]]] = []
    try:  # whatever goes wrong here must reach the exchange, or the other ranks would wait forever
        if contents is not None:
            problems += _model_problems(contents, module_state, expected_keys, strict)
            if optimizer_names is not None and not problems:
                groups = _read_groups(path, contents)
                problems += _optimizer_problems(groups, optimizer_names, layouts)
    except Exception as error:
        problems.append(("mismatch", f"cannot check the checkpoint: {type(error).__name__}: {error}"))
    _raise_if(_exchange(problems, group), f"cannot load the sharded checkpoint `{path}`")
    assert contents is not None  # no problem means an index was read
    tensors = [t for t in module_state.values() if isinstance(t, torch.Tensor)]
    device = torch.device(device) if device is not None else tensors[0].device if tensors else torch.device("cpu")
    fqns = {key: contents.model[key] for key in module_state if key in contents.model}
    requests = {fqn: module_state[key] if isinstance(module_state[key], torch.Tensor) else None
                for key, fqn in fqns.items()}
    requests.update(_optimizer_requests(contents, optimizer_names or [], device))
    current = {key: contents.current[key] for key in module_state if key in contents.current} if contents.current else {}
    requests.update((fqn, torch.empty_like(module_state[key]) if isinstance(module_state[key], torch.Tensor) else None)
                    for key, fqn in current.items())
    _read(path, requests)
    for key, fqn in fqns.items():
        module_state[key] = requests[fqn]  # tensors were filled in place; objects are new
    checkpoint = torch.load(path / META, map_location="cpu", weights_only=bool(weights_only))
    checkpoint["state_dict"] = module_state
    if contents.current:
        checkpoint[CURRENT] = {key: requests[fqn] for key, fqn in current.items()}
    if optimizer_names is not None:
        checkpoint["optimizer_states"] = []
        for i, names in enumerate(optimizer_names):
            state: Dict[str, Any] = {}
            for name in names:
                for fqn, below in contents.state[i].get(name, []):
                    _nest(state, (name, *below), requests[fqn])
            checkpoint["optimizer_states"].append({"state": state, "param_groups": groups[i]})
    return checkpoint
