"""The compile callback on the tiny BERT: torch's own counters reported, checkpoints interchangeable with eager runs,
bounded recompiles with the padding policy, resume, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from omegaconf import open_dict

from adls_lightning.app.training import run
from adls_lightning.build import build
from adls_lightning.compile import CompileOptions
from adls_lightning.errors import ConfigError
from tests.helpers import assert_one_line_error, kill_and_resume, recorded_batches, run_train, train_run

ROOT = Path(__file__).resolve().parent.parent
# The compile callback with dynamo's eager backend: the wrapper, graphs and guards of torch.compile without
# AOTAutograd or code generation (tests of what the backend produces use aot_eager or inductor).
EAGER_BACKEND = ["compile=aot_eager", "compile.backend=eager"]
# A few batches of each split: enough to compile and run the training and the evaluation graphs.
FEW_BATCHES = [f"+trainer.limit_{split}_batches={n}" for split, n in (("train", 8), ("val", 3), ("test", 3))]
COMPILE_KEYS = {"compile/seconds", "compile/graphs", "compile/graph_breaks", "compile/recompiles"}
# Graphs handed to the counting backend below, in this process: an independent count of dynamo's output graphs.
GRAPHS_SEEN: list[torch.fx.GraphModule] = []


@torch._dynamo.register_backend(name="counting_eager")
def counting_eager(graph: torch.fx.GraphModule, example_inputs):
    GRAPHS_SEEN.append(graph)
    return graph.forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    GRAPHS_SEEN.clear()
    yield
    torch._dynamo.reset()


def _checkpoints(output_dir: Path) -> list[Path]:
    return sorted((output_dir / "checkpoints").glob("*.ckpt"))


def _record_shapes(cfg, shapes: set, runner=None):
    """Run ``cfg`` with a pre-hook on the (uncompiled) LightningModule recording what the compiled backbone sees
    (``runner()`` instead of ``run(cfg)``: a run composed another way)."""
    from lightning.pytorch.callbacks import Callback

    class RecordShapes(Callback):
        def setup(self, trainer, pl_module, stage):
            if not getattr(pl_module, "_shape_hook", None):

                def hook(module, args, kwargs):
                    ids = kwargs["input_ids"]
                    # Lightning evaluates under inference_mode: its inference tensors are another guard.
                    shapes.add(
                        (module.training, torch.is_grad_enabled(), ids.is_inference(), tuple(ids.shape))
                    )

                pl_module._shape_hook = pl_module.register_forward_pre_hook(hook, with_kwargs=True)

    import adls_lightning.app.training as training

    original = training.instantiate_callbacks
    training.instantiate_callbacks = lambda c: [RecordShapes(), *original(c)]
    try:
        return runner() if runner else run(cfg)
    finally:
        training.instantiate_callbacks = original


# The counting backend is dynamo's eager backend (the captured graph run as it is) that also counts.
COUNTED = ["compile=aot_eager", "compile.backend=counting_eager", "trainer.max_epochs=1", *FEW_BATCHES]


@pytest.fixture(scope="module")
def counted_run(tmp_path_factory, tiny_imdb_dir, cache_dir) -> dict:
    """One compiled LoRA run with the counting backend, shared by the test of its counts and checkpoint keys and by
    the test loading its checkpoint into an eager run and back (one compiled training run fewer).

    Returns ``{"metrics", "graphs_seen" (graphs the counting backend got), "shapes" (the variants the backbone saw),
    "folder"}``."""
    out = tmp_path_factory.mktemp("counted") / "run"
    torch._dynamo.reset()  # a module fixture is set up before the autouse fresh_dynamo of the test asking for it
    GRAPHS_SEEN.clear()
    shapes: set = set()
    try:
        metrics = _record_shapes(None, shapes, lambda: train_run(out, COUNTED, tiny_imdb_dir, cache_dir))
        return {"metrics": metrics, "graphs_seen": len(GRAPHS_SEEN), "shapes": shapes, "folder": out}
    finally:
        torch._dynamo.reset()
        GRAPHS_SEEN.clear()


@pytest.mark.slow
def test_compiled_lora_run_reports_torch_counts_and_plain_checkpoint_keys(counted_run):
    metrics, shapes = counted_run["metrics"], counted_run["shapes"]
    assert metrics.keys() >= COMPILE_KEYS
    # One dynamo graph per compiled variant, as the counting backend saw them; LoRA BERT traces without breaks.
    assert metrics["compile/graphs"] == counted_run["graphs_seen"] > 0
    assert metrics["compile/graph_breaks"] == 0
    # Without breaks there is one frame; every (train/eval, grad, inference-tensor, shape) variant beyond the first that
    # needed its own graph was a recompile. torch's default (dynamic=None) makes a changing dimension symbolic,
    # so fewer graphs than variants are compiled.
    assert metrics["compile/recompiles"] == metrics["compile/graphs"] - 1
    assert metrics["compile/graphs"] <= len(shapes)
    assert metrics["compile/seconds"] > 0
    assert _checkpoints(counted_run["folder"])
    for ckpt in _checkpoints(counted_run["folder"]):
        keys = torch.load(ckpt, weights_only=False)["state_dict"].keys()
        assert not [k for k in keys if "_orig_mod" in k], ckpt


@pytest.mark.slow
def test_padding_policy_bounds_static_graphs(compose_cfg):
    # Static shapes (dynamic=false): one graph per (mode, shape) variant, which padding to 16 tokens limits to
    # max_length / 16 = 4 sequence lengths per batch size. Graphs are dynamo's, whatever the backend: the eager
    # backend (no AOTAutograd tracing) counts them at half aot_eager's cost.
    overrides = [
        *EAGER_BACKEND,
        "compile.dynamic=false",
        "data.pad_to_multiple_of=16",
        "trainer.max_epochs=1",
        "test=false",
        "+trainer.limit_val_batches=4",
    ]
    cfg = compose_cfg(overrides)
    shapes: set = set()
    # up to 3 modes x 3 lengths x 2 batch sizes here: past dynamo's default recompile_limit (8) a variant would
    # run eager, uncounted, and the count would say nothing about the padding policy
    with torch._dynamo.config.patch(recompile_limit=64):
        metrics = _record_shapes(cfg, shapes)
    assert {s[-1][1] for s in shapes} <= {16, 32, 48, 64}
    assert metrics["compile/graphs"] == len(shapes)
    assert metrics["compile/recompiles"] == len(shapes) - 1
    # Unpadded, the same data has more distinct lengths: the policy is what bounds the count.
    datamodule = build(cfg.data, "data")
    datamodule.setup("fit")
    with open_dict(cfg):
        cfg.data.pad_to_multiple_of = None
    unpadded = build(cfg.data, "data")
    unpadded.setup("fit")
    padded_lengths = {b["input_ids"].shape[1] for b in datamodule.train_dataloader()}
    unpadded_lengths = {b["input_ids"].shape[1] for b in unpadded.train_dataloader()}
    assert len(padded_lengths) <= 4 < len(unpadded_lengths)


@pytest.mark.slow
def test_compiled_checkpoint_loads_into_eager_run_and_back(counted_run, compose_cfg, tmp_path):
    # Same padding in every run (the compile preset's 32), and the same validation and test batches
    # (FEW_BATCHES), so compilation is the only difference. The checkpoint keys (``_orig_mod.``) are the compile
    # wrapper's, whatever the backend: the compiled run is the counting (eager) backend's, the cheapest that wraps;
    # losses are compared with a tolerance, as a code-generating backend rounds differently from eager kernels.
    pad = "data.pad_to_multiple_of=32"
    compiled = counted_run["metrics"]
    best = [p for p in _checkpoints(counted_run["folder"]) if p.name.startswith("best")]
    assert best
    eager = run(
        compose_cfg([pad, *FEW_BATCHES, "train=false", f"ckpt_path={best[0]}"], output_dir=tmp_path / "eager")
    )
    assert not COMPILE_KEYS & eager.keys()
    for key in ("val/loss", "test/loss"):
        assert eager[key] == pytest.approx(compiled[key], abs=1e-4), key
    # ... and evaluated compiled again, from the same file the eager run read.
    again = run(
        compose_cfg(
            [*EAGER_BACKEND, *FEW_BATCHES, "train=false", f"ckpt_path={best[0]}"],
            output_dir=tmp_path / "back",
        )
    )
    assert again["val/loss"] == pytest.approx(eager["val/loss"], abs=1e-4)
    assert again["compile/graphs"] > 0


@pytest.mark.slow
def test_killed_compiled_run_resumes_to_the_uninterrupted_result(tiny_imdb_dir, cache_dir, tmp_path):
    # 64 train rows / batch 8 = 8 steps per epoch; last.ckpt every 3 steps, so the kill lands mid-way through the
    # second epoch. What resume must restore is the compile wrapper's (checkpoint keys, the recompiled graph), the
    # same for every backend: dynamo's eager backend, at half aot_eager's cost in each of the three runs.
    small = ["data.max_length=32", "data.train_size=64", "data.val_size=16", "data.test_size=16"]
    every_3 = "callbacks.last_checkpoint.every_n_train_steps=3"
    extra = [*EAGER_BACKEND, *small, "trainer.max_epochs=2", every_3]
    runs = kill_and_resume(tiny_imdb_dir, cache_dir, tmp_path, extra, kill_at_step=11)
    assert runs["resumed_from_step"] == 9
    assert recorded_batches(runs["killed"]) == recorded_batches(runs["whole"])
    expected = json.loads((runs["whole"] / "metrics.json").read_text())
    resumed = json.loads((runs["killed"] / "metrics.json").read_text())
    # A compiled graph's kernels need not be bit-for-bit across processes (the graph is compiled anew on resume).
    for key in ("val/acc", "test/acc", "val/loss", "test/loss"):
        assert resumed[key] == pytest.approx(expected[key], abs=1e-5), key


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"backend": "inductr"}, "compile.backend='inductr': unknown; valid: "),
        ({"mode": "fast"}, "compile.mode='fast': unknown; valid: default, reduce-overhead, max-autotune"),
        ({"backend": "aot_eager", "mode": "max-autotune"}, "compile.mode='max-autotune': only"),
        ({"fullgraph": "yes"}, "compile.fullgraph='yes': must be true or false"),
        (
            {"options": {"fallback_rand": True}},
            "compile.options.fallback_rand: not a setting of torch._inductor",
        ),
        (
            {"options": {"fallback_random": "yes"}},
            "compile.options.fallback_random='yes': must be true or false",
        ),
        ({"options": 5}, "compile.options=5: must be a mapping of inductor settings"),
    ],
)
def test_bad_options_name_the_key_and_the_choices(kwargs, key):
    with pytest.raises(ConfigError) as err:
        CompileOptions(**kwargs)
    assert str(err.value).startswith(key)
    if "backend" in key:
        assert "aot_eager" in str(err.value) and "inductor" in str(err.value)


def test_inductor_options_reach_torch_compile_merged_under_the_mode():
    """torch.compile refuses a mode and options together, so the mode's own settings (as torch lists them)
    go into the options, under the user's; other backends generate no code and get no options."""
    options = {"fallback_random": True, "max_autotune": False}
    kwargs = CompileOptions(mode="max-autotune-no-cudagraphs", options=options).torch_kwargs()
    assert "mode" not in kwargs
    expected = torch._inductor.list_mode_options("max-autotune-no-cudagraphs", None) | options
    assert kwargs["options"] == expected and expected["coordinate_descent_tuning"] is True
    assert CompileOptions(options=options).torch_kwargs()["options"] == options
    assert CompileOptions(mode="max-autotune").torch_kwargs()["mode"] == "max-autotune"
    assert "options" not in CompileOptions(backend="aot_eager", options=options).torch_kwargs()
    model = torch.nn.Linear(4, 2)
    model.compile(**CompileOptions(options={"fallback_random": True}).torch_kwargs())  # accepted by torch


