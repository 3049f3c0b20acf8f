"""CPU inference of one checkpoint, every way this project (or a user instead of it) can run it, in one table.

Variants (all the same merged model: LoRA folded in, pruning masks baked, by the export's own
``load_checkpoint_model``):

* ``torch eager fp32``: the Hugging Face model as ``from_pretrained`` gives it (SDPA attention, HF's default),
  ``torch.no_grad()``, torch's default GEMMs (aten) -- the baseline of the speed-ups;
* ``ours fp32``: what the project runs at evaluation: ``runtime.gemm=auto`` resolved by ``gemm.choose`` on this
  model's shapes at this batch's rows and thread count (the chosen backend is printed), ``torch.inference_mode()``;
* ``torch bf16``: the model's weights cast to bfloat16 once (``model.to(torch.bfloat16)``, not autocast per call),
  ``torch.inference_mode()``: what CPUs with AMX or AVX-512 BF16 run at a multiple of fp32's rate (issue 59; on a
  CPU without them bf16 is emulated and slower); logits returned as fp32;
* ``torch int8 (dynamic)``: ``torch.ao.quantization.quantize_dynamic`` of every ``nn.Linear`` (qint8 weights);
* ``ORT fp32`` / ``ORT int8``: ``model.onnx`` / ``model_int8.onnx`` as ``python -m adls_lightning.export
  format=onnx int8=true`` writes them (:mod:`adls_lightning.export.onnx`), sessions with ``intra_op_num_threads``
  = the row's thread count;
* ``MXINT8 packed``: the ``format=mxint8`` folder (``pack_for_export`` + ``save_packed``, group 32, classifier
  float) rebuilt by ``load_packed``, ``torch.inference_mode()``;
* ``fake-quant int8 (scaled)``: the checkpoint under ``--quant-overrides`` (default ``quant=int8_scaled
  quant.mode=ptq``: per-channel int8 weights, static per-tensor int8 inputs, calibrated as the run's callback
  calibrates), fake-quantized in PyTorch: what the run evaluates, the accuracy reference of the int8 row;
* ``ours int8 (scaled, static)``: that model as ``format=onnx int8=scaled`` writes it
  (:mod:`adls_lightning.export.int8`: the same weight codes and input scales, QDQ fused by ONNX Runtime into
  integer kernels).

Below the table: the int8 export against the fake-quantized model (accuracy difference, same labels).

Timing: random token ids, no padding, ``batch x tokens``; each variant warmed up, then ``--repeats`` rounds in
which every variant runs once in turn (so load from other processes hits all alike); the median round is kept.
Accuracy: the test split the run's data config gives (``evaluation_loader`` of ``adls_lightning.export.evaluate``
on the run's record beside the checkpoint, ``<run>/.hydra/overrides.yaml``, with ``--overrides`` on top, as
``adls-export`` and ``adls-evaluate`` read it: same files, tokenizer, ``max_length``, truncation side; the seeded
stratified subset of ``--accuracy-rows`` rows, so the run's ``data.test_size`` is exactly the run's test set and the
accuracy its ``test/acc``), with ``agree`` = share of predictions equal to torch eager's. A checkpoint outside a run
folder has no record: ``--overrides`` default to ``experiment=cpu`` there. Before the table: the GEMM rate of aten and oneDNN on MiniLM's 384->1536 forward at the first
batch's rows (``bench_gemm.methods``) and the machine's peak estimate (``bench_gemm.peak``).

    python benchmarks/bench_inference.py --ckpt outputs/cpu/runs/2026-11-25_18-44-40/checkpoints/best-epoch00-step125.ckpt \\
        --figure docs/figures/inference.png                  # batch 1 8, tokens 128 256, threads 1 2
    python benchmarks/bench_inference.py --tiny --batch 1 --tokens 16 --threads 1 --repeats 2 --accuracy-rows 0
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gemm import methods as gemm_methods  # noqa: E402
from bench_gemm import peak  # noqa: E402

from adls_lightning.gemm import choose, cpu_name, gemm_backend, onednn_available  # noqa: E402
from adls_lightning.script_args import (  # noqa: E402
    Parser,
    check_outputs,
    existing_file,
    existing_folder,
    non_negative_int,
    positive_int,
)

BASELINE = "torch eager fp32"
FAKE_QUANT = "fake-quant int8 (scaled)"
SCALED_INT8 = "ours int8 (scaled, static)"
#: the same codes as an AOTInductor package (``int8=scaled int8_runtime=pt2e``), where torchao is installed
SCALED_INT8_PT2E = "ours int8 (scaled, PT2E)"
VARIANTS = (
    BASELINE,
    "ours fp32",
    "torch bf16",
    "torch int8 (dynamic)",
    "ORT fp32",
    "ORT int8",
    "MXINT8 packed",
    FAKE_QUANT,
    SCALED_INT8,
)
# the quantization of the int8 rows: the project's scaled-int8 preset, post-training (calibrated at load)
QUANT_OVERRIDES = ["quant=int8_scaled", "quant.mode=ptq"]
# the shape whose GEMM rate is printed: MiniLM's FFN up-projection, the layer with the most multiply-adds
GEMM_SHAPE = "384->1536"
# --tiny: the project's tiny random BERT (hidden 32, 2 layers, MiniLM tokenizer), no checkpoint needed
TINY_OVERRIDES = ["model=tiny_random"]
DEFAULT_OVERRIDES = ["experiment=cpu"]

Runner = Callable[[torch.Tensor, torch.Tensor], np.ndarray]


@dataclass
class Variant:
    """One way to run the model: ``make()`` builds its runner for the current thread count and ``rows``."""

    name: str
    make: Callable[[int], Runner]
    note: str = ""
    accuracy: float | None = None
    agree: float | None = None
    # share of the reviews given the most frequent label: 1.0 means "agree" compared constant predictions
    top_label_share: float | None = None
    ms: dict[str, float] = field(default_factory=dict)
    predictions: np.ndarray | None = None
    logits: np.ndarray | None = None


def torch_runner(model, context: Callable[[], object]) -> Runner:
    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> np.ndarray:
        with context():
            return model(input_ids=input_ids, attention_mask=attention_mask).logits.float().numpy()

    return run


def build_variants(model, work: Path, fake_quant=None) -> list[Variant]:
    """Every variant of the merged float ``model`` (and of ``fake_quant``, its calibrated scaled-int8 model, when
    given); exported files go to ``work``."""
    from adls_lightning.export import load_packed, pack_for_export, save_packed
    from adls_lightning.export import onnx as onnx_export
    from adls_lightning.models import set_attn_implementation

    eager = copy.deepcopy(model).eval()
    # HF's own SDPA, what from_pretrained gives a user; the project's model keeps its registered variant (the
    # same fused SDPA at evaluation; it differs only in training's dropout)
    set_attn_implementation(eager, "sdpa")
    ours = copy.deepcopy(model).eval()
    variants = [Variant(BASELINE, lambda rows: torch_runner(eager, torch.no_grad), "aten, no_grad")]

    ours_variant = Variant("ours fp32", lambda rows: None)  # make() below records the backends auto chose
    chosen: set[str] = set()

    def make_ours(rows: int) -> Runner:
        backend = choose(
            "auto", ours, rows
        )  # what the project's eval does (app.training._gemm_choice), uncached
        chosen.add(backend)
        ours_variant.note = f"gemm=auto→{'/'.join(sorted(chosen))}, inference_mode"

        def context():
            return _Both(gemm_backend(backend), torch.inference_mode())

        return torch_runner(ours, context)

    ours_variant.make = make_ours
    variants.append(ours_variant)

    bf16 = copy.deepcopy(eager).to(
        torch.bfloat16
    )  # weights cast once, as an evaluation in bf16 would hold them
    variants.append(
        Variant(
            "torch bf16",
            lambda rows: torch_runner(bf16, torch.inference_mode),
            "weights bf16, inference_mode",
        )
    )

    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # torch.ao.quantization's deprecation notice: the API is what users call
        int8 = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(eager), {torch.nn.Linear}, dtype=torch.qint8
        )
    variants.append(Variant("torch int8 (dynamic)", lambda rows: torch_runner(int8, torch.no_grad), "qint8"))

    fp32_path, int8_path = work / onnx_export.ONNX_FILE, work / onnx_export.ONNX_INT8_FILE
    onnx_export.export_onnx(model, fp32_path)
    onnx_export.check_against_torch(fp32_path, model)  # the export's own check: a wrong file fails here
    onnx_export.quantize_int8(fp32_path, int8_path)

    def ort_runner(path: Path) -> Callable[[int], Runner]:
        def make(rows: int) -> Runner:
            session = onnx_export.onnx_session(path)  # intra_op_num_threads = torch's current thread count

            def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> np.ndarray:
                inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
                return onnx_export.onnx_logits(session, inputs)

            return run

        return make

    variants.append(Variant("ORT fp32", ort_runner(fp32_path), f"opset {onnx_export.ONNX_OPSET}"))
    variants.append(Variant("ORT int8", ort_runner(int8_path), "quantize_dynamic, QInt8 weights"))

    packed_model = copy.deepcopy(model).eval()
    packed = pack_for_export(packed_model, group_size=32)
    save_packed(packed_model, packed, work / "mxint8")
    mxint8 = load_packed(work / "mxint8")
    variants.append(
        Variant(
            "MXINT8 packed",
            lambda rows: torch_runner(mxint8, torch.inference_mode),
            f"{len(packed.linear)} linears, group 32",
        )
    )
    if fake_quant is not None:
        from adls_lightning.export import int8 as int8_export

        variants.append(
            Variant(
                FAKE_QUANT, lambda rows: torch_runner(fake_quant, torch.inference_mode), "PyTorch, calibrated"
            )
        )
        int8_path = work / int8_export.INT8_SCALED_FILE
        layers = int8_export.export_int8_graph(fake_quant, int8_path)
        int8_export.check_int8(int8_path, fake_quant)  # the export's own check: a wrong file fails here
        variants.append(
            Variant(SCALED_INT8, ort_runner(int8_path), f"ONNX Runtime QDQ, {len(layers)} linears")
        )
        from adls_lightning.export import pt2e

        why = pt2e.pt2e_unusable()
        if why is None:
            package = work / pt2e.RUN_CODES_FILE
            pt2e.write_run_codes_package(fake_quant, layers, int8_export.QMAX, package)
            int8_export.check_int8(package, fake_quant)  # the export's own check
            runner = pt2e.Pt2Classifier(package)
            variants.append(
                Variant(
                    SCALED_INT8_PT2E,
                    lambda rows: torch_runner(runner, torch.inference_mode),
                    f"AOTInductor (oneDNN int8), {len(layers)} linears",
                )
            )
        else:
            print(f"{SCALED_INT8_PT2E}: left out ({why})")
    return variants


def scaled_int8_model(ckpt: Path, overrides: list[str]):
    """The checkpoint's fake-quantized scaled-int8 model, calibrated as ``format=onnx int8=scaled`` does."""
    from adls_lightning.export import int8 as int8_export
    from adls_lightning.runs.loading import load_checkpoint_model

    loaded = load_checkpoint_model(ckpt, overrides, keep_quantized=True)
    if int8_export.uncalibrated(loaded.model):
        batches = int8_export.calibrate_as_run(loaded.model, loaded.config)
        print(f"{FAKE_QUANT}: input scales calibrated on {batches} training batches")
    return loaded.model.eval()


