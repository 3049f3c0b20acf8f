"""Bad input to the figure scripts and the benchmarks (``scripts/*``, ``benchmarks/*``), as a user runs them: each
refusal is one ``error:`` line naming the setting, exit status 2, nothing written, and it comes before any work
(seconds, where the work is minutes to hours). One representative case per class of check:

- a number option out of its range, or a value of the wrong form (argparse ``type=``),
- a name that must be one of a set (a compile backend, a model preset),
- an output no file can be written to, checked before the work,
- a damaged input (a cut ``metrics.json``),
- a check that a dry run used to skip (``--group-size``),
- the shell scripts' environment variables and part names, read at the start, not when their step comes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import assert_one_line_error

ROOT = Path(__file__).resolve().parent.parent
# A refusal must come before any work: generous for a loaded 2-core machine importing torch, far below a run.
REFUSAL_SECONDS = 90


def run(
    command: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess:
    start = time.monotonic()
    proc = subprocess.run(
        command,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PY": sys.executable, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert time.monotonic() - start < REFUSAL_SECONDS, f"{command}: refused only after the work started"
    return proc


def python(script: str, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, script, *map(str, args)])


@pytest.fixture
def blocker(tmp_path) -> Path:
    """A regular file: nothing can be written under it (``blocker / "out.png"``), on any machine and as root."""
    path = tmp_path / "a-file"
    path.write_text("")
    return path


@pytest.mark.parametrize(
    ("script", "args", "contains"),
    [
        (
            "benchmarks/bench_train.py",
            ["--train-size", "0"],
            "argument --train-size: 0: must be a positive integer",
        ),
        (
            "benchmarks/bench_train.py",
            ["--model", "minilmx"],
            "--model minilmx: no preset model=minilmx; valid:",
        ),
        (
            "benchmarks/bench_search_pruner.py",
            ["--trials", "-3"],
            "argument --trials: -3: must be a positive",
        ),
        (
            "benchmarks/bench_workers.py",
            ["--data-dir", "/no/such/imdb"],
            "--data-dir=/no/such/imdb: no such folder",
        ),
        (
            "benchmarks/bench_prune.py",
            ["--sparsity", "1.5"],
            "argument --sparsity: 1.5: must be a number in [0, 1)",
        ),
        ("benchmarks/bench_gemm.py", ["--tokens", "16y256"], "'16y256': must be BATCHxLENGTH, e.g. 16x256"),
        ("benchmarks/bench_quant.py", ["--presets", "int7"], "argument --presets: invalid choice: 'int7'"),
        # issue 56: a backend name torch does not know was a traceback, before a benchmark of minutes
        (
            "benchmarks/lab4_compile.py",
            ["--backends", "nosuch"],
            "--backends.backend='nosuch': unknown; valid:",
        ),
        # issue 56: the dry run accepted a group size the real run refuses
        (
            "benchmarks/bench_mxint8.py",
            ["--group-size", "48", "--dry-run"],
            "--group-size 48: does not divide",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) and value.startswith("benchmarks/") else None,
)
def test_benchmark_option_is_refused_in_one_line(script, args, contains):
    assert_one_line_error(python(script, *args), contains=contains)


@pytest.mark.parametrize(
    ("script", "args", "option"),
    [
        ("benchmarks/lab4_sdpa.py", ["--json", "{blocker}/lab4_sdpa.json"], "--json="),
        ("scripts/plot_search.py", ["pareto", "{tmp}/none.db", "--out", "{blocker}/pareto.png"], "--out="),
        ("benchmarks/bench_inference.py", ["--tiny", "--figure", "{tmp}/speed.gif"], ".png, .svg, .pdf"),
    ],
    ids=["benchmark-json", "plot-search-out", "figure-suffix"],
)
def test_an_output_that_cannot_be_written_is_refused_before_the_work(tmp_path, blocker, script, args, option):
    args = [a.format(blocker=blocker, tmp=tmp_path) for a in args]
    line = assert_one_line_error(python(script, *args), contains=option)
    assert "a-file" in line or "must end in" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written, no study created


def test_plot_script_names_a_cut_metrics_json(tmp_path):
    run_dir = tmp_path / "runs" / "l1_0.5"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.json").write_text(json.dumps({"test/acc": 0.8, "time/total_s": 1.0})[:12])
    out = tmp_path / "fig.png"
    proc = python("scripts/plot_lab1_sparsity.py", tmp_path / "runs", "--out", out)
    assert_one_line_error(proc, contains=f"{run_dir / 'metrics.json'}: not readable JSON")
    assert not out.exists()


def test_memory_report_dry_run_checks_the_group_size_against_the_layers():
    """issue 56: ``--group-size`` was checked only when packing, after the fp32 evaluation; the dry run (which
    builds the shape on the meta device: no memory, no data) now refuses it naming the layer."""
    proc = python(
        "scripts/mxint8_memory_report.py", "--from-config", "bert-base", "--group-size", "100", "--dry-run"
    )
    assert_one_line_error(proc, contains="--group-size 100: group_size=100 does not divide in_features=768")


def test_memory_report_refuses_an_exclude_that_matches_no_layer():
    """A misspelt ``--exclude`` packed the layer it meant to keep float, and the report said it was excluded."""
    proc = python(
        "scripts/mxint8_memory_report.py", "--from-config", "bert-base", "--exclude", "clasifier", "--dry-run"
    )
    assert_one_line_error(
        proc, contains="--exclude clasifier: 'clasifier' matches no linear layer of the model"
    )


@pytest.mark.parametrize(
    ("script", "env", "args", "contains"),
    [
        # issue 56: STREAMS was read at the sparsity sweep, after the first hour
        ("scripts/lab1_figures.sh", {"STREAMS": "two"}, [], "STREAMS=two: must be a positive integer"),
        ("scripts/lab1_figures.sh", {}, ["--fast"], "--fast: lab1_figures.sh takes no arguments"),
        # issue 56: PLOT_ONLY=yes ran every study
        ("scripts/search_figures.sh", {"PLOT_ONLY": "yes"}, ["lab3"], "PLOT_ONLY=yes: must be 0 or 1"),
        # a misspelt part after a valid one was refused only when its turn came, hours in
        ("scripts/search_figures.sh", {}, ["lab3", "lab9"], "lab9: unknown part (valid: lab2-samplers"),
        ("scripts/search_figures.sh", {"SEEDS": "0 one"}, ["lab2-samplers"], "SEEDS: one is not a seed"),
        ("scripts/glue_table.sh", {"TASKS": "rte mrcp"}, [], "TASKS: mrcp is not a GLUE task (valid: cola"),
        # the table's outputs were checked after all the fine-tunes
        (
            "scripts/glue_table.sh",
            {"FIG": "{tmp}/table.gif"},
            [],
            "FIG={tmp}/table.gif: must end in one of .png",
        ),
        ("scripts/gpu_check.sh", {}, ["--dryrun"], "--dryrun: unknown option"),
    ],
    ids=[
        "lab1-streams",
        "lab1-argument",
        "search-plot-only",
        "search-late-part",
        "search-seeds",
        "glue-tasks",
        "glue-figure",
        "gpu-check-flag",
    ],
)
def test_shell_script_settings_are_checked_before_the_first_run(tmp_path, script, env, args, contains):
    out = tmp_path / "out"
    env = {"OUT": str(out), "SEARCH_DIR": str(tmp_path / "search")} | {
        key: value.format(tmp=tmp_path) for key, value in env.items()
    }
    proc = run(["bash", script, *args], env=env)
    assert_one_line_error(proc, contains=contains.format(tmp=tmp_path))
    assert not out.exists() and not (tmp_path / "search").exists()


def test_shell_script_refuses_an_output_folder_it_cannot_write(tmp_path, blocker):
    proc = run(["bash", "scripts/lab1_figures.sh"], env={"OUT": str(blocker / "lab1")})
    assert_one_line_error(proc, contains=f"OUT={blocker / 'lab1'}: {blocker} is a file, not a folder")


def test_make_help_lists_every_target_and_bench_runs_benchmarks():
    """``lab4`` was hidden from ``make help`` (a digit in its name); ``make bench`` did nothing."""
    listed = run(["make", "--no-print-directory", "help"]).stdout
    for target in ("lab4", "bench", "gpu-check", "portable-check", "test"):
        assert f"  {target} " in listed, listed
    dry = run(["make", "--no-print-directory", "-n", "bench", "VENV=.venv"]).stdout
    assert dry.count("benchmarks/bench_") == 5, dry
