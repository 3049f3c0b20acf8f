"""Per-node report (Lab 0's metadata pass): op, target, module, output shape and dtype, parameters and FLOPs.

:func:`annotate` runs the graph once on the inputs it was captured with (``torch.fx.Interpreter``), with
``torch.utils.flop_counter.FlopCounterMode`` around each node, and stores a :class:`NodeReport` in
``node.meta["report"]``. FLOPs are torch's own counts (``2*M*N*K`` for a matrix product; ops without a registered
formula count 0). One exception: on CPU, ``aten.scaled_dot_product_attention`` runs a kernel the counter has no
formula for, so its FLOPs come from the counter's own ``sdpa_flop_count`` on the node's shapes.

Parameters are counted once each, on the first node that reads them (a ``linear`` node holds its weight and bias);
a parameter nobody reads counts on its ``get_attr`` node. So the column sums to the graph's parameter count.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule, Interpreter, Node
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from adls_lightning.graph.capture import EXAMPLE_INPUTS_KEY, module_path
from adls_lightning.graph.passes import register_pass, target_name

REPORT_KEY = "report"


@dataclass(frozen=True)
class NodeReport:
    """One row of the report."""

    name: str
    op: str
    target: str
    module: str
    shape: str
    dtype: str
    params: int
    flops: int


def _describe(value: Any) -> tuple[str, str]:
    """(shape, dtype) text of a node's output: ``2x16x32``/``torch.float32``; tuples joined with ``; ``."""
    if isinstance(value, Tensor):
        return "x".join(str(size) for size in value.shape) or "scalar", str(value.dtype).removeprefix(
            "torch."
        )
    if isinstance(value, (tuple, list)):
        parts = [_describe(item) for item in value]
        return "; ".join(p[0] for p in parts), "; ".join(p[1] for p in parts)
    if isinstance(value, Mapping) or hasattr(value, "to_tuple"):
        items = value.items() if isinstance(value, Mapping) else zip(value.keys(), value.to_tuple())
        parts = [(key, _describe(item)) for key, item in items]
        return "; ".join(f"{k}={p[0]}" for k, p in parts), "; ".join(f"{k}={p[1]}" for k, p in parts)
    return ("" if value is None else type(value).__name__), ""


class _Recorder(Interpreter):
    def __init__(self, graph_module: GraphModule) -> None:
        super().__init__(graph_module)
        self.results: dict[Node, tuple[Any, int]] = {}

    def run_node(self, node: Node) -> Any:
        with FlopCounterMode(display=False) as counter:
            value = super().run_node(node)
        flops = counter.get_total_flops()
        if flops == 0 and node.target is torch.ops.aten.scaled_dot_product_attention.default:
            query, key, value_ = (self.env[arg] for arg in node.args[:3])
            flops = sdpa_flop_count(query.shape, key.shape, value_.shape)
        self.results[node] = (value, flops)
        return value


def _parameter_owners(graph_module: GraphModule) -> dict[Node, int]:
    """Parameter count per node: each parameter on the first node (in graph order) that reads it."""
    parameter_ids = {id(p) for p in graph_module.parameters()}
    seen: set[int] = set()
    counts: dict[Node, int] = {}
    get_attrs = {}
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            tensor = _fetch_attr(graph_module, str(node.target))
            if id(tensor) in parameter_ids:
                get_attrs[node] = tensor
    for node in graph_module.graph.nodes:
        readers = [node] if node in get_attrs and not node.users else node.all_input_nodes
        for source in readers:
            tensor = get_attrs.get(source)
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                counts[node] = counts.get(node, 0) + tensor.numel()
    return counts


def _fetch_attr(graph_module: GraphModule, target: str) -> Any:
    obj: Any = graph_module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@register_pass("report")
def annotate(graph_module: GraphModule) -> GraphModule:
    """Analysis pass: store a :class:`NodeReport` in every ``node.meta["report"]`` (runs the graph once on the
    inputs :func:`~adls_lightning.graph.capture` kept in ``graph_module.meta``).

    Raises:
        ValueError: the module has no example inputs (it was not made by ``capture``).
    """
    inputs = graph_module.meta.get(EXAMPLE_INPUTS_KEY)
    if inputs is None:
        raise ValueError(
            "report: the graph module has no example inputs (capture it with adls_lightning.graph.capture)"
        )
    recorder = _Recorder(graph_module)
    placeholders = [node.target for node in graph_module.graph.nodes if node.op == "placeholder"]
    with torch.no_grad():
        recorder.run(*(inputs[name] for name in placeholders))
    params = _parameter_owners(graph_module)
    for node in graph_module.graph.nodes:
        value, flops = recorder.results.get(node, (None, 0))
        shape, dtype = _describe(value)
        node.meta[REPORT_KEY] = NodeReport(
            name=node.name,
            op=node.op,
            target=target_name(node),
            module=module_path(node),
            shape=shape,
            dtype=dtype,
            params=params.get(node, 0),
            flops=int(flops),
        )
    return graph_module


def report_rows(graph_module: GraphModule) -> list[NodeReport]:
    """The per-node rows in graph order (runs :func:`annotate`, so they describe the graph as it is now)."""
    annotate(graph_module)
    return [node.meta[REPORT_KEY] for node in graph_module.graph.nodes]


def write_csv(rows: Iterable[NodeReport], path: str | Path) -> Path:
    """Write the rows as CSV with a header (the :class:`NodeReport` field names)."""
    path = Path(path)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[field.name for field in fields(NodeReport)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)
    return path


def summarise(rows: list[NodeReport]) -> str:
    """A short printed table: node count per op kind, the most frequent call targets, parameter and FLOP totals."""
    by_op: dict[str, int] = {}
    by_target: dict[str, list[int]] = {}
    for row in rows:
        by_op[row.op] = by_op.get(row.op, 0) + 1
        if row.op.startswith("call_"):
            entry = by_target.setdefault(row.target, [0, 0, 0])
            entry[0] += 1
            entry[1] += row.params
            entry[2] += row.flops
    lines = [
        f"{len(rows)} nodes: " + ", ".join(f"{op} {count}" for op, count in sorted(by_op.items())),
        f"{'target':<44} {'nodes':>6} {'params':>12} {'FLOPs':>14}",
    ]
    for target, (count, params, flops) in sorted(
        by_target.items(), key=lambda item: (-item[1][2], -item[1][0])
    ):
        lines.append(f"{target:<44} {count:>6} {params:>12,} {flops:>14,}")
    lines.append(
        f"{'total':<44} {len(rows):>6} {sum(r.params for r in rows):>12,} {sum(r.flops for r in rows):>14,}"
    )
    return "\n".join(lines)
