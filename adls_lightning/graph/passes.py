"""Graph passes: plain functions ``GraphModule -> GraphModule``, registered under a name for the Lab 0 command.

A transform pass edits ``gm.graph`` in place and returns the module (recompiled); an analysis pass writes what it
finds into ``node.meta`` and returns the module unchanged (:mod:`adls_lightning.graph.node_report`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.fx import GraphModule, Node

GraphPass = Callable[[GraphModule], GraphModule]
PASSES: dict[str, GraphPass] = {}


def register_pass(name: str) -> Callable[[GraphPass], GraphPass]:
    """Decorator: make a ``GraphModule -> GraphModule`` function available as ``passes=[name]``."""

    def decorate(fn: GraphPass) -> GraphPass:
        PASSES[name] = fn
        return fn

    return decorate


def run_passes(graph_module: GraphModule, names: Sequence[str]) -> GraphModule:
    """Apply the registered passes ``names`` in order.

    Raises:
        KeyError: a name that is not registered (the message lists the registered ones).
    """
    unknown = [name for name in names if name not in PASSES]
    if unknown:
        raise KeyError(f"unknown pass {unknown[0]!r} (registered: {', '.join(sorted(PASSES))})")
    for name in names:
        graph_module = PASSES[name](graph_module)
    return graph_module


def count_ops(graph_module: GraphModule) -> Counter[str]:
    """How many nodes of each kind: ``op`` for placeholder/get_attr/output, ``op:target`` for calls."""
    counts: Counter[str] = Counter()
    for node in graph_module.graph.nodes:
        counts[
            node.op if node.op in ("placeholder", "get_attr", "output") else f"{node.op}:{target_name(node)}"
        ] += 1
    return counts


def target_name(node: Node) -> str:
    """A short readable name of what a node calls (``aten.linear.default``, ``dropout`` module path, ...)."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


# Function targets that are dropout: what torch.export records (aten.dropout, with ``train`` as its third
# argument) and what torch.fx.symbolic_trace records for a functional call.
DROPOUT_FUNCTIONS = (torch.ops.aten.dropout.default, torch.nn.functional.dropout, torch.dropout)


def is_dropout(node: Node, graph_module: GraphModule) -> bool:
    """A ``call_module`` node of an ``nn.Dropout`` (any of its variants) or a ``call_function`` dropout node."""
    if node.op == "call_module":
        return isinstance(graph_module.get_submodule(str(node.target)), nn.modules.dropout._DropoutNd)
    return node.op == "call_function" and node.target in DROPOUT_FUNCTIONS


def dropout_nodes(graph_module: GraphModule) -> list[Node]:
    """The dropout nodes of a graph, in graph order."""
    return [node for node in graph_module.graph.nodes if is_dropout(node, graph_module)]


def _erase_dropout(graph_module: GraphModule, *, rewire: bool) -> GraphModule:
    for node in dropout_nodes(graph_module):
        if rewire:
            # Dropout's input (its first argument) takes its place in every user; only then can it be erased.
            node.replace_all_uses_with(node.args[0])
        graph_module.graph.erase_node(node)
    if any(node.op == "call_module" for node in graph_module.graph.nodes):
        graph_module.delete_all_unused_submodules()
    graph_module.graph.lint()
    graph_module.recompile()
    return graph_module


@register_pass("remove_dropout")
def remove_dropout(graph_module: GraphModule) -> GraphModule:
    """Remove every dropout node (``call_module`` ``nn.Dropout`` and ``aten.dropout`` / ``F.dropout`` calls),
    rewiring its users to its input. In eval mode dropout is the identity, so outputs are bit-identical."""
    return _erase_dropout(graph_module, rewire=True)


@register_pass("remove_dropout_without_rewire")
def remove_dropout_without_rewire(graph_module: GraphModule) -> GraphModule:
    """Lab 0's mistake: erase dropout nodes without ``replace_all_uses_with``. FX refuses with
    ``RuntimeError: Tried to erase Node dropout but it still had N users in the graph: {...}!``."""
    return _erase_dropout(graph_module, rewire=False)
