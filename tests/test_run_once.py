"""Work done once before a fit (issue 57): ``python train.py ...`` composes its config once, validates it once and
reads an ``init_ckpt`` once -- counted in a real subprocess of the entry point (``tests/count_calls.py`` wraps the
functions where they are defined), while the pre-flight's promises hold (``tests/test_bad_input.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import ENV, TINY_OVERRIDES, assert_one_line_error, tiny_run, train_run

ROOT = Path(__file__).resolve().parent.parent


def _counted(tmp_path: Path, watched: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, dict]:
    counts = tmp_path / "counts.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "count_calls.py"), str(counts), str(watched), "train.py", *overrides],
        cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return proc, json.loads(counts.read_text())


def test_a_run_from_init_ckpt_composes_validates_and_reads_it_once(tmp_path, tiny_imdb_dir, cache_dir):
    first = tmp_path / "first"
    train_run(
        first, ["trainer.max_epochs=1", "data.train_size=32", "data.val_size=32"], tiny_imdb_dir, cache_dir
    )
    (init,) = (first / "checkpoints").glob("best-*.ckpt")
    run = tmp_path / "second"
    proc, counts = _counted(
        tmp_path, init, *TINY_OVERRIDES, *tiny_run(tiny_imdb_dir, cache_dir), f"hydra.run.dir={run}",
        f"init_ckpt={init}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "metrics.json").is_file()
    assert counts == {"compose": 1, "validate_run_config": 1, "torch_load": 1}


def test_a_refused_run_composes_once_and_loads_nothing(tmp_path, tiny_imdb_dir, cache_dir):
    """The checks run on Hydra's own composition: a bad value is one line, exit 2, with no second composition and
    no run folder."""
    run = tmp_path / "refused"
    proc, counts = _counted(
        tmp_path, tmp_path / "none.ckpt", *TINY_OVERRIDES, *tiny_run(tiny_imdb_dir, cache_dir),
        f"hydra.run.dir={run}", "trainer.max_epochs=0",
    )  # fmt: skip
    assert_one_line_error(proc, contains="trainer.max_epochs=0")
    assert counts == {"compose": 1, "validate_run_config": 1, "torch_load": 0}
    assert not run.exists()
