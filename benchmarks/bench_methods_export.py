"""Every compression method of one starting model, exported and checked: one markdown table (issue 58, acceptance 1).

For each ``--run METHOD=PATH`` (a run's checkpoint, or its run folder: its ``checkpoints/compressed.ckpt`` when the
run saved one (PTQ), else its ``best-*.ckpt``), the project's own export command is run as a user runs it,
``python -m adls_lightning.export ckpt=... out=OUT/METHOD <the method's format>`` (installed as ``adls-export``),
with the format that deploys the method:

* ``int8_scaled``, ``smoothquant``, ``lsq``, ``structured_int8``: ``format=onnx int8=scaled`` (the int8 ONNX graph
  of the run's own weight codes and calibrated or learned scales);
* ``gptq_4bit``: ``format=onnx int4=true`` (ONNX Runtime's ``MatMulNBits`` with the run's codes and group steps);
* ``structured_0.5``: ``format=onnx`` (the smaller dense model in fp32);
* ``mxint8``: ``format=mxint8`` (the packed MXINT8 folder; of a float checkpoint, packed at export);
* ``l1_0.5`` and ``fp32``: ``format=hf`` (the Hugging Face folder: ``l1_0.5``'s zeros stored at full size,
  which the self-check names as mask-only pruning; ``fp32``, the starting model itself, shows what the timing
  reads for an artifact that computes what the baseline computes).

The export checks itself and writes ``export.json`` (:mod:`adls_lightning.export.selfcheck`): agreement with the
run's own (fake-quantized, pruned) model on held rows of its test split, the largest logit difference, and the
speedup over torch eager fp32 of the run's uncompressed architecture at each batch size (``check_threads`` threads,
``check_tokens`` tokens, interleaved rounds). This script times nothing itself: every number in the table is read
from that file; the size is the artifact's weights on disk (the ``.onnx`` file the check ran, or the folder's
``model.safetensors``); ``run test/acc`` is the run's own ``metrics.json`` beside its checkpoints, with the test
rows and tokens of its ``.hydra/config.yaml``; ``load`` is the load average the self-check recorded. The verdict
column is each of the self-check's verdict lines up to its first ``;`` (what the artifact is, without the advice).

Before the table: CPU model, flags, load average, date and the export commands. Options after ``--export-arg`` go
to every export (e.g. ``check_rounds=10``, or model overrides). An export that fails is a row saying so (its log:
``OUT/METHOD.log``); the script then exits 1.

    python benchmarks/bench_methods_export.py --out /tmp/exports \\
        --run int8_scaled=RUN1 --run gptq_4bit=RUN2/checkpoints/compressed.ckpt --run l1_0.5=RUN3 ...
    python benchmarks/bench_methods_export.py --out /tmp/exports --run ... --table-only   # re-read export.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from adls_lightning.script_args import Parser  # noqa: E402

# the export's options that deploy each method, and how the table names that format
METHODS: dict[str, tuple[tuple[str, ...], str]] = {
    "fp32": (("format=hf",), "HF folder (fp32)"),
    "int8_scaled": (("format=onnx", "int8=scaled"), "ONNX int8 (run's codes + scales)"),
    "gptq_4bit": (("format=onnx", "int4=true"), "ONNX 4-bit MatMulNBits"),
    "smoothquant": (("format=onnx", "int8=scaled"), "ONNX int8 (run's codes + scales)"),
    "lsq": (("format=onnx", "int8=scaled"), "ONNX int8 (run's codes + learned steps)"),
    "structured_0.5": (("format=onnx",), "ONNX fp32, smaller model"),
    "structured_int8": (("format=onnx", "int8=scaled"), "ONNX int8, smaller model"),
    "mxint8": (("format=mxint8",), "packed MXINT8 folder"),
    "l1_0.5": (("format=hf",), "HF folder (masks baked)"),
}
COMPRESSED_CHECKPOINT = "compressed.ckpt"  # a PTQ run's evaluated model (adls_lightning.compression_record)
WEIGHTS_FILE = "model.safetensors"  # the weights of an hf or mxint8 folder (adls_lightning.export)
HEADER = (
    "| method | export format | agreement | max \\|Δlogit\\| | batch-1 × | batch-8 × | size MB | run test/acc (rows×tokens) | load "
    "| verdict |"
)
FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class MethodRun:
    method: str
    checkpoint: Path


def method_run(text: str) -> MethodRun:
    """``METHOD=PATH`` -> the method and its checkpoint (a run folder: its compressed.ckpt, else its best)."""
    import argparse

    method, sep, path_text = text.partition("=")
    if not sep or method not in METHODS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be METHOD=CHECKPOINT, METHOD one of {', '.join(METHODS)}"
        )
    path = Path(path_text)
    if path.is_dir():
        folder = path / "checkpoints"
        compressed = folder / COMPRESSED_CHECKPOINT
        found = [compressed] if compressed.is_file() else sorted(folder.glob("best-*.ckpt"))
        if not found:
            raise argparse.ArgumentTypeError(
                f"{text}: {folder} holds no {COMPRESSED_CHECKPOINT} or best-*.ckpt; give the checkpoint itself"
            )
        path = found[-1]
    elif not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: {path_text} is no checkpoint file or run folder")
    return MethodRun(method, path)


def export_command(run: MethodRun, out: Path, extra: list[str]) -> list[str]:
    """The documented export command line for ``run`` (``python -m adls_lightning.export``, i.e. ``adls-export``)."""
    options, _ = METHODS[run.method]
    return [
        sys.executable,
        "-m",
        "adls_lightning.export",
        f"ckpt={run.checkpoint}",
        f"out={out}",
        *options,
        *extra,
    ]


def artifact_bytes(folder: Path, report: dict) -> int:
    """The artifact's weights on disk: the ``.onnx`` file the self-check ran (with external data beside it, if
    any), or the folder's ``model.safetensors``."""
    name = report.get("artifact", ".")
    if name != ".":
        files = [folder / name, *folder.glob(f"{name}.data"), *folder.glob(f"{Path(name).stem}.onnx_data")]
    else:
        files = [folder / WEIGHTS_FILE]
    return sum(path.stat().st_size for path in files if path.is_file())


