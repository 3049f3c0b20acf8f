"""The deployed artifact of a compound run against what it replaces: the int8 ONNX graph of a ``prune=structured_0.5
quant=int8_scaled`` run (``adls-export ckpt=... format=onnx int8=scaled``) vs torch eager fp32 of the *unpruned*
model (issue 58, acceptance 2), at batch 1 and 8 of 128 tokens, one thread.

Rows (speed-up = torch eager fp32 unpruned / row):

* ``torch eager fp32 (unpruned)``: the dense checkpoint (``--dense``, e.g. ``make train``'s best) as Hugging Face
  runs it (SDPA attention), ``torch.no_grad()``: the baseline;
* ``torch eager fp32 (structured)``: the compound run's smaller model with the int8 weights as floats: what
  pruning alone buys;
* ``int8 ONNX, ORT default session``: the file ``adls-export ... format=onnx int8=scaled`` writes, in ONNX
  Runtime's default session (one thread): ``SkipLayerNormFusion`` on, as before 2026-11-29;
* ``int8 ONNX, project session (adls-predict)``: the same file in the session the project runs it in
  (:func:`adls_lightning.export.onnx.onnx_session`: ``disabled_optimizers=["SkipLayerNormFusion"]``, and on x86
  CPUs without VNNI the int8 weights run as uint8, exactly, where the default session's kernel saturates): the
  artifact.

Timing: random token ids, no padding; each row warmed up, then ``--repeats`` rounds in which every row runs once in
turn; each call is timed on the calling thread's CPU clock (``search.cost.time_calls``; one thread: the time the call
computed, not the time other processes held the cores), the median round kept. Before the table: CPU model,
flags, load average, and the machine's limit: the int8 (``torch._int_mm``) and fp32 GEMM rates on the structured
model's linear shapes at each batch's rows with their peak estimates (``bench_gemm``), so a ratio below the goal can
be read against what the hardware allows. After it: accuracy on ``--rows`` test reviews of the run's data config
(the dense model in torch, the artifact in ONNX Runtime; 2,000 with ``experiment=cpu`` is the run's test set) and
the artifact's agreement with the run's fake-quantized model on the first ``--agree-rows`` of them.

    python benchmarks/bench_deploy.py --ckpt RUN/checkpoints/best-*.ckpt --dense DENSE/checkpoints/best-*.ckpt
    python benchmarks/bench_deploy.py --tiny --repeats 2 --rows 0          # smoke: tiny random models
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gemm import cpuinfo, dtype_methods, matrix_peaks, peak  # noqa: E402
from bench_inference import tiny_checkpoint  # noqa: E402

from adls_lightning.gemm import cpu_name  # noqa: E402
from adls_lightning.script_args import Parser, existing_file, non_negative_int, positive_int  # noqa: E402
from adls_lightning.search.cost import time_calls  # noqa: E402

BASELINE = "torch eager fp32 (unpruned)"
PRUNED_FP32 = "torch eager fp32 (structured)"
DEFAULT_SESSION = "int8 ONNX, ORT default session"
ARTIFACT = "int8 ONNX, project session (adls-predict)"
GOAL = 3.5
FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")

Runner = Callable[[np.ndarray, np.ndarray], np.ndarray]


def torch_runner(model) -> Runner:
    def run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
        return out.logits.float().numpy()

    return run


def ort_runner(session) -> Runner:
    def run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]

    return run


def default_session(path: Path):
    """ONNX Runtime's session as a user writes it: default options but one thread."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def linear_shapes(model) -> list[tuple[int, int]]:
    """The distinct (in, out) of ``model``'s encoder linear layers (quantized or float)."""
    shapes = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if "encoder" in name and weight is not None and weight.dim() == 2 and not name.endswith("linear"):
            shapes.add((weight.shape[1], weight.shape[0]))
    return sorted(shapes)


def machine_limit(shapes: list[tuple[int, int]], rows: int, repeats: int) -> tuple[float, float]:
    """fp32 (``F.linear``) and int8 (``torch._int_mm``) GOP/s over ``shapes`` at ``rows``, best of ``repeats``, on
    the CPU clock: the rates an fp32 and an int8 engine can reach on these products here."""
    total = {"fp32": 0.0, "int8 _int_mm": 0.0}
    ops = 0.0
    for fan_in, fan_out in shapes:
        calls = dtype_methods((fan_in, fan_out), rows)
        ops += 2.0 * rows * fan_in * fan_out
        for name in total:
            calls[name]()
            best = float("inf")
            for _ in range(max(3, repeats)):
                start = time.process_time()
                calls[name]()
                best = min(best, time.process_time() - start)
            total[name] += best
    return ops / total["fp32"] / 1e9, ops / total["int8 _int_mm"] / 1e9


