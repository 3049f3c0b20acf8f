"""Draw an FX graph to SVG and PNG, nodes coloured by kind (placeholder, get_attr, call_function, call_module,
call_method, output).

Two engines give the same picture (top to bottom, one box per node, edges from inputs to users):

- ``dot``: Graphviz, when its ``dot`` program is on PATH (``apt-get install graphviz``): the best layout.
- ``igraph``: the layered (Sugiyama) layout of python-igraph, a PyPI wheel with its C core inside, drawn with
  matplotlib. It needs no system package, so a fresh ``make install`` without root still gets a picture.

``engine="auto"`` picks ``dot`` when it is installed, otherwise ``igraph``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor
from torch.fx import Graph, GraphModule, Node

from adls_lightning.graph.passes import target_name

ENGINES = ("auto", "dot", "igraph")
FORMATS = ("svg", "png")
# Fill colour per node kind (Graphviz/X11 names, which matplotlib also knows).
KIND_COLOURS = {
    "placeholder": "palegreen",
    "get_attr": "lightgrey",
    "call_function": "lightskyblue",
    "call_module": "orange",
    "call_method": "plum",
    "output": "salmon",
}


def _graph(graph: Graph | GraphModule) -> Graph:
    return graph.graph if isinstance(graph, GraphModule) else graph


def node_label(node: Node) -> str:
    """Box text: the node name, what it calls (short), and its output shape when capture recorded one."""
    # a parameter's node name repeats its whole module path; its last two parts say enough in a box
    lines = [".".join(str(node.target).split(".")[-2:]) if node.op == "get_attr" else node.name]
    if node.op.startswith("call_"):
        target = target_name(node)
        lines.append(target.removeprefix("aten.").removesuffix(".default"))
    value = node.meta.get("val")
    if isinstance(value, Tensor):
        lines.append("[" + ", ".join(str(size) for size in value.shape) + "]")
    return "\n".join(lines)


def layers(graph: Graph) -> dict[Node, int]:
    """Layer (row) of each node: placeholders on top, the longest path from them sets the depth, and every other
    node moves down to just above its first user (so a parameter or an ``arange`` sits next to where it is used)."""
    layer: dict[Node, int] = {}
    for node in graph.nodes:  # FX graphs are in topological order
        layer[node] = (
            0 if node.op == "placeholder" else 1 + max((layer[s] for s in node.all_input_nodes), default=0)
        )
    for node in reversed(graph.nodes):
        if node.op != "placeholder" and node.users:
            layer[node] = max(layer[node], min(layer[user] for user in node.users) - 1)
    return layer


def resolve_engine(engine: str) -> str:
    """``dot`` or ``igraph`` for ``engine`` (``auto``: dot when installed).

    Raises:
        ValueError: an unknown engine, or ``dot`` asked for but not installed.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown draw engine {engine!r} (valid: {', '.join(ENGINES)})")
    has_dot = shutil.which("dot") is not None
    if engine == "dot" and not has_dot:
        raise ValueError("draw engine 'dot': Graphviz's dot is not on PATH (install graphviz or use igraph)")
    if engine == "auto":
        return "dot" if has_dot else "igraph"
    return engine


