"""Training throughput: this project's Lightning path vs a plain Hugging Face ``Trainer`` + PEFT script.

Both fine-tune the same model (MiniLM + the same LoRA config) on the same tokenized IMDb examples with the same
batch size, max length, optimiser, schedule and number of epochs, one after the other in this process; then both
are evaluated on the same test subset. Prints samples/s of each, their ratio, and both accuracies.

    python benchmarks/bench_train.py                      # the `make train` preset: 2,000 train / 2,000 test
    python benchmarks/bench_train.py --seeds 1 2 3        # mean accuracy difference over seeds, with its error
    python benchmarks/bench_train.py --compile inductor --seeds 1 2   # ours compiled vs ours eager (Lab 4)
    python benchmarks/bench_train.py --dropout torch fast             # ours with torch's dropout, then Philox's
    python benchmarks/bench_train.py --gemm aten auto                 # ours on aten's GEMMs, then runtime.gemm=auto
    python benchmarks/bench_train.py --precision 32-true bf16-mixed   # ours in fp32, then under bf16 autocast
    python benchmarks/bench_train.py --precision 32-true auto --seeds 1 2 3 --baseline none   # issue 59's A/B

``--dropout`` picks ``model.fast_dropout`` for our runs (default ``fast``: the C++ Philox dropout, as ``train.py``
runs on CPU); with both, each seed runs the baseline once and ours once per choice, so the table shows the A/B
against the same baseline. The plain script always uses torch's dropout. ``--gemm`` likewise picks
``runtime.gemm`` for our runs (default ``auto``, as ``train.py``); several dropout and GEMM choices give one run of
ours per combination, each against the same baseline (issue 36's A/B: ``--gemm aten auto``). ``--precision``
picks ``trainer.precision`` for our runs (default ``auto``, as ``train.py``: bf16 autocast where the CPU measures it
faster, docs/precision.md); ``bf16-mixed`` runs the linear layers' GEMMs in bfloat16 under autocast, which CPUs with
AMX or AVX-512 BF16 execute at a multiple of their fp32 rate (the plain script stays in fp32). With several
precisions each seed runs them one after the other (interleaved: load falls on all alike), and a last table
compares each with the first: samples/s, test/acc, their ratio and difference per seed, and the mean over seeds.
``--baseline none`` skips the plain script (only our runs: the precision A/B without the HF run's time).
``--baseline hf-tuned`` configures the plain script as an experienced HF user would for speed on a CPU:
length-grouped batches (``train_sampling_strategy="group_by_length"``) and ``bf16=True`` where the CPU computes
bfloat16 natively, i.e. the same precision our default ``auto`` takes there (issue 59's acceptance 2)::

    python benchmarks/bench_train.py --baseline hf-tuned --seeds 1 2 3
The CPU's model name and flags are printed first.

With ``--compile PRESET`` the baseline is this project's own eager run instead of the plain script, and the
measured run adds ``compile=PRESET``: the ratio of compiled to eager training throughput (``train/samples_per_sec``
excludes ``compile/seconds``) at the accuracy each reaches, per seed.

The plain script uses the Trainer's defaults for batching (random order, dynamic padding via
``DataCollatorWithPadding``); our path groups training batches by length (``data.group_by_length``), which is
where much of the difference comes from (``--no-group-by-length`` turns that off to show it). The plain
script runs first, with glibc malloc's defaults; our path then sets ``keep_freed_memory`` as ``train.py``
does (``--no-keep-freed-memory`` turns that off to show its share).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from adls_lightning.script_args import Parser, positive_int

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = cfg.hydra.run.dir
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    return cfg


def hf_tuned_bf16() -> bool:
    """Whether the tuned HF baseline sets ``bf16=True``: where the CPU computes bfloat16 natively (the flags
    ``trainer.precision=auto`` starts from), as an experienced user would; fp32 elsewhere, where HF's CPU autocast
    would only emulate it."""
    from adls_lightning.gemm import native_bfloat16

    return bool(native_bfloat16())


def run_plain_hf(cfg, datamodule, tuned: bool = False) -> dict[str, float]:
    """The reference: HF Trainer + PEFT on the very same tokenized rows and hyper-parameters. ``tuned``: configured
    as an experienced HF user would for speed on a CPU: length-grouped batches
    (``train_sampling_strategy="group_by_length"``, HF's ``LengthGroupedSampler``, which pads each batch to
    similar lengths as our ``data.group_by_length`` does) and ``bf16=True`` where :func:`hf_tuned_bf16`."""
    import numpy as np
    import torch
    from peft import get_peft_model
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    from adls_lightning.build import build
    from adls_lightning.models import load_pretrained

    torch.manual_seed(cfg.seed)
    model = get_peft_model(
        load_pretrained(cfg.model.backbone.name_or_path), build(cfg.model.lora, "model.lora")
    )
    columns = ["input_ids", "label"]
    train = datamodule.splits["train"].with_format(None).select_columns(columns)
    test = datamodule.splits["test"].with_format(None).select_columns(columns)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=cfg.data.batch_size,
            per_device_eval_batch_size=cfg.data.batch_size,
            num_train_epochs=cfg.trainer.max_epochs,
            learning_rate=cfg.model.optimizer.lr,
            weight_decay=cfg.model.optimizer.weight_decay,
            warmup_steps=float(cfg.model.warmup_ratio),  # transformers 5: a float < 1 is a ratio
            lr_scheduler_type="linear",
            max_grad_norm=cfg.trainer.gradient_clip_val,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0,
            seed=cfg.seed,
            disable_tqdm=True,
            **({"train_sampling_strategy": "group_by_length", "bf16": hf_tuned_bf16()} if tuned else {}),
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train,
            data_collator=DataCollatorWithPadding(datamodule.tokenizer),
        )
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        predictions = trainer.predict(test)
    # against the labels predict returns beside its predictions, not test["label"]: with group_by_length,
    # transformers 5 also orders evaluation batches by length, so predictions come in another order than the rows
    accuracy = float(np.mean(predictions.predictions.argmax(-1) == predictions.label_ids))
    return {"samples_per_sec": len(train) * cfg.trainer.max_epochs / seconds, "test_acc": accuracy}


class SeedResult(NamedTuple):
    """Training samples/s and test accuracy of the baseline (plain HF, or our eager run) and ours, one seed."""

    seed: int
    base_speed: float
    base_acc: float
    our_speed: float
    our_acc: float
    compile_s: float = 0.0


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument(
        "--experiment",
        default="cpu",
        help="experiment preset for everything not set here (learning rate, truncation side; default: the "
        "`make train` preset); 'none' for the plain defaults",
    )
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--train-size", type=positive_int, default=2000)
    parser.add_argument("--test-size", type=positive_int, default=2000)
    parser.add_argument("--max-length", type=positive_int, default=256)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--epochs", type=positive_int, default=1)
    parser.add_argument("--data-dir", default="auto")
    parser.add_argument("--no-group-by-length", action="store_true")
    parser.add_argument(
        "--no-keep-freed-memory",
        action="store_true",
        help="run our path with glibc malloc's defaults (keep_freed_memory=false), like the plain script",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[42],
        help="one pair of runs per seed (model init, data split, order); several seeds give the mean accuracy "
        "difference and its standard error, which one seed cannot resolve to +-0.5 pt",
    )
    parser.add_argument(
        "--dropout",
        nargs="+",
        choices=("torch", "fast"),
        default=["fast"],
        help="dropout of our runs: torch's (model.fast_dropout=false) or the C++ Philox kernel's (true); "
        "both: one run of ours per choice against the same baseline",
    )
    parser.add_argument(
        "--compile",
        default=None,
        metavar="PRESET",
        help="compare our run with compile=PRESET (e.g. inductor) against our own eager run, not the plain script",
    )
    parser.add_argument(
        "--gemm",
        nargs="+",
        choices=("auto", "aten", "onednn"),
        default=["auto"],
        help="runtime.gemm of our runs (docs/gemm.md); several: one run of ours per choice against the same baseline",
    )
    parser.add_argument(
        "--precision",
        nargs="+",
        choices=("32-true", "bf16-mixed", "auto"),
        default=["auto"],
        help="trainer.precision of our runs (auto: as train.py); several: one run of ours per choice, each seed "
        "running them in turn, and a table comparing each with the first",
    )
    parser.add_argument(
        "--baseline",
        choices=("hf", "hf-tuned", "none"),
        default="hf",
        help="hf: the plain HF Trainer + PEFT script first on each seed (the default); hf-tuned: the same script "
        "configured as an experienced HF user would (length-grouped batches, bf16=True where the CPU has native "
        "bfloat16; issue 59's acceptance 2); none: our runs only",
    )
    args = parser.parse_args()
    presets = sorted(f.stem for f in (ROOT / "conf" / "compile").glob("*.yaml") if f.stem != "none")
    for option, value, group, extra in (
        ("--model", args.model, "model", ()),
        ("--experiment", args.experiment, "experiment", ("none",)),
    ):
        valid = [*extra, *sorted(f.stem for f in (ROOT / "conf" / group).glob("*.yaml"))]
        if value not in valid:
            parser.error(f"{option} {value}: no preset {group}={value}; valid: {', '.join(valid)}")
    if args.data_dir != "auto" and not Path(args.data_dir).is_dir():
        parser.error(f"--data-dir {args.data_dir}: no such folder (or auto)")
    if args.compile is not None and args.compile not in presets:
        parser.error(
            f"--compile {args.compile}: no preset compile={args.compile}; valid: {', '.join(presets)}"
        )
    base_name = "eager" if args.compile else ("HF tuned" if args.baseline == "hf-tuned" else "HF")
    our_name = f"compile={args.compile}" if args.compile else "ours"
    print_cpu()

    rows: dict[Variant, list[SeedResult]] = {variant: [] for variant in variants(args)}
    for seed in args.seeds:
        plain, ours_by_variant, lr = bench_one(args, seed)
        plain = plain or {"samples_per_sec": float("nan"), "test_acc": float("nan")}
        for variant, ours in ours_by_variant.items():
            rows[variant].append(
                SeedResult(
                    seed,
                    plain["samples_per_sec"],
                    plain["test_acc"],
                    ours["train/samples_per_sec"],
                    ours["test/acc"],
                    float(ours.get("compile/seconds", 0.0)),
                )
            )
    if args.baseline != "none" or args.compile:
        for variant, variant_rows in rows.items():
            name = our_name if len(rows) == 1 else f"{our_name} ({variant.label(args)})"
            print_table(args, variant_rows, base_name, name, lr, variant)
    if len(args.precision) > 1:
        print_precision_tables(args, rows)


def print_cpu() -> None:
    """The CPU this bench runs on: model name, threads, and the flags that decide its matrix units' rates."""
    import torch

    from adls_lightning.gemm import cpu_flags, cpu_name

    flags = cpu_flags().split()
    shown = [f for f in flags if f.startswith(("avx", "amx", "fma")) or f in ("bf16", "i8mm")]
    print(
        f"CPU: {cpu_name()}; {torch.get_num_threads()} thread(s), {os.cpu_count()} logical CPU(s); "
        f"torch {torch.__version__}; flags: {' '.join(shown) or '(none of avx*/amx*/fma)'}",
        flush=True,
    )


