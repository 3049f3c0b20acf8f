"""adls-table: one table over any runs. A real tiny 2-method x 2-seed multirun of train.py gives the table its
run folders as training writes them; synthetic folders check the arithmetic (mean and sample std against numpy,
seeds grouped, n counted, a nan run footnoted and left out), the CSV and the refusals of bad input."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from adls_lightning.tools.results_table import main
from tests.helpers import (
    ROOT,
    assert_one_line_error,
    run_train,
    table,
    table_rows,
    train_cmd,
    write_run,
    write_sweep,
)


@pytest.fixture
def sweep(tmp_path) -> tuple[Path, dict]:
    """A multirun folder of 2 methods x 3 seeds (:func:`tests.helpers.write_sweep`) and the metrics by method."""
    return write_sweep(tmp_path / "sweep")


def test_seeds_group_into_one_row_with_mean_std_and_n(sweep, capsys):
    root, values = sweep
    assert main([str(root)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == (
        "| prune | n | test/acc | test/f1 | val/acc | trainable params | total params | weight sparsity |"
    )
    rows = table_rows(text)
    assert list(rows) == ["l1_0.5", "wanda_0.5"]
    for method, runs in values.items():
        assert rows[method][0] == "3"
        for column, cell in zip(("test/acc", "test/f1", "val/acc"), rows[method][1:4]):
            numbers = np.array([run[column] for run in runs])
            assert cell == f"{numbers.mean():.4f} ± {numbers.std(ddof=1):.4f}"
        assert rows[method][4:] == ["0.001M", "0.005M", "0.500"]  # the same in every seed: shown once
    assert "Shared by every run: model=tiny_random" in text


def test_a_nan_run_is_footnoted_and_left_out_of_the_mean(sweep, capsys):
    root, values = sweep
    metrics = json.loads((root / "4" / "metrics.json").read_text())
    (root / "4" / "metrics.json").write_text(json.dumps({**metrics, "test/acc": float("nan")}))
    metrics = json.loads((root / "5" / "metrics.json").read_text())
    del metrics["test/f1"]
    (root / "5" / "metrics.json").write_text(json.dumps(metrics))
    assert main([str(root)]) == 0
    text = capsys.readouterr().out
    cell = table_rows(text)["wanda_0.5"][1]
    kept = np.array([values["wanda_0.5"][0]["test/acc"], values["wanda_0.5"][2]["test/acc"]])
    assert cell == f"{kept.mean():.4f} ± {kept.std(ddof=1):.4f} (2/3) [1]"
    assert table_rows(text)["wanda_0.5"][2].endswith("(2/3) [2]")
    assert f"[1] not a number: {root / '4'} has test/acc = nan; left out of the mean." in text
    assert f"[2] not a number: {root / '5'} has no test/f1; left out of the mean." in text
    assert not any("nan" in cell for cells in table_rows(text).values() for cell in cells)  # never a nan mean


def test_csv_holds_mean_std_n_per_metric_and_the_runs(sweep, tmp_path, capsys):
    root, values = sweep
    out = tmp_path / "out"
    assert main([f"{root}/*", f"out={out}"]) == 0  # a glob of the job folders (multirun.yaml is no run)
    assert sorted(p.name for p in out.iterdir()) == ["table.csv", "table.md", "table.png"]
    assert (out / "table.md").read_text() == capsys.readouterr().out.split("\nwrote ")[0]
    with (out / "table.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    stats = [f"{c} {s}" for c in ("test/acc", "test/f1", "val/acc") for s in ("mean", "std", "n")]
    extras = [f"{c} {s}" for c in ("params/trainable", "params/total", "prune/weight_sparsity") for s in ("mean", "std", "n")]  # fmt: skip
    assert list(rows[0]) == ["prune", "n", *stats, *extras, "runs"]
    for row, (method, runs) in zip(rows, values.items()):
        numbers = [run["test/acc"] for run in runs]
        assert row["prune"] == method and row["n"] == "3" and row["test/acc n"] == "3"
        assert float(row["test/acc mean"]) == pytest.approx(np.mean(numbers), abs=1e-12)
        assert float(row["test/acc std"]) == pytest.approx(np.std(numbers, ddof=1), abs=1e-12)
    assert rows[0]["runs"].split() == [str(root / str(job)) for job in range(3)]
    assert (out / "table.png").read_bytes()[:4] == b"\x89PNG"
    # out holds the earlier table: redrawn, here of the first method's runs alone
    assert main([*(str(root / str(job)) for job in range(3)), f"out={out}"]) == 0
    redrawn = (out / "table.md").read_text()
    assert "prune=l1_0.5" in redrawn and "wanda_0.5" not in redrawn
    assert sorted(p.name for p in out.iterdir()) == ["table.csv", "table.md", "table.png"]


def test_the_precision_each_row_trained_in_is_a_column_blank_for_runs_recorded_before_it(tmp_path, capsys):
    # one configuration per precision setting: auto resolved to bf16 on one seed's machine and fp32 on another's
    recorded = {
        "auto": ["bf16-mixed", "32-true"],
        "32-true": ["32-true", "32-true"],
        "bf16-mixed": ["bf16-mixed", None],  # its second run was recorded before metrics.json held the key
        "16-true": [None, None],  # both recorded before it: a blank cell
    }
    job = 0
    for setting, precisions in recorded.items():
        for seed, resolved in enumerate(precisions, 1):
            metrics = {"test/acc": 0.5 + seed / 10}
            if resolved is not None:
                metrics["trainer/precision"] = resolved
            write_run(tmp_path / str(job), [f"trainer.precision={setting}", f"seed={seed}"], metrics)
            job += 1
    out = tmp_path / "table"
    assert main([str(tmp_path), f"out={out}"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == "| trainer.precision | n | test/acc | precision |"
    precision_cells = {setting: cells[-1] for setting, cells in table_rows(text).items()}
    assert precision_cells == {
        "auto": "bf16-mixed, 32-true",
        "32-true": "32-true",
        "bf16-mixed": "bf16-mixed",
        "16-true": "",
    }
    assert table_rows(text)["16-true"][:2] == ["2", "0.6500 ± 0.0707"]  # the old runs' numbers as before
    with (out / "table.csv").open() as handle:
        rows = {row["trainer.precision"]: row for row in csv.DictReader(handle)}
    assert {setting: row["trainer/precision"] for setting, row in rows.items()} == precision_cells
    # runs that all predate the key: no such column, the table as it was
    old = tmp_path / "old"
    write_run(old / "0", ["seed=1"], {"test/acc": 0.6})
    assert main([str(old)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "| configuration | n | test/acc |"


def test_per_seed_keys_and_trial_identity_are_left_out(tmp_path, capsys):
    for i, (lr, seed) in enumerate([("1e-3", 1), ("1e-3", 2), ("1e-4", 1)]):
        overrides = [
            f"model.optimizer.lr={lr}",
            f"seed={seed}",
            f"data.seed={seed}",
            f"++search.trial.number={i}",
        ]
        write_run(tmp_path / f"trial_{i}", overrides, {"test/acc": 0.5 + i / 10})
    assert main([str(tmp_path)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert {k: v[:2] for k, v in rows.items()} == {"1e-3": ["2", "0.5500 ± 0.0707"], "1e-4": ["1", "0.7000"]}


def test_a_study_gives_its_trials_folders(tmp_path, capsys):
    import optuna

    db = tmp_path / "s.db"
    study = optuna.create_study(storage=f"sqlite:///{db}", study_name="s")
    for i, value in enumerate((0.7, 0.8)):
        run = write_run(tmp_path / f"trial_{i}", [f"model.optimizer.lr=1e-{i + 3}"], {"val/acc": value})
        study.add_trial(optuna.trial.create_trial(value=value, user_attrs={"output_dir": str(run)}))
    assert main([str(db)]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert {k: v[:2] for k, v in rows.items()} == {"1e-3": ["1", "0.7000"], "1e-4": ["1", "0.8000"]}


@pytest.mark.parametrize(
    ("case", "contains"),
    [
        ("no_match", "no*: no run found"),
        ("empty_folder", "no run found"),
        ("damaged_metrics", "metrics.json: not readable JSON"),
        ("out_under_file", "is a file, not a folder"),
        ("mixed_tasks", "runs of different tasks"),
        ("no_overrides", "overrides.yaml: missing"),
        ("unknown_option", "outt: unknown option"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(sweep, tmp_path, case, contains):
    root, _ = sweep
    out = tmp_path / "out"
    args = [root, f"out={out}"]
    if case == "no_match":
        args = [tmp_path / "no*", f"out={out}"]
    elif case == "empty_folder":
        (tmp_path / "empty").mkdir()
        args = [tmp_path / "empty", f"out={out}"]
    elif case == "damaged_metrics":
        (root / "2" / "metrics.json").write_text('{"test/acc": 0.5')  # cut short by a killed job
    elif case == "out_under_file":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "out"
        args = [root, f"out={out}"]
    elif case == "mixed_tasks":
        write_run(root / "9", ["prune=none"], {"test/acc": 0.5}, {"task": "rte", "main_metric": "acc"})
    elif case == "no_overrides":
        (root / "3" / ".hydra" / "overrides.yaml").unlink()
    elif case == "unknown_option":
        args = [root, f"outt={out}"]
    line = assert_one_line_error(table(*args), contains=contains)
    if case == "mixed_tasks":
        assert str(root / "9") in line
    assert not out.exists()


def test_help_is_the_usage():
    proc = table("--help")
    assert proc.returncode == 0 and "RUN_OR_GLOB" in proc.stdout and "mean ± std" in proc.stdout


# The real sweep's jobs train this briefly; a run of one job's configuration, compiled, differs from that job only in
# its compile keys (test_a_real_compiled_run_and_an_uncompiled_one_say_which_is_which).
SWEEP_RUN = ["trainer.max_epochs=1", "+trainer.limit_train_batches=2", "+trainer.limit_val_batches=2"]


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory, tiny_imdb_dir, cache_dir) -> Path:
    """A real multirun of train.py: prune=l1_0.5,none x seed=1,2 (4 jobs, a few seconds each). Shared by the
    multirun's table and, as its uncompiled run, by the compile column's test: one train.py start fewer."""
    folder = tmp_path_factory.mktemp("real_sweep")
    cmd = train_cmd(
        tiny_imdb_dir, cache_dir, folder / "unused", "prune=l1_0.5,none", "seed=1,2",
        f"hydra.sweep.dir={folder / 'sweep'}", *SWEEP_RUN,
    )  # fmt: skip
    # -m first: overrides after it are not seen by train.py's pre-flight check (argparse splits them off)
    proc = subprocess.run(
        [*cmd[:2], "-m", *cmd[2:]], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "sweep"


@pytest.mark.slow
def test_a_real_multirun_makes_one_row_per_method(real_sweep, tmp_path):
    out = tmp_path / "table"
    proc = table(real_sweep, f"out={out}")
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    assert list(rows) == ["l1_0.5", "none"]
    runs = {}
    for job in sorted(real_sweep.glob("[0-9]*")):
        method = next(o for o in yaml.safe_load((job / ".hydra/overrides.yaml").read_text()) if "prune=" in o)
        runs.setdefault(method.split("=")[1], []).append(json.loads((job / "metrics.json").read_text()))
    header = proc.stdout.splitlines()[0].split("|")[1:-1]
    assert [h.strip() for h in header][:3] == ["prune", "n", "test/acc"]  # IMDb's main metric first
    for method, metrics in runs.items():
        accs = [m["test/acc"] for m in metrics]
        assert rows[method][:2] == ["2", f"{np.mean(accs):.4f} ± {np.std(accs, ddof=1):.4f}"]
        assert all(math.isfinite(a) for a in accs)
    columns = [h.strip() for h in header]
    sparsity = columns.index("weight sparsity") - 1  # rows hold the cells after the row's name
    assert rows["l1_0.5"][sparsity] == "0.500" and rows["none"][sparsity] == ""
    bits = columns.index("bits/weight") - 1  # every run records its storage: the base row is priced too
    assert rows["none"][bits] == rows["l1_0.5"][bits] == "32.00"
    # trainer=cpu's precision is auto: each job records what it resolved to, as its train.log says
    for job in sorted(real_sweep.glob("[0-9]*")):
        [line] = [x for x in (job / "train.log").read_text().splitlines() if "trainer.precision=auto: " in x]
        resolved = line.split("trainer.precision=auto: ")[1].split()[0].rstrip(",")
        assert json.loads((job / "metrics.json").read_text())["trainer/precision"] == resolved
    resolved_by_method = {
        method: ", ".join(dict.fromkeys(m["trainer/precision"] for m in metrics))
        for method, metrics in runs.items()
    }
    assert columns[-1] == "precision"
    assert {method: cells[-1] for method, cells in rows.items()} == resolved_by_method
    assert (out / "table.png").stat().st_size > 0 and (out / "table.csv").is_file()


def test_a_run_folder_named_with_equals_signs_is_a_run(tmp_path, capsys):
    # a sweep with hydra.sweep.subdir=${hydra.job.override_dirname} names its job folders key=value,...
    for seed in (1, 2):
        write_run(
            tmp_path / f"prune=none,seed={seed}",
            ["prune=none", f"seed={seed}"],
            {"test/acc": 0.5 + seed / 10},
        )
    assert main([str(tmp_path / "prune=none,seed=1"), str(tmp_path / "prune=none,seed=2")]) == 0
    assert table_rows(capsys.readouterr().out) == {"all runs": ["2", "0.6500 ± 0.0707"]}


def write_choices(run: Path, **choices: str) -> None:
    """The run's Hydra record of its config group options, as train.py leaves it (``.hydra/hydra.yaml``)."""
    (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}))


