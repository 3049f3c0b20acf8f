"""Search with and without a trial pruner on the same space, seed and budget: trial-epochs and best accuracy.

Both searches use the random sampler, whose per-trial seed depends only on (seed, trial number), so both
evaluate exactly the same architectures in the same order and each trial trains identically until the pruner
stops it: the difference is the pruner's alone. Also reports the sweep's overhead per trial (wall time of the
sweep minus the trials' own training and evaluation time), from the no-pruner run.

    python benchmarks/bench_search_pruner.py                         # successive halving, 12 trials x 3 epochs
    python benchmarks/bench_search_pruner.py --pruner median --trials 20

Defaults are sized for a 2-core CPU (~45 min in all): a small NAS space over random-init BERTs on a
stratified IMDb subset (2000 reviews, 300 for validation; ../shared/data/imdb or $ADLS_IMDB_DIR), cut to 64 tokens.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from adls_lightning.errors import ConfigError
from adls_lightning.runs.folder import check_writable
from adls_lightning.script_args import Parser, positive_int

ROOT = Path(__file__).resolve().parents[1]


def load_run(out: Path) -> tuple[optuna.Study, float]:
    """A finished run's study and the wall time of its trials (first start to last end)."""
    study = optuna.load_study(study_name="bench", storage=f"sqlite:///{out / 'bench.db'}")
    trials = study.get_trials(deepcopy=False)
    wall = (max(t.datetime_complete for t in trials) - min(t.datetime_start for t in trials)).total_seconds()
    return study, wall


def run_search(out: Path, pruner: str, args: argparse.Namespace) -> tuple[optuna.Study, float]:
    """One search.py run into ``out``; returns its study and the wall time of its trials."""
    overrides = [
        "search=nas",
        "hydra/sweeper/sampler=random",
        f"search/pruner={pruner}",
        f"hydra.sweeper.n_trials={args.trials}",
        f"hydra.sweep.dir={out}",
        "hydra.sweeper.study_name=bench",
        f"seed={args.seed}",
        "trainer=cpu",
        f"trainer.max_epochs={args.epochs}",
        "trainer.val_check_interval=1.0",
        "callbacks.rich_progress_bar=null",
        f"data.train_size={args.train_size}",
        f"data.val_size={args.val_size}",
        f"data.test_size={args.val_size}",
        f"data.max_length={args.max_length}",
        "data.batch_size=16",
        "model.optimizer.lr=2e-3",
        "search.nas.num_hidden_layers=[1,2]",
        "search.nas.num_attention_heads=[2,4]",
        "search.nas.hidden_size=[32,64,128]",
        "search.nas.intermediate_size=[64,128,256]",
        *args.override,
    ]
    if pruner == "median":
        overrides += ["search.pruner.n_startup_trials=3"]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"running search with pruner={pruner} (log: {log}) ...", flush=True)
    with log.open("w") as handle:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "search.py"), *overrides],
            cwd=ROOT,
            stdout=handle,
            stderr=subprocess.STDOUT,
            # one thread per process: on a shared or small CPU, more threads than free cores spin and slow
            # training down several-fold (set OMP_NUM_THREADS yourself to override)
            env={"OMP_NUM_THREADS": "1", **os.environ, "PROJECT_ROOT": str(ROOT)},
        )
    if proc.returncode:
        sys.exit(f"search with pruner={pruner} failed (exit {proc.returncode}); see {log}")
    return load_run(out)


def summarize(study: optuna.Study) -> dict[str, float]:
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    best = max(done, key=lambda t: t.value)
    return {
        "trials": len(trials),
        "pruned": sum(t.state == TrialState.PRUNED for t in trials),
        "failed": sum(t.state == TrialState.FAIL for t in trials),
        "trial_epochs": sum(t.user_attrs.get("train/epochs", 0.0) for t in trials),
        "best_acc": best.value,
        "best_trial": best.number,
        "train_eval_s": sum(t.user_attrs.get("metrics", {}).get("time/total_s", 0.0) for t in done),
        "completed": len(done),
    }


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument(
        "--pruner", default="successive_halving", choices=["median", "successive_halving", "hyperband"]
    )
    parser.add_argument("--trials", type=positive_int, default=12)
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=positive_int, default=2000)
    parser.add_argument("--val-size", type=positive_int, default=300)
    parser.add_argument("--max-length", type=positive_int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_search_pruner")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="reuse the no-pruner run in this folder (<out>/<stamp>/none) of the same settings",
    )
    parser.add_argument(
        "--pruned",
        type=Path,
        help="reuse the pruner run in this folder (<out>/<stamp>/<pruner>) instead of running it: report only",
    )
    parser.add_argument("override", nargs="*", help="extra search.py overrides for both runs")
    args = parser.parse_args()
    for option, folder in (("--baseline", args.baseline), ("--pruned", args.pruned)):
        # optuna.load_study on a missing sqlite file would create an empty one, then fail on the missing study
        if folder is not None and not (folder / "bench.db").is_file():
            parser.error(
                f"{option} {folder}: no bench.db there (give a folder an earlier run of this benchmark made)"
            )
    if args.baseline is None or args.pruned is None:
        try:
            check_writable(args.out, "--out")
        except ConfigError as error:
            parser.error(str(error))

    stamp = time.strftime("%Y%m%d-%H%M%S")
    base, base_wall = (
        load_run(args.baseline) if args.baseline else run_search(args.out / stamp / "none", "none", args)
    )
    if len(base.trials) != args.trials:
        sys.exit(f"--baseline {args.baseline}: {len(base.trials)} trials, expected --trials {args.trials}")
    pruned, _ = (
        load_run(args.pruned)
        if args.pruned
        else run_search(args.out / stamp / args.pruner, args.pruner, args)
    )
    a, b = summarize(base), summarize(pruned)
    same = [t.params for t in base.trials] == [t.params for t in pruned.trials]

    print(
        f"\nspace: small NAS, random sampler, seed {args.seed}, {args.trials} trials x {args.epochs} epochs"
        f" (identical architectures in both runs: {same})"
    )
    for name, s in (("none", a), (args.pruner, b)):
        print(
            f"  pruner={name:<18} trials {s['trials']:.0f} (pruned {s['pruned']:.0f}, failed {s['failed']:.0f})"
            f"  trial-epochs {s['trial_epochs']:6.2f}  best val/acc {s['best_acc']:.4f} (trial {s['best_trial']:.0f})"
        )
    saved = 1 - b["trial_epochs"] / a["trial_epochs"]
    print(
        f"  trial-epochs with/without pruner: {b['trial_epochs'] / a['trial_epochs']:.3f} ({saved:.1%} fewer)"
    )
    print(f"  best val/acc difference: {100 * (b['best_acc'] - a['best_acc']):+.2f} points")
    overhead = (base_wall - a["train_eval_s"]) / a["completed"]
    print(f"  sweep overhead per trial (no-pruner run, wall minus training+evaluation): {overhead:.2f} s")


if __name__ == "__main__":
    main()