def print_precision_tables(args: argparse.Namespace, rows: dict[Variant, list[SeedResult]]) -> None:
    """Each precision after the first against the first (same dropout and GEMM choice), seed by seed: samples/s,
    test/acc, the speed ratio and the accuracy difference, then the ratio of mean speeds and the mean difference
    with its standard error."""
    first = args.precision[0]
    for variant, variant_rows in rows.items():
        if variant.precision == first:
            continue
        base_rows = rows[variant._replace(precision=first)]
        a, b = first, variant.precision
        print()
        print(
            f"{'seed':>6}{a + ' samples/s':>20}{a + ' acc':>14}{b + ' samples/s':>20}{b + ' acc':>14}"
            f"{'speed':>8}{'acc diff':>10}"
        )
        for base, ours in zip(base_rows, variant_rows):
            print(
                f"{ours.seed:>6}{base.our_speed:>20.2f}{base.our_acc:>14.4f}{ours.our_speed:>20.2f}"
                f"{ours.our_acc:>14.4f}{ours.our_speed / base.our_speed:>7.2f}x"
                f"{100 * (ours.our_acc - base.our_acc):>+9.2f}pt"
            )
        speed = statistics.mean(r.our_speed for r in variant_rows) / statistics.mean(
            r.our_speed for r in base_rows
        )
        diffs = [100 * (o.our_acc - f.our_acc) for f, o in zip(base_rows, variant_rows)]
        spread = (
            f" +- {statistics.stdev(diffs) / len(diffs) ** 0.5:.2f} (standard error)"
            if len(diffs) > 1
            else ""
        )
        print(
            f"precision {b} / {a}: speed ratio {speed:.2f}x; test/acc difference {statistics.mean(diffs):+.2f} pt"
            f"{spread} over {len(diffs)} seed(s) (model={args.model}, max_length={args.max_length}, "
            f"batch={args.batch_size}, train={args.train_size}, test={args.test_size}, dropout={variant.dropout}, "
            f"gemm={variant.gemm})"
        )