def run_accuracy(checkpoint: Path) -> str:
    """``test/acc`` of the run's ``metrics.json`` (``RUN/metrics.json`` for ``RUN/checkpoints/X.ckpt``), with the
    test rows and tokens its ``.hydra/config.yaml`` names (runs tested on other rows are not comparable)."""
    run = checkpoint.parent.parent
    try:
        accuracy = float(json.loads((run / "metrics.json").read_text())["test/acc"])
    except (OSError, ValueError, KeyError, TypeError):
        return "—"
    try:
        import yaml

        data = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())["data"]
        return f"{accuracy:.4f} ({data['test_size']}×{data['max_length']})"
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return f"{accuracy:.4f}"


def short_verdict(lines: list[str]) -> str:
    """The verdict lines up to their first ``;`` (what the artifact is; the advice that follows is left out)."""
    return "; ".join(line.split(";")[0].strip() for line in lines) or "—"


def table_row(run: MethodRun, folder: Path) -> str:
    """One markdown row from ``folder``'s export.json (or a row naming why there is none)."""
    _, format_name = METHODS[run.method]
    shown_acc = run_accuracy(run.checkpoint)
    try:
        report = json.loads((folder / "export.json").read_text())
    except (OSError, ValueError) as error:
        return f"| {run.method} | {format_name} | — | — | — | — | — | {shown_acc} | — | no export.json ({error}) |"
    speedup = report.get("speedup") or {}
    speeds = [f"{speedup[b]:.2f}×" if b in speedup else "—" for b in ("1", "8")]
    size = artifact_bytes(folder, report) / 1e6
    artifact = report.get("artifact", ".")
    shown_format = f"{format_name}, `{artifact}`" if artifact != "." else format_name
    load = (report.get("timing") or {}).get("load_average") or ["—"]
    return (
        f"| {run.method} | {shown_format} | {report['agreement']:.4f} | {report['max_logit_diff']:.3g} | "
        f"{speeds[0]} | {speeds[1]} | {size:.1f} | {shown_acc} | {load[0]} | "
        f"{short_verdict(report.get('verdict', []))} |"
    )


def print_machine() -> None:
    flags: set[str] = set()
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"CPU: {model}, {os.cpu_count()} logical CPU(s); flags: {' '.join(f for f in FLAGS_SHOWN if f in flags)}"
    )
    print(f"load average: {load}; {time.strftime('%Y-%m-%d %H:%M %Z')}")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__)
    parser.add_argument(
        "--run",
        type=method_run,
        action="append",
        required=True,
        metavar="METHOD=PATH",
        help=f"a method's run (checkpoint or run folder); METHOD one of {', '.join(METHODS)}",
    )
    parser.add_argument("--out", type=Path, required=True, help="the export folders go to OUT/METHOD")
    parser.add_argument(
        "--export-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to every export (e.g. check_rounds=10, check_rows=200)",
    )
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="export nothing: read OUT/METHOD/export.json of earlier exports",
    )
    args = parser.parse_args(argv)
    methods = [run.method for run in args.run]
    repeated = sorted({m for m in methods if methods.count(m) > 1})
    if repeated:
        parser.error(f"--run {repeated[0]}: given twice (one row per method)")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: is a file, expected a folder")
    if not args.table_only:
        for run in args.run:
            folder = args.out / run.method
            if folder.is_dir() and any(folder.iterdir()):
                parser.error(
                    f"--out {args.out}: {folder} is not empty (a new --out, or --table-only to re-read it)"
                )

    print_machine()
    failed = []
    for run in args.run:
        folder = args.out / run.method
        command = export_command(run, folder, args.export_arg)
        shown = " ".join(["python", *command[1:]])
        print(f"{run.method}: {shown}", flush=True)
        if args.table_only:
            continue
        folder.parent.mkdir(parents=True, exist_ok=True)
        log = args.out / f"{run.method}.log"
        started = time.monotonic()
        with log.open("w") as stream:
            code = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        print(f"  exit {code} after {time.monotonic() - started:.0f} s (log: {log})", flush=True)
        if code != 0:
            failed.append(run.method)
            tail = log.read_text().strip().splitlines()[-1:] or [""]
            print(f"  export failed: {tail[0]}", flush=True)
    print()
    print(HEADER)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for run in args.run:
        print(table_row(run, args.out / run.method))
    if failed:
        print(f"\nexport failed: {', '.join(failed)} (logs in {args.out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