def time_rows(
    runners: dict[str, Runner], batch: int, tokens: int, vocab: int, repeats: int
) -> dict[str, float]:
    """Median CPU ms per call of each runner at ``batch x tokens``, rounds interleaved."""
    generator = np.random.default_rng(0)
    ids = generator.integers(1000 if vocab > 2000 else 0, vocab, (batch, tokens)).astype(np.int64)
    mask = np.ones_like(ids)
    # one thread: the calling thread's CPU clock (time others held the cores is not counted), as the cost model reads
    seconds = time_calls({name: lambda run=run: run(ids, mask) for name, run in runners.items()}, repeats)
    return {name: 1e3 * clocks["cpu"] for name, clocks in seconds.items()}


def tiny_dense(work: Path) -> tuple[Path, list[str]]:
    """A tiny random BERT checkpoint the export's loader reads (the smoke test's dense model), with weights of std
    1/sqrt(fan_in) so its outputs depend on the input (:func:`bench_inference.tiny_checkpoint`)."""
    overrides = ["model=tiny_random", "model/lora=none"]
    path = work / "dense.ckpt"
    tiny_checkpoint(path, overrides)
    return path, overrides


def prune_and_quantize(dense, overrides: list[str], tiny: bool):
    """A copy of ``dense`` with half its heads and FFN neurons removed (L1) and ``quant=int8_scaled``'s recipe,
    calibrated post-training as a run calibrates (its training batches; --tiny: random ids): the compound model's
    shapes without its fine-tuning, for speed."""
    from adls_lightning.export import int8 as int8_export
    from adls_lightning.export.compressed import _quant_recipe
    from adls_lightning.prune import StructuredPruner
    from adls_lightning.quant import quantize_model
    from adls_lightning.quant.scaled import calibrate
    from adls_lightning.runs.loading import compose_train_config

    model = copy.deepcopy(dense)
    StructuredPruner(heads=0.5, neurons=0.5, method="l1").prune(model)
    cfg = compose_train_config([*overrides, "quant=int8_scaled"])
    quantize_model(model, _quant_recipe(cfg.quant.config, "quant.config"))
    model.eval()
    if tiny:
        generator = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, model.config.vocab_size, (4, 16), generator=generator) for _ in range(3)]
        calibrate(model, ids, lambda batch: model(input_ids=batch), len(ids))
    else:
        int8_export.calibrate_as_run(model, cfg)
    return model


def linear_macs(model) -> int:
    """Multiply-adds per token of ``model``'s encoder linear layers."""
    return sum(
        module.weight.shape[0] * module.weight.shape[1]
        for name, module in model.named_modules()
        if "encoder" in name and isinstance(module, torch.nn.Linear)
    )