class Variant(NamedTuple):
    """One configuration of our runs: the dropout kernel, the GEMM backend and the trainer's precision."""

    dropout: str
    gemm: str
    precision: str

    def label(self, args: argparse.Namespace) -> str:
        """What sets this variant apart from the others asked for (both parts when both vary)."""
        parts = []
        if len(args.dropout) > 1:
            parts.append(f"{self.dropout} dropout")
        if len(args.gemm) > 1:
            parts.append(f"gemm={self.gemm}")
        if len(args.precision) > 1:
            parts.append(self.precision)
        return ", ".join(parts)

    def overrides(self) -> list[str]:
        fast = "true" if self.dropout == "fast" else "false"
        return [
            f"model.fast_dropout={fast}",
            f"runtime.gemm={self.gemm}",
            f"trainer.precision={self.precision}",
        ]


def variants(args: argparse.Namespace) -> list[Variant]:
    return [
        Variant(dropout, gemm, precision)
        for dropout in args.dropout
        for gemm in args.gemm
        for precision in args.precision
    ]


def print_table(
    args: argparse.Namespace,
    rows: list[SeedResult],
    base_name: str,
    our_name: str,
    lr: float,
    variant: Variant,
) -> None:
    """Per-seed rows, then the speed ratio and the mean accuracy difference with its standard error."""
    print()
    labels = [f"{base_name} samples/s", f"{base_name} acc", f"{our_name} samples/s", f"{our_name} acc"]
    widths = [len(label) + 2 for label in labels]
    print(
        f"{'seed':>6}"
        + "".join(f"{label:>{w}}" for label, w in zip(labels, widths))
        + f"{'speed':>8}{'acc diff':>10}"
        + (f"{'compile s':>11}" if args.compile else "")
    )
    for r in rows:
        print(
            f"{r.seed:>6}{r.base_speed:>{widths[0]}.2f}{r.base_acc:>{widths[1]}.4f}{r.our_speed:>{widths[2]}.2f}"
            f"{r.our_acc:>{widths[3]}.4f}{r.our_speed / r.base_speed:>7.2f}x{100 * (r.our_acc - r.base_acc):>+9.2f}pt"
            + (f"{r.compile_s:>11.1f}" if args.compile else "")
        )
    speed = statistics.mean(r.our_speed for r in rows) / statistics.mean(r.base_speed for r in rows)
    diffs = [100 * (r.our_acc - r.base_acc) for r in rows]
    spread = (
        f" +- {statistics.stdev(diffs) / len(diffs) ** 0.5:.2f} (standard error)" if len(diffs) > 1 else ""
    )
    print(
        f"speed ratio ({our_name} / {base_name}) = {speed:.2f}x; accuracy difference = {statistics.mean(diffs):+.2f} pt"
        f"{spread} over {len(rows)} seed(s) (experiment={args.experiment}, model={args.model}, "
        f"max_length={args.max_length}, batch={args.batch_size}, lr={lr}, train={args.train_size}, test={args.test_size}, "
        f"dropout={variant.dropout}, gemm={variant.gemm}, precision={variant.precision})"
    )