class _Both:
    """Two context managers as one (the GEMM backend's mode and inference mode, entered per call)."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __enter__(self):
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc) -> None:
        self.second.__exit__(*exc)
        self.first.__exit__(*exc)


def tiny_checkpoint(path: Path, overrides: list[str]) -> None:
    """A Lightning-style checkpoint of a freshly built (random) ``overrides`` model, so ``--tiny`` goes through
    the same ``load_checkpoint_model`` as a real checkpoint."""
    import lightning

    from adls_lightning.build import build
    from adls_lightning.runs.loading import compose_train_config

    torch.manual_seed(0)
    cfg = compose_train_config(overrides)
    module = build(cfg.model, "model", _convert_="partial", **build(cfg.data, "data").task.model_overrides())
    # At its init (std 0.02) a random model gives every review the same label, so "same predictions" would
    # compare nothing: weights of std 1/sqrt(fan_in) (LoRA B included, so the merge matters) make the labels
    # depend on the input.
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if parameter.dim() == 2 and "embeddings" not in name:
                parameter.normal_(0, parameter.shape[1] ** -0.5)
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": lightning.__version__}, path)


def time_shape(
    variants: list[Variant], batch: int, tokens: int, vocab: int, repeats: int
) -> dict[str, float]:
    """Median ms per batch of each variant at ``batch x tokens`` (current thread count), rounds interleaved."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, tokens), generator=generator)
    mask = torch.ones_like(ids)
    runners = {v.name: v.make(batch * tokens) for v in variants}
    for run in runners.values():
        for _ in range(2):  # warm-up: first-call allocations, oneDNN primitive creation, ORT arena
            run(ids, mask)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run(ids, mask)
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def run_settings(ckpt: Path | None, overrides: list[str] | None, tiny: bool) -> list[str]:
    """The overrides the checkpoint is loaded and scored under, on top of its run's own record (which
    ``load_checkpoint_model`` and :func:`accuracy` read beside a checkpoint in its run folder): ``--overrides`` as
    given; else none for a checkpoint in a run folder (its model and data as the run recorded them, so the
    accuracy is the run's and ``adls-evaluate``'s), :data:`DEFAULT_OVERRIDES` for one outside a run folder
    (nothing recorded), :data:`TINY_OVERRIDES` for ``--tiny``."""
    from adls_lightning.export.compressed import run_overrides

    if overrides is not None:
        return list(overrides)
    if tiny:
        return list(TINY_OVERRIDES)
    return [] if ckpt is not None and run_overrides(ckpt) else list(DEFAULT_OVERRIDES)


