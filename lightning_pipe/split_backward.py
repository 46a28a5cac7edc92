"""A stage's backward in two parts: input gradients now (``I``), weight gradients later (``W``).

Exact for any module, because both parts run autograd on the graph the forward saved; nothing is
assumed about the layers. Legend: the *roots* are what the backward starts from (the stage's
outputs, or its loss, and skip tensors it stashed); the *inputs* are the leaves the stage
received, whose gradients the previous stages wait for.

``I`` walks the graph once from the roots and splits its nodes in two: the *input part*, nodes
with a path to an input, and the *weight part*, the rest (they lead only to parameters and other
leaves). It runs ``torch.autograd.grad`` for the inputs with ``retain_graph=True``; autograd then
executes only the input part, each of its nodes once with its complete gradient, and computes no
output that leads to the weight part (a Linear's node computes its input's gradient, not its
weight's). A pre-hook on each input-part node with an edge into the weight part (a *boundary*
node) keeps the gradient it received.

``W`` starts from those boundary gradients (and from roots that are in the weight part: on the
first stage, whose inputs need no gradient, that is the whole backward) and runs
``torch.autograd.backward(..., inputs=leaves)``, which accumulates into ``.grad`` as a plain
backward does (post-accumulate-grad hooks fire) and re-executes each boundary node only for its
weight-part outputs. Boundary nodes are grouped into connected components of the weight part
and each component runs on its own, so that no input-part work is repeated; where one component
holds two boundary nodes on one input path (a parameter used at two depths, as in ALBERT), the
deeper node's gradient is pinned by a pre-hook to the value ``I`` saw, which keeps the result
exact at the price of repeating the input-part work between them.

This is the approach of torch.distributed.pipelining's ``stage_backward_input`` /
``stage_backward_weight``, written apart: components are built with union-find (merging groups
one parameter at a time can count a parameter in two groups), roots in the weight part are
handled, and every leaf (not only the module's parameters) gets its gradient. The alternative,
``W`` as a second full backward restricted to the parameters, repeats all input-gradient work:
on the benchmark's Linear layers ``I + W`` then costs 1.5 x ``B`` instead of 1 x.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from lightning_pipe.errors import ConfigurationError

# Private API, what torch.autograd.backward and torch.autograd.grad end in; calling it directly
# skips their argument checks (symbolic shape comparisons, ~15 µs a call), a large share of an
# overhead-bound pipeline's backward. The gradients given here have their roots' shapes by
# construction.
_ENGINE = torch.autograd.Variable._execution_engine


def run_backward(roots: Sequence, grads: Sequence[torch.Tensor], keep_graph: bool = False, inputs: Sequence = (),
                 accumulate: bool = True) -> tuple:
    """``torch.autograd.backward`` (``accumulate``) or ``torch.autograd.grad`` (not), unchecked.

    ``roots`` are tensors or ``GradientEdge`` s; with ``accumulate=False`` the gradients of
    ``inputs`` are returned (None where unreachable).
    """
    return _ENGINE.run_backward(tuple(roots), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate)


@contextmanager
def _reentrant_checkpoints_named() -> Iterator[None]:
    """torch refuses a backward restricted to some inputs through a reentrant checkpoint: say what to do instead."""
    try:
        yield
    except RuntimeError as error:
        if "use_reentrant=True" not in str(error):
            raise
        raise ConfigurationError(
            "a layer of this stage runs torch.utils.checkpoint with use_reentrant=True, which cannot compute its "
            "input gradients apart from its weight gradients, as the zero-bubble schedules ('zb_h1', 'zb_h2', 'zbv') do. "
            "Pass use_reentrant=False (Hugging Face: model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False})), let the pipeline checkpoint "
            "(PipeStrategy(checkpoint='always') instead), or use schedule='1f1b'"
        ) from error


def _accumulate_grad_type() -> type:
    leaf = torch.zeros((), requires_grad=True)
    return type(leaf.view_as(leaf).grad_fn.next_functions[0][0])


_ACCUMULATE = _accumulate_grad_type()  # the node class that accumulates into a leaf's .grad


def _walk(roots: Sequence, input_ids: set) -> Tuple[List, Dict, List]:
    """Every node reachable from ``roots``, per node the nodes with an edge to it, and the nodes
    that accumulate into one of the inputs (``input_ids``: their ``id``)."""
    parents: Dict = {}
    stack = []
    for node in roots:
        if node not in parents:
            parents[node] = []
            stack.append(node)
    nodes = list(stack)
    input_nodes = []
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            known = parents.get(child)
            if known is None:
                parents[child] = [node]
                stack.append(child)
                nodes.append(child)
                if type(child) is _ACCUMULATE and id(child.variable) in input_ids:
                    input_nodes.append(child)
            else:
                known.append(node)
    for node in roots:
        if type(node) is _ACCUMULATE and id(node.variable) in input_ids:
            input_nodes.append(node)
    return nodes, parents, input_nodes


def _input_part(input_nodes: Sequence, parents: Dict) -> set:
    """The nodes with a path to an input node (the input nodes included)."""
    part = set(input_nodes)
    stack = list(part)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in part:
                part.add(parent)
                stack.append(parent)
    return part


class WeightGradients:
    """The ``W`` half of one microbatch's backward on one stage, ready to run.

    Attributes:
        groups: per component, ``(edges, gradients, pins, leaves)``; ``pins`` maps each boundary
            node of a component with several to the gradients ``I`` saw per input slot.
    """

    def __init__(self) -> None:
        self.groups: List[Tuple[list, list, dict, list]] = []

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` (each component once)."""
        for edges, grads, pins, leaves in self.groups:
            handles = [node.register_prehook(_pinned(saved)) for node, saved in pins.items()] if len(pins) > 1 else []
            try:
                with _reentrant_checkpoints_named():
                    run_backward(edges, grads, keep_graph=True, inputs=leaves)
            finally:
                for handle in handles:
                    handle.remove()
        self.groups = []