@contextlib.contextmanager
def precision_lines():
    """The ``trainer.precision=auto:`` lines a run logs, collected into the yielded list."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("trainer.precision=auto:"):
                lines.append(message)

    logger = logging.getLogger("adls_lightning.precision")
    handler = Collect(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def bench_one(
    args: argparse.Namespace, seed: int
) -> tuple[dict[str, float] | None, dict[Variant, dict[str, float]], float]:
    """Both paths with one seed: (baseline metrics, or None with ``--baseline none``; our metrics per variant,
    learning rate used)."""
    from adls_lightning.app.training import run
    from adls_lightning.build import build

    with tempfile.TemporaryDirectory() as out:
        overrides = [
            *([f"experiment={args.experiment}"] if args.experiment != "none" else []),
            f"seed={seed}",
            f"model={args.model}",
            "logger=none",
            "trainer=cpu",
            f"data.data_dir={args.data_dir}",
            f"data.train_size={args.train_size}",
            f"data.test_size={args.test_size}",
            "data.val_size=200",
            f"data.max_length={args.max_length}",
            f"data.batch_size={args.batch_size}",
            f"data.group_by_length={not args.no_group_by_length}",
            f"trainer.max_epochs={args.epochs}",
            f"keep_freed_memory={not args.no_keep_freed_memory}",
            "callbacks.rich_progress_bar=null",
            "callbacks.last_checkpoint=null",
        ]
        if args.compile:
            # The eager baseline pads batches as the compile preset does, so both runs see the same shapes.
            compiled_cfg = compose([*overrides, f"compile={args.compile}", f"hydra.run.dir={out}/compiled"])
            overrides.append(f"data.pad_to_multiple_of={compiled_cfg.data.pad_to_multiple_of}")
        cfg = compose([*overrides, f"hydra.run.dir={out}"])
        if args.compile:
            print(
                f"[bench] seed {seed}, adls-lightning eager: {args.train_size} rows x {args.epochs} epoch(s)",
                flush=True,
            )
            eager = run(cfg)
            baseline = {"samples_per_sec": eager["train/samples_per_sec"], "test_acc": eager["test/acc"]}
            cfg_overrides = [*overrides, f"compile={args.compile}"]
            cfg = compose([*cfg_overrides, f"hydra.run.dir={out}/compiled"])
        elif args.baseline == "none":
            cfg_overrides = overrides
            baseline = None
        else:
            cfg_overrides = overrides
            datamodule = build(cfg.data, "data")
            datamodule.setup("fit")
            tuned = args.baseline == "hf-tuned"
            how = (
                f"length-grouped batches, bf16={hf_tuned_bf16()}"
                if tuned
                else "random batches, fp32 (the Trainer's defaults)"
            )
            print(
                f"[bench] seed {seed}, plain HF Trainer + PEFT ({how}): {args.train_size} rows x "
                f"{args.epochs} epoch(s)",
                flush=True,
            )
            baseline = run_plain_hf(cfg, datamodule, tuned=tuned)
        if baseline is not None:
            print(
                f"[bench] seed {seed}, {'eager' if args.compile else 'plain HF'}: "
                f"{baseline['samples_per_sec']:.2f} samples/s, test acc {baseline['test_acc']:.4f}",
                flush=True,
            )
        ours_by_variant = {}
        for variant in variants(args):
            what = f"{variant.dropout} dropout, gemm={variant.gemm}, {variant.precision}"
            print(
                f"[bench] seed {seed}, adls-lightning{' compile=' + args.compile if args.compile else ''}, "
                f"{what}: {args.train_size} rows x {args.epochs} epoch(s)",
                flush=True,
            )
            run_dir = f"{cfg.hydra.run.dir}/{variant.dropout}-{variant.gemm}-{variant.precision}"
            with precision_lines() as resolved:
                ours = run(compose([*cfg_overrides, *variant.overrides(), f"hydra.run.dir={run_dir}"]))
            ours_by_variant[variant] = ours
            for line in resolved:  # what `auto` took, with its measured rates
                print(f"[bench] seed {seed}, {line}", flush=True)
            print(
                f"[bench] seed {seed}, {what}: {ours['train/samples_per_sec']:.2f} samples/s"
                f", test acc {ours['test/acc']:.4f}",
                flush=True,
            )
            if args.compile:
                counts = ", ".join(
                    f"{key} {ours[key]:g}" for key in sorted(ours) if key.startswith("compile/")
                )
                print(f"[bench] seed {seed}, compile={args.compile}: {counts}", flush=True)
    return baseline, ours_by_variant, float(cfg.model.optimizer.lr)


if __name__ == "__main__":
    main()