def accuracy(variants: list[Variant], overrides: list[str], rows: int, ckpt: Path | None = None) -> int:
    """Each variant's accuracy (and agreement with the baseline) on the first ``rows`` test reviews of the data
    the checkpoint's run recorded (``ckpt`` in its run folder), ``overrides`` on top."""
    from adls_lightning.export.compressed import run_overrides
    from adls_lightning.export.evaluate import evaluation_loader
    from adls_lightning.overrides import merge_overrides

    # train and val sizes 8: the data module tokenizes those splits too (carved from the train file, independent
    # of the test subset, which depends only on test_size and the seed); the benchmark reads the test split only
    sizes = [f"data.test_size={rows}", "data.train_size=8", "data.val_size=8"]
    recorded = run_overrides(ckpt) if ckpt is not None else []
    loader = evaluation_loader(merge_overrides(recorded, [*overrides, *sizes]))
    batches = list(loader)
    labels = torch.cat([b["labels"] for b in batches]).numpy()
    baseline = None
    for variant in variants:
        run = variant.make(loader.batch_size * max(b["input_ids"].shape[1] for b in batches))
        logits = np.concatenate([run(b["input_ids"], b["attention_mask"]) for b in batches])
        predicted = logits.argmax(-1)
        baseline = predicted if baseline is None else baseline
        variant.accuracy = float((predicted == labels).mean())
        variant.agree = float((predicted == baseline).mean())
        variant.top_label_share = float(np.bincount(predicted).max() / len(predicted))
        variant.predictions, variant.logits = predicted, logits
    return len(labels)