def _pinned(saved: Dict[int, torch.Tensor]):
    def hook(grad_outputs):
        return tuple(saved.get(k, g) for k, g in enumerate(grad_outputs))

    return hook


def _slots(node, parents: Dict, root_edges: Sequence[GradientEdge]) -> List[int]:
    """The input slots of ``node`` that gradients flow into (from its parents and from roots)."""
    slots = {k for parent in parents[node] for child, k in parent.next_functions if child is node}
    slots.update(e.output_nr for e in root_edges if e.node is node)
    return sorted(slots)


def backward_input(
    roots: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]], inputs: Sequence[torch.Tensor]
) -> Tuple[Tuple[Optional[torch.Tensor], ...], WeightGradients]:
    """Compute the gradients of ``inputs`` (``I``) and prepare the weight gradients (``W``).

    Args:
        roots: tensors to backpropagate from (each requires grad).
        grads: their gradients (None for a one-element loss: ones).
        inputs: leaves requiring grad whose gradients are returned (None where unused).

    Example:
        >>> layer = torch.nn.Linear(3, 2)
        >>> x = torch.ones(4, 3, requires_grad=True)
        >>> (dx,), weights = backward_input([layer(x).sum()], [None], [x])
        >>> layer.weight.grad is None, dx.shape
        (True, torch.Size([4, 3]))
        >>> weights.run(); layer.weight.grad[0].tolist()
        [4.0, 4.0, 4.0]
    """
    grads = [g if g is not None else torch.ones_like(r) for r, g in zip(roots, grads)]
    root_edges = [get_gradient_edge(r) for r in roots]
    nodes, parents, input_nodes = _walk([e.node for e in root_edges], {id(x) for x in inputs})
    part = _input_part(input_nodes, parents)
    boundary = [node for node in nodes if node in part and any(c is not None and c not in part for c, _ in node.next_functions)]
    # the gradient entering each boundary slot, captured by the same pass as the inputs' gradients
    captured = [GradientEdge(node, k) for node in boundary for k in _slots(node, parents, root_edges)]
    used = [(e, g) for e, g in zip(root_edges, grads) if e.node in part]
    if used and inputs:
        with _reentrant_checkpoints_named():
            results = run_backward([e for e, _ in used], [g for _, g in used], keep_graph=True,
                                   inputs=list(inputs) + captured, accumulate=False)
    else:
        results = (None,) * (len(inputs) + len(captured))
    weights = WeightGradients()
    weight_roots = [(e, g) for e, g in zip(root_edges, grads) if e.node not in part]
    weights.groups = _components(nodes, part, boundary, captured, results[len(inputs):], weight_roots)
    return tuple(results[: len(inputs)]), weights


def _components(nodes: list, part: set, boundary: list, captured: list, captured_grads, roots: list) -> list:
    """Group the weight part into connected components, each with where ``W`` starts and its leaves."""
    label: Dict = {}  # weight-part node (or boundary node) -> component number
    merged: List[int] = []  # union-find over component numbers

    def find(k: int) -> int:
        while merged[k] != k:
            merged[k] = merged[merged[k]]
            k = merged[k]
        return k

    def explore(start, k: int) -> None:
        stack = [start]
        while stack:
            for child, _ in stack.pop().next_functions:
                if child is None or child in part:
                    continue
                known = label.get(child)
                if known is None:
                    label[child] = k
                    stack.append(child)
                elif find(known) != find(k):
                    merged[find(known)] = find(k)

    starts = list(boundary) + [edge.node for edge, _ in roots]
    for node in starts:
        if node not in label:
            label[node] = len(merged)
            merged.append(len(merged))
        explore(node, label[node])
    groups: Dict[int, tuple] = {}

    def group(node) -> tuple:
        k = find(label[node])
        if k not in groups:
            groups[k] = ([], [], {}, [])
        return groups[k]

    for edge, grad in zip(captured, captured_grads):
        if grad is not None:
            edges, grads, pins, _ = group(edge.node)
            edges.append(edge)
            grads.append(grad)
            pins.setdefault(edge.node, {})[edge.output_nr] = grad
    for edge, grad in roots:
        edges, grads, _, _ = group(edge.node)
        edges.append(edge)
        grads.append(grad)
    for node in nodes:
        if type(node) is _ACCUMULATE and node in label:
            group(node)[3].append(node.variable)
    return [g for g in groups.values() if g[0] and g[3]]