def main() -> None:
    parser = Parser(description=__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--ckpt",
        type=existing_file,
        help="checkpoint of a prune=structured_* quant=int8_scaled run (none: --dense pruned and quantized here, "
        "for speed only)",
    )
    source.add_argument("--tiny", action="store_true", help="tiny random models instead (smoke test)")
    parser.add_argument("--dense", type=existing_file, help="the unpruned float checkpoint (the baseline)")
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed rounds (median kept)")
    parser.add_argument(
        "--rows", type=non_negative_int, default=2000, help="test reviews for accuracy (0: skip)"
    )
    parser.add_argument(
        "--agree-rows",
        type=non_negative_int,
        default=200,
        help="of those, rows also run fake-quantized in torch",
    )
    args = parser.parse_args()
    if not args.tiny and not args.dense:
        parser.error("--dense: give the unpruned checkpoint the speed-ups are measured against")
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(1)
    import datasets
    import onnxruntime as ort

    datasets.disable_progress_bars()  # the test split's tokenization: not this table's concern

    from adls_lightning.export import int8 as int8_export
    from adls_lightning.export import onnx as onnx_export
    from adls_lightning.models import set_attn_implementation
    from adls_lightning.runs.loading import load_checkpoint_model

    info = cpuinfo()
    flags = set(info.get("flags", "").split())
    print(
        f"{cpu_name()}, {os.cpu_count()} logical CPU(s); flags: {' '.join(f for f in FLAGS_SHOWN if f in flags)}"
    )
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, 1 thread, {args.tokens} tokens")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.tiny:
            dense_ckpt, overrides = tiny_dense(work)
        else:
            from adls_lightning.export.compressed import run_overrides

            dense_ckpt, overrides = args.dense, run_overrides(args.dense)
        dense = load_checkpoint_model(dense_ckpt, [] if args.dense else overrides).model.eval()
        if args.ckpt:
            loaded = load_checkpoint_model(args.ckpt, [], keep_quantized=True)
            fake = loaded.model.eval()
            if int8_export.uncalibrated(fake):
                batches = int8_export.calibrate_as_run(fake, loaded.config)
                print(
                    f"fake-quantized model: input scales calibrated on {batches} training batches (a PTQ run)"
                )
        else:
            fake = prune_and_quantize(dense, overrides, args.tiny)
            print(
                "compound model: --dense with half its heads and FFN neurons removed (L1) and quant=int8_scaled, "
                "calibrated here, not fine-tuned (its speed is the compound run's; its accuracy is not)"
            )
        set_attn_implementation(dense, "sdpa")  # HF's default: what from_pretrained gives a user
        pruned_float = int8_export.bake_weights(copy.deepcopy(fake)).eval()
        artifact_path = work / int8_export.INT8_SCALED_FILE
        layers = int8_export.export_int8_graph(fake, artifact_path)
        check = int8_export.check_int8(artifact_path, fake)  # the export's own self-check
        print(
            f"artifact: {len(layers)} int8 linears, {artifact_path.stat().st_size / 1e6:.1f} MB; vs the fake-quantized "
            f"model on the export's sample batch: {check.describe()}"
        )
        runners = {
            BASELINE: torch_runner(dense),
            PRUNED_FP32: torch_runner(pruned_float),
            DEFAULT_SESSION: ort_runner(default_session(artifact_path)),
            ARTIFACT: ort_runner(onnx_export.onnx_session(artifact_path)),
        }
        per_core, how = peak(None)
        peaks = matrix_peaks(per_core)
        shapes = linear_shapes(fake)
        kept = linear_macs(dense) / linear_macs(pruned_float)
        results: dict[int, dict[str, float]] = {}
        for batch in args.batch:
            rows = batch * args.tokens
            fp32_rate, int8_rate = machine_limit(shapes, rows, args.repeats)
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            print(
                f"\nbatch {batch}: load average {load}. Machine limit on the structured model's linear shapes "
                f"{', '.join(f'{i}->{o}' for i, o in shapes)} at {rows} rows: fp32 {fp32_rate:.1f} GFLOP/s, int8 "
                f"(torch._int_mm) {int8_rate:.1f} GOP/s, {int8_rate / fp32_rate:.2f}x (peak estimates per core: fp32 "
                f"{peaks['fp32'][0]:.0f}, int8 {peaks['int8'][0] or float('nan'):.0f}; {how}). The linear layers' "
                f"ceiling vs {BASELINE}: {kept:.2f}x fewer multiply-adds x {int8_rate / fp32_rate:.2f} = "
                f"{kept * int8_rate / fp32_rate:.1f}x."
            )
            results[batch] = time_rows(runners, batch, args.tokens, dense.config.vocab_size, args.repeats)
            base = results[batch][BASELINE]
            for name, ms in results[batch].items():
                print(f"  {name:50s} {ms:8.1f} ms  {base / ms:5.2f}x")
        print(f"\nCPU ms per forward, median of {args.repeats} interleaved rounds; x = {BASELINE} / row")
        for batch in args.batch:
            ratio = results[batch][BASELINE] / results[batch][ARTIFACT]
            print(
                f"structured + int8 artifact vs {BASELINE}, batch {batch}: {ratio:.2f}x "
                f"(goal {GOAL}x: {'met' if ratio >= GOAL else 'NOT met'})"
            )
        if args.rows and args.ckpt:
            accuracy(dense, fake, onnx_export.onnx_session(artifact_path), args)


def accuracy(dense, fake, session, args) -> None:
    """Accuracy of the dense model (torch) and the artifact (ONNX Runtime) on the run's first ``args.rows`` test
    reviews; the artifact's label agreement with the fake-quantized model on the first ``args.agree_rows``."""
    from adls_lightning.export.compressed import run_overrides
    from adls_lightning.export.evaluate import evaluation_loader

    sizes = [f"data.test_size={args.rows}", "data.train_size=8", "data.val_size=8"]
    loader = evaluation_loader([*run_overrides(args.ckpt), *sizes])
    labels, dense_pred, artifact_pred, fake_pred = [], [], [], []
    seen = 0
    for batch in loader:
        ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
        labels.append(batch["labels"].numpy())
        dense_pred.append(torch_runner(dense)(ids, mask).argmax(-1))
        artifact_pred.append(ort_runner(session)(ids, mask).argmax(-1))
        if seen < args.agree_rows:
            fake_pred.append(torch_runner(fake)(ids, mask).argmax(-1))
        seen += len(ids)
    y = np.concatenate(labels)
    dense_acc = float((np.concatenate(dense_pred) == y).mean())
    artifact = np.concatenate(artifact_pred)
    artifact_acc = float((artifact == y).mean())
    fake_all = np.concatenate(fake_pred)
    agree = float((artifact[: len(fake_all)] == fake_all).mean())
    print(
        f"\naccuracy on {len(y)} test reviews: {BASELINE} {dense_acc:.4f}, artifact {artifact_acc:.4f} "
        f"({100 * (artifact_acc - dense_acc):+.2f} pt); the artifact gives the fake-quantized model's label on "
        f"{agree:.1%} of the first {len(fake_all)}"
    )


if __name__ == "__main__":
    main()
