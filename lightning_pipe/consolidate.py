"""One ordinary Lightning checkpoint file from a sharded checkpoint directory.

Usage::

    python -m lightning_pipe.consolidate <checkpoint dir> <output file>

Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint <dir> --output_file
<file>`` reads the same directories and its output loads too; this one also stores a tied weight
once (one tensor under both keys, as a plain run's checkpoint does) and numbers the optimizer
state ``0, 1, ...`` in the unpartitioned model's order, as a plain run's ``optimizer.state_dict()``
does (Lightning's keeps parameter names, which ``torch.optim`` loads as well). Like Lightning's, it
holds the whole checkpoint in CPU memory once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch

from lightning_pipe.sharded import CURRENT, INFO, META, CheckpointError, Contents, _nest, _raise_if, _read, inspect


def read_info(path: Union[str, Path]) -> Dict[str, Any]:
    """``pipe.json`` of the checkpoint at ``path`` (``{}`` for a sharded checkpoint written by others)."""
    file = Path(path) / INFO
    return json.loads(file.read_text()) if file.is_file() else {}


def numbered(state: Mapping[str, Any], groups: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """A name-keyed optimizer state dict numbered as ``optimizer.state_dict()`` numbers it.

    Example:
        >>> numbered({"b": {"step": 1}}, [{"lr": 0.1, "params": ["a", "b"]}])
        {'state': {1: {'step': 1}}, 'param_groups': [{'lr': 0.1, 'params': [0, 1]}]}
    """
    index: Dict[str, int] = {}
    param_groups = []
    for group in groups:
        start = len(index)
        index.update((name, start + i) for i, name in enumerate(group["params"]))
        param_groups.append(dict(group, params=list(range(start, len(index)))))
    numbered_state = {index[name]: value for name, value in state.items() if name in index}
    return {"state": dict(sorted(numbered_state.items())), "param_groups": param_groups}


def _retie(state_dict: Dict[str, Any], aliases: Mapping[str, str]) -> None:
    """One tensor under an alias and its key, where both hold the same values (a broken tie stays two)."""
    for alias, key in aliases.items():
        a, b = state_dict.get(alias), state_dict.get(key)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b):
            state_dict[alias] = b


def _everything(path: Path, contents: Contents) -> Dict[str, Any]:
    requests = {fqn: contents.template(fqn, torch.device("cpu")) for fqn in contents.metadata.state_dict_metadata}
    return _read(path, requests)


def consolidate(path: Union[str, Path], out: Optional[Union[str, Path]] = None,
                weights_only: Optional[bool] = None) -> Dict[str, Any]:
    """The whole checkpoint of a sharded checkpoint directory, as a plain run would have saved it.

    Args:
        path: the sharded checkpoint directory.
        out: if given, the file to write it to (it must not exist).
        weights_only: passed to ``torch.load`` for ``meta.pt`` (None is False, as in Lightning).

    Returns:
        Lightning's checkpoint dict: the metadata, ``state_dict`` (every key, in the model's order
        when the save passed ``expected_keys``), ``optimizer_states`` and, when saved with a
        weight averaging callback, ``current_model_state`` (the current weights; ``state_dict``
        holds the averages).

    Raises:
        MissingShardError: a shard file is missing or truncated.
        CheckpointMismatchError: ``path`` is not a complete sharded checkpoint, or ``out`` exists.
    """
    path = Path(path)
    contents, problems = inspect(path)
    if out is not None and Path(out).exists():
        problems.append(("mismatch", f"`{out}` exists; choose another output file or remove it"))
    _raise_if([problems], f"cannot consolidate `{path}`")
    assert contents is not None
    values = _everything(path, contents)
    info = read_info(path)
    order = {key: i for i, key in enumerate(info.get("keys", []))}
    def in_order(names: Any) -> List[str]:
        return sorted(names, key=lambda k: (order.get(k, len(order)), k))

    keys = in_order(contents.model)
    state_dict = {key: values[contents.model[key]] for key in keys}
    _retie(state_dict, info.get("aliases", {}))
    # every current weight: a checkpoint hook may have deleted some averaged entries (a frozen weight), not these
    current = {key: values[contents.current[key]] for key in in_order(contents.current)}
    _retie(current, info.get("aliases", {}))
    optimizer_states: List[Dict[str, Any]] = []
    for i, entries in enumerate(contents.groups):
        groups: List[Dict[str, Any]] = []
        for fqn, below in entries:
            _nest(groups, below, values[fqn])  # type: ignore[arg-type]
        state: Dict[str, Any] = {}
        for name, items in contents.state[i].items():
            for fqn, below in items:
                _nest(state, (name, *below), values[fqn])
        optimizer_states.append(numbered(state, groups))
    checkpoint = torch.load(path / META, map_location="cpu", weights_only=bool(weights_only))
    checkpoint["state_dict"] = state_dict
    if optimizer_states:  # none in a weights-only save, whose plain file holds no such key either
        checkpoint["optimizer_states"] = optimizer_states
    if current:
        checkpoint[CURRENT] = current
    if out is not None:
        torch.save(checkpoint, out)
    return checkpoint


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.consolidate", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="the sharded checkpoint directory")
    parser.add_argument("output", help="the checkpoint file to write (must not exist)")
    parser.add_argument("--weights-only", action="store_true", help="load meta.pt with torch.load(weights_only=True)")
    args = parser.parse_args(argv)
    try:
        checkpoint = consolidate(args.checkpoint, args.output, weights_only=args.weights_only)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {len(checkpoint['state_dict'])} state-dict entries, "
          f"{len(checkpoint.get('optimizer_states', []))} optimizer states")
    return 0


if __name__ == "__main__":
    sys.exit(main())