def draw(
    graph: Graph | GraphModule,
    path: str | Path,
    *,
    engine: str = "auto",
    formats: Sequence[str] = FORMATS,
    title: str | None = None,
) -> list[Path]:
    """Draw ``graph`` to ``path`` with each suffix in ``formats`` (``bert.svg``, ``bert.png``); returns the files.

    Raises:
        ValueError: unknown engine or format.
    """
    unknown = [fmt for fmt in formats if fmt not in FORMATS]
    if unknown:
        raise ValueError(f"unknown draw format {unknown[0]!r} (valid: {', '.join(FORMATS)})")
    graph = _graph(graph)
    stem = Path(path).with_suffix("")
    files = [stem.with_suffix(f".{fmt}") for fmt in formats]
    if resolve_engine(engine) == "dot":
        _draw_dot(graph, files, title)
    else:
        _draw_igraph(graph, files, title)
    return files


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: Graph, title: str | None = None) -> str:
    """Graphviz DOT text of the graph (node ids are the FX node names)."""
    lines = [
        "digraph G {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
    ]
    if title:
        lines.append(f"  label={_dot_quote(title)}; labelloc=t;")
    for node in graph.nodes:
        colour = KIND_COLOURS.get(node.op, "white")
        lines.append(
            f"  {_dot_quote(node.name)} [id={_dot_quote('node-' + node.name)}, "
            f"label={_dot_quote(node_label(node))}, fillcolor={colour}];"
        )
    for node in graph.nodes:
        for src in node.all_input_nodes:
            lines.append(f"  {_dot_quote(src.name)} -> {_dot_quote(node.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _draw_dot(graph: Graph, files: list[Path], title: str | None) -> None:
    source = to_dot(graph, title)
    for file in files:
        subprocess.run(["dot", f"-T{file.suffix[1:]}", "-o", str(file)], input=source, text=True, check=True)


# Layout units -> inches: boxes are 1 unit wide with a gap, rows 1 unit apart.
_INCH_X, _INCH_Y, _BOX_W, _BOX_H = 1.9, 0.75, 0.86, 0.62


def _draw_igraph(graph: Graph, files: list[Path], title: str | None) -> None:
    import igraph
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.collections import LineCollection
    from matplotlib.patches import FancyBboxPatch, Patch

    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    layer = layers(graph)
    # Sugiyama wants every edge to span one layer: a longer edge goes through one dummy vertex per layer it
    # crosses (made here, so the bends are known to belong to that edge), and the dummies take part in the
    # crossing reduction like real nodes.
    vertex_layers = [layer[node] for node in nodes]
    chains: list[list[int]] = []
    for dst in nodes:
        for src in dst.all_input_nodes:
            chain = [index[src]]
            for row in range(layer[src] + 1, layer[dst]):
                vertex_layers.append(row)
                chain.append(len(vertex_layers) - 1)
            chains.append([*chain, index[dst]])
    links = [(a, b) for chain in chains for a, b in zip(chain, chain[1:])]
    layout = igraph.Graph(n=len(vertex_layers), edges=links, directed=True).layout_sugiyama(
        layers=vertex_layers, hgap=1, vgap=1
    )
    coords = layout.coords[: len(vertex_layers)]
    xs = [x for x, _ in coords]
    min_x, width = min(xs), max(xs) - min(xs) + 1
    depth = max(layer.values()) + 1
    fig = plt.figure(figsize=(max(4.0, width * _INCH_X), max(3.0, depth * _INCH_Y + 0.6)))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(min_x - 0.5, min_x + width - 0.5)
    ax.set_ylim(depth - 0.5, -0.5 - 0.6 / _INCH_Y)  # rows go down; 0.6 inch on top for the title and legend
    ax.axis("off")
    # Edges as one line collection and one scatter of arrow heads: one artist per edge is several times slower.
    segments, heads = [], []
    for chain in chains:
        start, end = coords[chain[0]], coords[chain[-1]]
        bends = [coords[vertex] for vertex in chain[1:-1]]
        segments.append([(start[0], start[1] + _BOX_H / 2), *bends, (end[0], end[1] - _BOX_H / 2 - 0.06)])
        heads.append((end[0], end[1] - _BOX_H / 2 - 0.04))
    ax.add_collection(LineCollection(segments, colors="dimgrey", linewidths=0.6, zorder=1))
    if heads:
        ax.scatter(*zip(*heads), marker="v", s=10, color="dimgrey", zorder=1, linewidths=0)
    for node, (x, y) in zip(nodes, coords[: len(nodes)]):
        box = FancyBboxPatch(
            (x - _BOX_W / 2, y - _BOX_H / 2),
            _BOX_W,
            _BOX_H,
            boxstyle="round,pad=0,rounding_size=0.08",
            facecolor=KIND_COLOURS.get(node.op, "white"),
            edgecolor="black",
            linewidth=0.5,
            zorder=2,
            transform=ax.transData,
        )
        box.set_gid(f"node-{node.name}")
        ax.add_artist(box)  # not add_patch: the limits are fixed above, so no per-patch bounds update
        ax.text(x, y, node_label(node), ha="center", va="center", fontsize=6, zorder=3, family="DejaVu Sans")
    handles = [
        Patch(facecolor=colour, edgecolor="black", label=kind) for kind, colour in KIND_COLOURS.items()
    ]
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(0, 1 - 0.3 / fig.get_figheight()),
        ncol=len(handles),
        fontsize=7,
        frameon=False,
        bbox_transform=ax.transAxes,
    )
    if title:
        fig.text(0.5, 1 - 0.15 / fig.get_figheight(), title, ha="center", va="top", fontsize=9)
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        for file in files:
            fig.savefig(file, dpi=80)
    plt.close(fig)
