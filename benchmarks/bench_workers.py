"""Search throughput with 1 worker vs N workers sharing one study: trials per minute on the tiny NAS space.

Each worker is one ``search.py`` process with one compute thread (``OMP_NUM_THREADS=1``); N workers run the same
command together on one journal storage (``search/storage=journal``) and share one budget of ``--trials``. Both
searches use the random sampler with the same seed, so they train the same architectures (trial n's sample depends
only on the seed and n). Trials per minute = trials / wall time of the whole command (start-up included), so the
ratio is what a user sees. The ideal ratio is min(N, cores); other load on the machine lowers it.

    python benchmarks/bench_workers.py                 # 8 trials, 1 vs 2 workers
    python benchmarks/bench_workers.py --workers 4 --trials 16

Data: the IMDb parquet files in ../shared/data/imdb (or $ADLS_IMDB_DIR), cut to a few hundred reviews.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from adls_lightning.script_args import Parser, positive_int

ROOT = Path(__file__).resolve().parents[1]
STUDY = "bench-workers"
TINY_NAS = [
    "hydra.sweeper.search_space.num_hidden_layers=[1,2]",
    "hydra.sweeper.search_space.num_attention_heads=[2,4]",
    "hydra.sweeper.search_space.hidden_size=[32,64]",
    "hydra.sweeper.search_space.intermediate_size=[64,128]",
]


def run_workers(sweep_dir: Path, workers: int, args: argparse.Namespace) -> tuple[float, int]:
    """``workers`` search.py processes on one journal study; returns (wall seconds, finished trials)."""
    cmd = [
        sys.executable, str(ROOT / "search.py"), "search=nas", "search/storage=journal",
        "hydra/sweeper/sampler=random", f"hydra.sweeper.study_name={STUDY}", f"hydra.sweeper.n_trials={args.trials}",
        f"hydra.sweeper.sampler.seed={args.seed}", f"hydra.sweep.dir={sweep_dir}", f"data.data_dir={args.data_dir}",
        "trainer=cpu", "trainer.max_epochs=1", "callbacks.rich_progress_bar=null", "data.max_length=64",
        "data.batch_size=16", f"data.train_size={args.train_size}", "data.val_size=64", "data.test_size=64",
        *TINY_NAS,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PROJECT_ROOT": str(ROOT)}
    start = time.perf_counter()
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(workers)
    ]
    errors = [p.communicate()[1] for p in procs]
    wall = time.perf_counter() - start
    if any(p.returncode for p in procs):
        raise SystemExit(
            f"a worker failed:\n{next(e for p, e in zip(procs, errors) if p.returncode)[-3000:]}"
        )
    storage = JournalStorage(JournalFileBackend(str(sweep_dir / f"{STUDY}.journal")))
    trials = optuna.load_study(study_name=STUDY, storage=storage).get_trials(deepcopy=False)
    return wall, sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=positive_int, default=8)
    parser.add_argument("--workers", type=positive_int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=positive_int, default=512)
    parser.add_argument(
        "--data-dir", default=os.environ.get("ADLS_IMDB_DIR", str(ROOT.parent / "shared" / "data" / "imdb"))
    )
    args = parser.parse_args()
    if not Path(args.data_dir).is_dir():
        source = "ADLS_IMDB_DIR" if os.environ.get("ADLS_IMDB_DIR") == args.data_dir else "--data-dir"
        parser.error(f"{source}={args.data_dir}: no such folder (give the IMDb folder with --data-dir)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(
        f"machine: {os.cpu_count()} cores; each worker uses 1 thread; {args.trials} trials of the tiny NAS space"
    )
    rates = {}
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        for n in (1, args.workers):
            wall, done = run_workers(Path(tmp) / f"w{n}", n, args)
            assert done == args.trials, f"{done} trials finished, expected {args.trials}"
            rates[n] = done / wall * 60
            print(f"{n} worker(s): {done} trials in {wall:6.1f} s = {rates[n]:5.2f} trials/min")
    ideal = min(args.workers, os.cpu_count() or 1)
    print(
        f"speed-up {args.workers} vs 1 worker: {rates[args.workers] / rates[1]:.2f}x (ideal on this machine: {ideal}x)"
    )


if __name__ == "__main__":
    main()