def int8_against_fake_quant(variants: list[Variant], name: str = SCALED_INT8) -> dict[str, float] | None:
    """The int8 export's (``name``'s) accuracy minus the fake-quantized model's, the share of equal labels, and
    the largest logit difference and the median one."""
    found = {v.name: v for v in variants if v.name in (FAKE_QUANT, name)}
    if len(found) < 2 or found[FAKE_QUANT].predictions is None:
        return None
    fake, int8 = found[FAKE_QUANT], found[name]
    return {
        "accuracy_difference": int8.accuracy - fake.accuracy,
        "agree": float((int8.predictions == fake.predictions).mean()),
        "max_abs_logit_difference": float(np.abs(int8.logits - fake.logits).max()),
        "median_abs_logit_difference": float(np.median(np.abs(int8.logits - fake.logits))),
    }


def gemm_rates(rows: int, repeats: int) -> dict[str, float]:
    """GFLOP/s of aten, oneDNN and oneDNN with a prepacked weight on ``GEMM_SHAPE``'s forward at ``rows``."""
    from bench_gemm import SHAPES

    flops, calls = gemm_methods(SHAPES[GEMM_SHAPE], rows, "fwd")
    if not onednn_available():
        calls = {"aten": calls["aten"]}
    best = dict.fromkeys(calls, float("inf"))
    for call in calls.values():
        call()
    for _ in range(max(3, repeats)):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: flops / t / 1e9 for name, t in best.items()}