def test_lab4_floor_replays_exactly_the_recorded_ops():
    """The Lab 4 floors replay the GEMMs (and dropout's random numbers) one step makes: for Linear-Dropout-
    ReLU-Linear with a leaf input, the forward makes 2 addmm and the backward 3 mm (the first layer needs no
    input gradient), and dropout one bernoulli_."""
    from benchmarks.lab4_compile import GEMM_OPS, RNG_OPS, replay_fn

    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    x = torch.randn(5, 8)

    def step():
        net(x).sum().backward()

    gemms = replay_fn(step, GEMM_OPS)
    assert gemms.calls == 5
    assert replay_fn(step, RNG_OPS).calls == 6
    counts = {}

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] = counts.get(func.overloadpacket.__name__, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        gemms()
    assert counts == {"addmm": 2, "mm": 3}
    with pytest.raises(ValueError, match="no call"):
        replay_fn(lambda: net(x), ("baddbmm",))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "start"),
    [
        # each kind of check once through train.py (every refused value is checked in-process above): a name
        # among choices, a key among torch._inductor's settings, and a compile that fails at the first batch
        ("compile.backend=inductr", "error: compile.backend='inductr': unknown; valid: "),
        ("+compile.options.fallback_rand=true", "error: compile.options.fallback_rand: not a setting of"),
        # activation pruning's data-dependent k-th value is a graph break: fullgraph cannot hold.
        ("compile.fullgraph=true", "error: compile.fullgraph=true: model does not compile to one graph"),
    ],
)
def test_cli_bad_input_is_one_line_without_traceback(tiny_imdb_dir, cache_dir, tmp_path, override, start):
    extra = ["prune=l1_0.5", override] if "fullgraph" in override else [override]
    out = tmp_path / "bad"
    proc = run_train(tiny_imdb_dir, cache_dir, out, "compile=aot_eager", *extra)
    assert_one_line_error(proc, starts=start)
    assert not (out / "metrics.json").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ["quant=int8", "compile.backend=eager"],
        ["prune=l1_0.5", "compile.backend=eager"],
        [
            "quant=mxint8_packed"
        ],  # aot_eager: traces the packed kernels through their fake (meta) implementations
        ["model.attn_implementation=eager", "compile.backend=eager"],
    ],
    ids=["int8", "l1_0.5", "mxint8_packed", "eager_attention"],
)
def test_compiles_with_compression_callbacks(compose_cfg, overrides):
    # two batches of each split: the training and evaluation graphs compile and run with each callback (and a
    # changed shape still recompiles them), at seconds less than FEW_BATCHES' eight training batches
    two = [f"+trainer.limit_{split}_batches=2" for split in ("train", "val", "test")]
    metrics = run(compose_cfg(["compile=aot_eager", "trainer.max_epochs=1", *two, *overrides]))
    assert metrics.keys() >= COMPILE_KEYS
    assert metrics["compile/graphs"] >= 1
    assert metrics["val/acc"] >= 0.0


