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

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

_ACCUMULATE = "AccumulateGrad"


def _edge(tensor: torch.Tensor) -> GradientEdge:
    return get_gradient_edge(tensor)


def _walk(roots: Sequence) -> Tuple[List, Dict]:
    """Every node reachable from ``roots`` and, per node, the nodes with an edge to it."""
    parents: Dict = {}
    stack = []
    for node in roots:
        if node not in parents:
            parents[node] = []
            stack.append(node)
    nodes = list(stack)
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
            else:
                known.append(node)
    return nodes, parents


def _input_part(input_nodes: Sequence, parents: Dict) -> set:
    """The nodes with a path to an input node (the input nodes included)."""
    part = {node for node in input_nodes if node in parents}
    stack = list(part)
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in part:
                part.add(parent)
                stack.append(parent)
    return part


class _Components:
    """Union-find over nodes."""

    def __init__(self) -> None:
        self.up: Dict = {}

    def find(self, node):
        up = self.up
        root = node
        while up.setdefault(root, root) is not root:
            root = up[root]
        while up[node] is not root:
            up[node], node = root, up[node]
        return root

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.up[ra] = rb


class WeightGradients:
    """The ``W`` half of one microbatch's backward on one stage, ready to run.

    Attributes:
        groups: per component, ``(edges, gradients, boundary nodes, leaves)``.
    """

    def __init__(self) -> None:
        self.groups: List[Tuple[list, list, list, list]] = []
        self.saved: Dict = {}  # boundary node -> the gradients it received during I

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` (each component once)."""
        for edges, grads, boundary, leaves in self.groups:
            handles = []
            if len(boundary) > 1:  # pin each boundary node to what I saw (see the module docstring)
                for node in boundary:
                    handles.append(node.register_prehook(lambda _, saved=self.saved[node]: saved))
            try:
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=leaves)
            finally:
                for handle in handles:
                    handle.remove()
        self.groups = []
        self.saved = {}


def _capture(saved: Dict, node):
    def hook(grad_outputs):
        saved[node] = grad_outputs

    return hook


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
    root_edges = [_edge(r) for r in roots]
    nodes, parents = _walk([e.node for e in root_edges])
    input_nodes = [_edge(x).node for x in inputs]
    part = _input_part(input_nodes, parents)
    weights = WeightGradients()
    components = _Components()
    boundary = []
    for node in nodes:
        if node in part:
            continue
        components.find(node)
        for parent in parents[node]:
            if parent in part:
                if parent not in components.up:
                    boundary.append(parent)
                components.union(node, parent)
            else:
                components.union(node, parent)
    handles = [node.register_prehook(_capture(weights.saved, node)) for node in boundary]
    try:
        used = [(r, g) for r, e, g in zip(roots, root_edges, grads) if e.node in part]
        if used and inputs:
            input_grads = torch.autograd.grad([r for r, _ in used], list(inputs), [g for _, g in used],
                                              retain_graph=True, allow_unused=True)
        else:
            input_grads = (None,) * len(inputs)
    finally:
        for handle in handles:
            handle.remove()
    _group(weights, components, nodes, part, boundary, zip(root_edges, grads))
    return tuple(input_grads), weights


def _group(weights: WeightGradients, components: _Components, nodes: list, part: set, boundary: list,
           roots) -> None:
    """Fill ``weights.groups``: per component its starting edges and gradients, and its leaves."""
    groups: Dict = {}

    def group(node) -> tuple:
        key = components.find(node)
        if key not in groups:
            groups[key] = ([], [], [], [])
        return groups[key]

    for node in boundary:
        saved = weights.saved.get(node)
        if saved is None:
            continue
        edges, grads, pinned, _ = group(node)
        pinned.append(node)
        for k, grad in enumerate(saved):
            if grad is not None:
                edges.append(GradientEdge(node, k))
                grads.append(grad)
    for edge, grad in roots:
        if edge.node not in part:
            edges, grads, _, _ = group(edge.node)
            edges.append(edge)
            grads.append(grad)
    for node in nodes:
        if node not in part and type(node).__name__ == _ACCUMULATE:
            group(node)[3].append(node.variable)
    weights.groups = [g for g in groups.values() if g[0] and g[3]]
