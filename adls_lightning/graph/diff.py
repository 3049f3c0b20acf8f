"""Topology difference of two graphs (Lab 0: what changes when attention_mask / labels are traced).

Node names cannot be matched across graphs: FX numbers them in order (``linear_3``), so one extra node early on
renames every later one. Nodes are matched by what they are instead, their :func:`node_key`: kind, target and the
module they were recorded in (``call_function aten.linear.default @ bert.encoder.layer.0.attention.self.query``);
placeholders by their name. The difference is the multiset difference of keys, and of edges as key pairs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch.fx import Graph, GraphModule, Node

from adls_lightning.graph.capture import module_path
from adls_lightning.graph.passes import target_name


def node_key(node: Node) -> str:
    """What a node is, independent of its name: ``op target @ module`` (``placeholder input_ids`` for inputs)."""
    if node.op in ("placeholder", "output"):
        return f"{node.op} {node.target}"
    where = module_path(node)
    return f"{node.op} {target_name(node)}" + (f" @ {where}" if where else "")


@dataclass(frozen=True)
class GraphDiff:
    """Nodes and edges (as :func:`node_key` strings, one entry per occurrence) in one graph but not the other."""

    added_nodes: list[str]
    removed_nodes: list[str]
    added_edges: list[tuple[str, str]]
    removed_edges: list[tuple[str, str]]

    def summary(self, name_a: str = "a", name_b: str = "b") -> str:
        """Readable text: counts, then each added/removed node."""
        lines = [
            f"{name_a} -> {name_b}: +{len(self.added_nodes)} nodes, -{len(self.removed_nodes)} nodes, "
            f"+{len(self.added_edges)} edges, -{len(self.removed_edges)} edges"
        ]
        lines += [f"  + {key}" for key in self.added_nodes]
        lines += [f"  - {key}" for key in self.removed_nodes]
        return "\n".join(lines)


def _graph(graph: Graph | GraphModule) -> Graph:
    return graph.graph if isinstance(graph, GraphModule) else graph


def _expand(counter: Counter) -> list:
    return sorted(counter.elements())


def diff(graph_a: Graph | GraphModule, graph_b: Graph | GraphModule) -> GraphDiff:
    """What ``graph_b`` has that ``graph_a`` has not (added) and the reverse (removed)."""
    nodes_a = Counter(node_key(n) for n in _graph(graph_a).nodes)
    nodes_b = Counter(node_key(n) for n in _graph(graph_b).nodes)
    edges_a = Counter(
        (node_key(src), node_key(dst)) for dst in _graph(graph_a).nodes for src in dst.all_input_nodes
    )
    edges_b = Counter(
        (node_key(src), node_key(dst)) for dst in _graph(graph_b).nodes for src in dst.all_input_nodes
    )
    return GraphDiff(
        added_nodes=_expand(nodes_b - nodes_a),
        removed_nodes=_expand(nodes_a - nodes_b),
        added_edges=_expand(edges_b - edges_a),
        removed_edges=_expand(edges_a - edges_b),
    )
