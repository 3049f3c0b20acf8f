"""adls-table never averages runs on different data: every train.py run records what it read by content
(``.hydra/data.json``, the identity a search's study records), and a row whose runs read different files is refused
in one line naming two of them. Real tiny train.py runs on one folder, its files replaced between seeds; synthetic
run folders for runs recorded before the record existed and for a damaged record."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from adls_lightning.data.sources import data_identity
from adls_lightning.tools.results_table import main
from tests.helpers import (
    ROOT,
    assert_one_line_error,
    make_reviews,
    run_train,
    table,
    table_rows,
    train_cmd,
    write_run,
)

FEW = [
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=2",
    "+trainer.limit_val_batches=2",
    "data.val_size=20",
]


def write_reviews(folder: Path, seed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    make_reviews(100, seed=seed).to_parquet(folder / "train.parquet")
    make_reviews(40, seed=seed + 1).to_parquet(folder / "test.parquet")


def recorded_identity(run: Path) -> str:
    return json.loads((run / ".hydra" / "data.json").read_text())["identity"]


def test_seeds_on_replaced_data_are_refused_and_seeds_on_the_same_data_share_a_row(tmp_path, capsys):
    data, cache, runs = tmp_path / "A" / "dm", tmp_path / "cache", tmp_path / "A" / "mm"
    write_reviews(data, seed=10)
    node = {"_target_": "adls_lightning.data.IMDbDataModule", "data_dir": str(data)}
    before = data_identity(node)
    # seeds 0 and 1 as one multirun (jobs runs/0, runs/1: one train.py start for both), seed 2 as a run of its own
    # (runs/2) after the files are replaced: both ways of running train.py record what they read
    cmd = train_cmd(data, cache, runs / "unused", *FEW, "seed=0,1", f"hydra.sweep.dir={runs}")
    # -m first: overrides after it are not seen by train.py's pre-flight check (argparse splits them off)
    proc = subprocess.run(
        [*cmd[:2], "-m", *cmd[2:]], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same files: one identity, the one a search's study records for them
    assert recorded_identity(runs / "0") == recorded_identity(runs / "1") == before
    assert main([str(runs / "0"), str(runs / "1")]) == 0
    same = table_rows(capsys.readouterr().out)
    assert list(same) == ["all runs"] and same["all runs"][0] == "2"

    write_reviews(data, seed=20)  # other reviews under the same names, in the same folder
    proc = run_train(data, cache, runs / "2", *FEW, "seed=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert recorded_identity(runs / "2") == data_identity(node) != before
    line = assert_one_line_error(table(runs), contains="read different data")
    assert f"{runs / '0'}, {runs / '2'}:" in line
    assert before in line and data_identity(node) in line


def test_runs_recorded_before_the_data_record_group_as_before(tmp_path, capsys):
    older = write_run(tmp_path / "older", ["seed=1"], {"test/acc": 0.6})
    newer = write_run(tmp_path / "newer", ["seed=2"], {"test/acc": 0.8})
    (newer / ".hydra" / "data.json").write_text(json.dumps({"identity": "sha256:0123 of train.parquet"}))
    assert main([str(older), str(newer)]) == 0
    assert table_rows(capsys.readouterr().out) == {"all runs": ["2", "0.7000 ± 0.1414"]}


def test_runs_on_different_data_in_different_rows_are_not_refused(tmp_path, capsys):
    for name, identity in (("a", "sha256:0123 of train.parquet"), ("b", "sha256:4567 of train.parquet")):
        run = write_run(tmp_path / name, [f"data.data_dir=/data/{name}", "seed=1"], {"test/acc": 0.5})
        (run / ".hydra" / "data.json").write_text(json.dumps({"identity": identity}))
    assert main([str(tmp_path)]) == 0
    assert list(table_rows(capsys.readouterr().out)) == ["/data/a", "/data/b"]


def test_a_damaged_data_record_is_one_line_exit_2(tmp_path):
    run = write_run(tmp_path / "run", ["seed=1"], {"test/acc": 0.5})
    (run / ".hydra" / "data.json").write_text('{"identity": ')  # cut short
    assert_one_line_error(table(run), contains=f"{run / '.hydra' / 'data.json'}: not readable JSON")
