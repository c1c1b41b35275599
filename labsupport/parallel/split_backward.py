"""The backward pass of a pipeline stage in two parts: B, the gradient of the stage's
input, which the previous stage waits for, and W, the gradients of its weights, which
nobody needs before the optimizer step (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", section 2). Zero-bubble schedules run W later, in slots that would
otherwise be idle.

It follows torch's ``torch.distributed.pipelining._backward`` (``stage_backward_input``
and ``stage_backward_weight``), on the autograd graph of any stage. A weight's gradient
reaches the path from the stage's output to its input at a *join*: a node of that path
with a child off it that leads to weights, a linear layer's ``AddmmBackward`` whose other
children lead to its weight and bias, a LayerNorm's node. :func:`backward_input`
computes the input's gradient only (autograd then skips every output of a node that no
requested gradient needs, the weight halves of the joins' work included) and keeps, at
each join, the gradient that arrived there. :func:`backward_weight` restarts autograd at
the joins from those gradients, asking for the weights only, so nothing on the path to
the input is computed twice.

A stage whose input needs no gradient (the first, which reads token ids) has nothing to
compute in B: its W is the whole backward pass, as torch's runtime does it. A weight
used at two joins (shared by two layers of one stage) is refused: W would add its
gradient twice through the path between them.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge


def _node(t: torch.Tensor):
    """The autograd node of ``t``: its ``grad_fn``, or for a leaf its accumulator."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


def _walk(root) -> list:
    """Every node of the graph below ``root``, each after all the nodes below it."""
    order, opened, done, stack = [], set(), set(), [root]
    while stack:
        node = stack[-1]
        if node not in opened:  # first visit: its children go on top of it
            opened.add(node)
            stack += [c for c, _ in node.next_functions if c is not None and c not in opened]
            continue
        stack.pop()
        if node not in done:  # its children are all done (a graph has no cycles)
            done.add(node)
            order.append(node)
    return order


def backward_input(output, grad, x, weights) -> dict:
    """B: the gradient of the stage's input ``x`` (into ``x.grad``) from ``output`` and its
    gradient ``grad`` (``None`` where ``output`` is the loss); returns what
    :func:`backward_weight` needs to compute the weights' gradients later."""
    grad = torch.ones_like(output) if grad is None else grad
    if not x.requires_grad:  # the first stage: everything is W
        return {"output": output, "grad": grad, "joins": {}}
    target = _node(x)
    weight_nodes = {_node(w): w for w in weights if w.requires_grad}
    to_input, to_weights = {}, {}  # node -> leads to x; node -> the weights it leads to
    for node in _walk(output.grad_fn):
        children = [c for c, _ in node.next_functions if c is not None]
        to_input[node] = node is target or any(to_input[c] for c in children)
        below = {id(weight_nodes[node])} if node in weight_nodes else set()
        to_weights[node] = below.union(*(to_weights[c] for c in children))
    joins, seen = {}, set()  # join node -> (the weights behind it, the gradient it got)
    for node, on_path in to_input.items():
        off = [c for c, _ in node.next_functions if c is not None and not to_input[c]]
        mine = set().union(*(to_weights[c] for c in off)) if on_path else set()
        if mine:
            if mine & seen:
                raise ValueError(
                    "a weight is used at two places of one pipeline stage (shared between "
                    "two of its layers): its gradient cannot be split from the input's; "
                    "run this stage's full backward (a schedule without W actions)"
                )
            seen |= mine
            joins[node] = [w for w in weights if id(w) in mine]
    got: dict = {}
    handles = [n.register_prehook(lambda g, n=n: got.__setitem__(n, g)) for n in joins]
    try:
        (x.grad,) = torch.autograd.grad(output, x, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return {"joins": {n: (joins[n], got[n]) for n in joins if n in got}}


def backward_weight(state: dict) -> None:
    """W: accumulate the weights' gradients into their ``.grad``, restarting autograd at
    each join with the gradient :func:`backward_input` kept there."""
    if "output" in state:  # the first stage: the whole backward pass
        state.pop("output").backward(state.pop("grad"))
        return
    joins = state.pop("joins")
    for i, (node, (weights, grads)) in enumerate(joins.items()):
        edges = [(GradientEdge(node, k), g) for k, g in enumerate(grads) if g is not None]
        outputs, given = zip(*edges, strict=True)
        computed = torch.autograd.grad(
            outputs, weights, given, retain_graph=i < len(joins) - 1, allow_unused=True
        )
        for w, g in zip(weights, computed, strict=True):
            if g is not None:
                w.grad = g if w.grad is None else w.grad + g