def test_a_key_a_run_left_alone_shows_what_the_run_ran_with(tmp_path, capsys):
    # compile=none, compile=inductor (its backend from the preset), compile=inductor compile.backend=aot_eager
    runs = {
        "plain": ([], "none", {}),
        "inductor": (["compile=inductor"], "inductor", {"backend": "inductor", "mode": "default"}),
        "aot_eager": (
            ["compile=inductor", "compile.backend=aot_eager"], "inductor", {"backend": "aot_eager", "mode": "default"}
        ),
    }  # fmt: skip
    for name, (overrides, choice, compile_node) in runs.items():
        run = write_run(tmp_path / name, ["seed=1", *overrides], {"test/acc": 0.5})
        config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({**config, "compile": compile_node}))
        write_choices(run, compile=choice, quant="none")
    assert main([str(tmp_path / name) for name in runs]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == "| compile | compile.backend | n | test/acc |"
    labels = [
        [cell.strip() for cell in line.split("|")[1:3]] for line in text.splitlines()[2:] if "|" in line
    ]
    assert labels == [
        ["none", "none"],  # no compile: no backend either
        ["inductor", "inductor"],  # the preset's backend, not the word "default"
        ["inductor", "aot_eager"],
    ]


@pytest.mark.slow
def test_a_real_compiled_run_and_an_uncompiled_one_say_which_is_which(
    real_sweep, tiny_imdb_dir, cache_dir, tmp_path
):
    # the uncompiled run: the real sweep's job of prune=none, seed=1; the compiled one is that job's configuration
    # run alone with compile=aot_eager compile.backend=eager, so the compile keys are all that differ
    [plain] = [
        job
        for job in sorted(real_sweep.glob("[0-9]*"))
        if {"prune=none", "seed=1"} <= set(yaml.safe_load((job / ".hydra/overrides.yaml").read_text()))
    ]
    compiled = run_train(
        tiny_imdb_dir, cache_dir, tmp_path / "compiled", "prune=none", "seed=1", *SWEEP_RUN,
        "compile=aot_eager", "compile.backend=eager",
    )  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    # the run summary shows the compile counts metrics.json records, as it shows the other groups'
    recorded = json.loads((tmp_path / "compiled" / "metrics.json").read_text())
    shown = [line.split("│")[0].strip() for line in compiled.stdout.splitlines() if "│" in line]
    assert {"compile/seconds", "compile/graphs"} <= set(shown) & {
        k for k in recorded if k.startswith("compile/")
    }
    proc = table(plain, tmp_path / "compiled")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("| compile | compile.backend | n |")
    assert {row: cells[0] for row, cells in table_rows(proc.stdout).items()} == {
        "none": "none",
        "aot_eager": "eager",
    }