def test_attn_implementation_switch_keeps_outputs(compose_cfg):
    cfg = compose_cfg(["model.attn_implementation=eager"])
    eager = build(cfg.model, "model", _convert_="partial").eval()
    assert eager.model.config._attn_implementation == "eager"
    from adls_lightning.models import set_attn_implementation

    ids = torch.randint(0, 1000, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        naive = eager(input_ids=ids, attention_mask=mask).logits
        set_attn_implementation(eager.model, "sdpa")
        fused = eager(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(fused, naive, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"model.attn_implementation='flash': must be one of eager, sdpa"):
        set_attn_implementation(eager.model, "flash")


@pytest.mark.slow
def test_inductor_lora_run_has_no_graph_breaks(compose_cfg):
    # the preset as users run it; reviews cut to 32 tokens, padded to the preset's multiple of 32, make every batch
    # one shape: each graph is generated and compiled once (C++ for this CPU), not again for dynamic shapes (a
    # minute of the suite; the shape policies are test_padding_policy_bounds_static_graphs')
    metrics = run(
        compose_cfg(["compile=inductor", "data.max_length=32", "trainer.max_epochs=1", *FEW_BATCHES])
    )
    assert metrics["compile/graph_breaks"] == 0
    assert 1 <= metrics["compile/graphs"] <= 6


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("bench_train.py", ["--compile", "inductr"], "--compile inductr: no preset compile=inductr; valid: "),
        ("bench_train.py", ["--gemm", "mkl"], "argument --gemm: invalid choice: 'mkl'"),
        ("lab4_compile.py", ["--replot", "--json", "/nonexistent/lab4.json"], "--replot: no results file"),
    ],
)
def test_benchmark_options_refuse_bad_values_in_one_line(script, args, message):
    """The options added to the Lab 4 benchmarks stop before any work, in one error line (adls_lightning.script_args)."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[-1]]  # no usage block
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {message}")
