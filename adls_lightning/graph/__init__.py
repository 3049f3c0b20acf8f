"""Lab 0's graph tooling: capture a model as a ``torch.fx.GraphModule`` (``torch.export``), run passes on it
(remove dropout, per-node report), compare topologies, and draw it. No Lightning here; the command is
``python -m adls_lightning.graph`` (:mod:`adls_lightning.graph.__main__`)."""

from adls_lightning.graph.capture import INPUT_NAMES, capture, example_inputs, module_path
from adls_lightning.graph.diff import GraphDiff, diff, node_key
from adls_lightning.graph.draw import draw, to_dot
from adls_lightning.graph.node_report import NodeReport, annotate, report_rows, summarise, write_csv
from adls_lightning.graph.passes import (
    PASSES,
    count_ops,
    dropout_nodes,
    register_pass,
    remove_dropout,
    remove_dropout_without_rewire,
    run_passes,
)

__all__ = [
    "INPUT_NAMES",
    "PASSES",
    "GraphDiff",
    "NodeReport",
    "annotate",
    "capture",
    "count_ops",
    "diff",
    "draw",
    "dropout_nodes",
    "example_inputs",
    "module_path",
    "node_key",
    "register_pass",
    "remove_dropout",
    "remove_dropout_without_rewire",
    "report_rows",
    "run_passes",
    "summarise",
    "to_dot",
    "write_csv",
]