def column(threads: int, batch: int, tokens: int) -> str:
    return f"b{batch}×{tokens} t{threads}"


def markdown(variants: list[Variant], columns: list[str], accuracy_rows: int) -> str:
    base = next(v for v in variants if v.name == BASELINE)
    head = ["variant", *(f"{c} ms (×)" for c in columns)]
    if accuracy_rows:
        head += [f"acc ({accuracy_rows})", "agree"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for v in variants:
        cells = [v.name + (f" ({v.note})" if v.note else "")]
        cells += [f"{v.ms[c]:.1f} ({base.ms[c] / v.ms[c]:.2f}×)" for c in columns]
        if accuracy_rows:
            cells += [f"{v.accuracy:.4f}", f"{v.agree:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(variants: list[Variant], columns: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next(v for v in variants if v.name == BASELINE)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(columns) + 2), 4.5))
    width = 0.8 / len(variants)
    x = np.arange(len(columns))
    for i, v in enumerate(variants):
        speedups = [base.ms[c] / v.ms[c] for c in columns]
        bars = ax.bar(x + (i - (len(variants) - 1) / 2) * width, speedups, width, label=v.name)
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, columns)
    ax.set_ylabel(f"speed-up vs {BASELINE}")
    ax.set_title(title, fontsize=9)
    # below the axes: inside, the legend hides the tallest bars
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = Parser(description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--ckpt", type=existing_file, help="a train.py checkpoint (float: plain, LoRA or pruned)"
    )
    source.add_argument("--tiny", action="store_true", help="a tiny random BERT instead (smoke test)")
    parser.add_argument(
        "--overrides",
        nargs="*",
        default=None,
        help="Hydra overrides on top of the run's record beside the checkpoint (<run>/.hydra/overrides.yaml: its "
        f"model and data, as adls-export and adls-evaluate read it; default none; a checkpoint outside a run folder: "
        f"{DEFAULT_OVERRIDES}; --tiny: {TINY_OVERRIDES})",
    )
    parser.add_argument(
        "--quant-overrides",
        nargs="*",
        default=QUANT_OVERRIDES,
        help=f"the scaled-int8 rows' quantization, on top of --overrides (default {QUANT_OVERRIDES}; none: no "
        "int8 rows)",
    )
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[128, 256])
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--repeats", type=positive_int, default=10, help="timed rounds per shape (median kept)"
    )
    parser.add_argument(
        "--accuracy-rows", type=non_negative_int, default=500, help="test reviews (0: skip accuracy)"
    )
    parser.add_argument(
        "--data-dir", type=existing_folder, default=None, help="data.data_dir (default: the data config's)"
    )
    parser.add_argument("--cache-dir", default=None, help="paths.cache_dir for the tokenized test split")
    parser.add_argument("--figure", type=Path, default=None, help="PNG of the speed-ups")
    parser.add_argument("--json", type=Path, default=None, help="the results as JSON")
    args = parser.parse_args()
    check_outputs(parser, figures={"--figure": args.figure}, files={"--json": args.json})
    # deprecation notices of Hydra and transformers, and the data set's progress bars: not this table's concern
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", UserWarning)
    import datasets

    datasets.disable_progress_bars()

    from adls_lightning.runs.loading import load_checkpoint_model

    overrides = run_settings(args.ckpt, args.overrides, args.tiny)
    if args.data_dir:
        overrides.append(f"data.data_dir={args.data_dir}")
    if args.cache_dir:
        overrides.append(f"paths.cache_dir={args.cache_dir}")
    per_core, how = peak(None)
    print(
        f"{cpu_name()}, {os.cpu_count()} logical CPU(s), torch {torch.__version__}, load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(f"peak estimate: {per_core:.0f} GFLOP/s per core; {how}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = args.ckpt
        if args.tiny:
            ckpt = work / "tiny.ckpt"
            tiny_checkpoint(ckpt, overrides)
        model = load_checkpoint_model(ckpt, overrides).model
        vocab = model.config.vocab_size
        max_tokens = model.config.max_position_embeddings
        if max(args.tokens) > max_tokens:
            sys.exit(f"error: --tokens {max(args.tokens)}: the model takes at most {max_tokens}")
        fake_quant = None
        if args.quant_overrides:
            # --tiny: a smoke-sized calibration (2 batches of 64 training reviews), small data sets suffice
            smoke = (
                ["data.train_size=64", "data.val_size=16", "quant.calibration.batches=2"] if args.tiny else []
            )
            fake_quant = scaled_int8_model(ckpt, [*overrides, *args.quant_overrides, *smoke])
        variants = build_variants(model, work, fake_quant)
        columns = []
        gemm = {}
        for threads in args.threads:
            torch.set_num_threads(threads)
            rows = args.batch[-1] * args.tokens[0]
            gemm[threads] = gemm_rates(rows, args.repeats)
            rates = ", ".join(f"{name} {rate:.1f}" for name, rate in gemm[threads].items())
            print(
                f"GEMM {GEMM_SHAPE} forward, {rows} rows, {threads} thread(s): {rates} GFLOP/s "
                f"(peak estimate {per_core * threads:.0f})"
            )
            for batch in args.batch:
                for tokens in args.tokens:
                    name = column(threads, batch, tokens)
                    columns.append(name)
                    for variant_name, ms in time_shape(variants, batch, tokens, vocab, args.repeats).items():
                        next(v for v in variants if v.name == variant_name).ms[name] = ms
        rows_used = 0
        if args.accuracy_rows:
            torch.set_num_threads(max(args.threads))
            rows_used = accuracy(variants, overrides, args.accuracy_rows, args.ckpt)
    print(
        f"\nms per batch, median of {args.repeats} after warm-up (× = speed-up vs {BASELINE}); "
        f"accuracy on {rows_used} test reviews, agree = same prediction as {BASELINE}\n"
    )
    table = markdown(variants, columns, rows_used)
    print(table)
    against = {}
    for name in (SCALED_INT8, SCALED_INT8_PT2E):
        against[name] = int8_against_fake_quant(variants, name) if rows_used else None
        if against[name]:
            print(
                f"\n{name} vs {FAKE_QUANT}: accuracy {against[name]['accuracy_difference'] * 100:+.2f} pt, same "
                f"label on {against[name]['agree']:.1%} of the {rows_used} reviews; |Δlogit| max "
                f"{against[name]['max_abs_logit_difference']:.3g}, median "
                f"{against[name]['median_abs_logit_difference']:.3g}"
            )
    if args.figure:
        title = f"{ckpt.name if args.ckpt else 'tiny random BERT'}; {cpu_name()}; median of {args.repeats}"
        figure(variants, columns, args.figure, title)
        print(f"\nfigure: {args.figure}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "columns": columns,
                    "accuracy_rows": rows_used,
                    "int8_vs_fake_quant": against[SCALED_INT8],
                    "pt2e_int8_vs_fake_quant": against[SCALED_INT8_PT2E],
                    "gemm_gflops": gemm,
                    "peak_gflops_per_core": per_core,
                    "variants": [
                        {
                            "name": v.name,
                            "note": v.note,
                            "ms": v.ms,
                            "accuracy": v.accuracy,
                            "agree": v.agree,
                            "top_label_share": v.top_label_share,
                        }
                        for v in variants
                    ],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
