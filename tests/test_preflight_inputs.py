"""A single run's input files are checked in the pre-flight check, by the functions the run itself calls.

A bad data file or checkpoint is refused before torch (checkpoint contents: before Lightning) is imported, in
seconds instead of after the model libraries have loaded; a good run still reads each data file once (the
pre-flight's read is the run's, from the process's cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from adls_lightning.app.preflight import check_run_inputs
from adls_lightning.build import build
from adls_lightning.data import folder, glue
from tests.glue_layouts import write_glue_task
from tests.helpers import train_cmd

ROOT = Path(__file__).resolve().parent.parent
# Runs train.py's entry point once per command line in one process, then says which heavy modules it imported.
IN_PROCESS = """
import json, sys
HEAVY = ("torch", "lightning", "transformers")
from pathlib import Path
from adls_lightning.app.cli import train
codes = []
for args in json.loads(sys.argv[1]):
    sys.argv = ["train.py", *args]
    try:
        train(Path("conf").resolve())
        codes.append(0)
    except SystemExit as stop:
        codes.append(stop.code)
print(json.dumps({"codes": codes, "imported": [m for m in HEAVY if m in sys.modules]}))
"""


def _refusals(commands: list[list[str]]) -> tuple[dict, list[str]]:
    """Exit codes and heavy modules of ``commands`` (``train.py`` argument lists) run in one process; the
    ``error:`` lines of stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", IN_PROCESS, json.dumps(commands)],
        cwd=ROOT,
        env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    return json.loads(proc.stdout.splitlines()[-1]), errors


def test_bad_data_and_checkpoint_files_are_refused_before_torch_is_imported(
    tmp_path, tiny_imdb_dir, cache_dir
):
    nulls = tmp_path / "nulls"
    nulls.mkdir()
    frame = pd.read_parquet(tiny_imdb_dir / "train.parquet")
    frame.loc[7, "text"] = None
    frame.to_parquet(nulls / "train.parquet")
    (nulls / "test.parquet").write_bytes((tiny_imdb_dir / "test.parquet").read_bytes())
    no_dev = write_glue_task(tmp_path / "glue", "rte")
    (no_dev / "RTE" / "dev.tsv").unlink()
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(os.urandom(2048))
    commands = {
        "row 7 has text None": [f"data.data_dir={nulls}"],
        "data.val_size=400: larger than or equal to the 400 training rows": ["data.val_size=400"],
        "no RTE/dev.tsv": ["data=glue", "data.task=rte", f"data.data_dir={no_dev}", "data.val_size=20"],
        "garbage.ckpt: not a checkpoint": [f"ckpt_path={garbage}"],
    }
    outs = [tmp_path / f"out{i}" for i in range(len(commands))]
    found, errors = _refusals(
        [train_cmd(tiny_imdb_dir, cache_dir, out, *args)[2:] for out, args in zip(outs, commands.values())]
    )
    assert found == {"codes": [2] * len(commands), "imported": []}
    assert len(errors) == len(commands) and all(want in line for want, line in zip(commands, errors)), errors
    assert not any(out.exists() and any(out.iterdir()) for out in outs)


def test_checkpoint_contents_are_refused_before_lightning_is_imported(tmp_path, tiny_imdb_dir, cache_dir):
    torch.save(torch.ones(3), tmp_path / "tensor.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "no-version.ckpt")
    args = [f"init_ckpt={tmp_path / 'tensor.ckpt'}", f"ckpt_path={tmp_path / 'no-version.ckpt'}"]
    found, errors = _refusals([train_cmd(tiny_imdb_dir, cache_dir, tmp_path / "out", *args)[2:]])
    assert found == {"codes": [2], "imported": ["torch"]}
    # both named, in one line
    assert (
        "tensor.ckpt: not a Lightning checkpoint" in errors[0]
        and "no-version.ckpt: not a Lightning" in errors[0]
    )


@pytest.mark.parametrize("source", ["folder", "glue"])
def test_a_run_reads_its_data_files_once(compose_cfg, tmp_path, tiny_imdb_dir, monkeypatch, source):
    reads: list[str] = []
    if source == "folder":  # a copy: the session's other tests have this process's cache of tiny_imdb_dir
        data = tmp_path / "data"
        data.mkdir()
        for name in ("train.parquet", "test.parquet"):
            (data / name).write_bytes((tiny_imdb_dir / name).read_bytes())
        reader, overrides = folder.read_data_file, [f"data.data_dir={data}", "data.val_size=20"]
        monkeypatch.setattr(folder, "read_data_file", lambda path: reads.append(path.name) or reader(path))
    else:
        root = write_glue_task(tmp_path / "glue", "rte")
        reader = glue.read_glue_tsv
        overrides = ["data=glue", "data.task=rte", f"data.data_dir={root}", "data.val_size=20"]
        monkeypatch.setattr(
            glue, "read_glue_tsv", lambda path, name: reads.append(path.name) or reader(path, name)
        )
    cfg = compose_cfg(overrides)
    job = OmegaConf.to_container(cfg, resolve=True)
    job.pop("hydra")
    check_run_inputs(job)  # the pre-flight check's read
    assert sorted(reads) == (
        ["test.parquet", "train.parquet"] if source == "folder" else ["dev.tsv", "train.tsv"]
    )
    datamodule = build(cfg.data, "data")
    datamodule.setup("fit")  # the run's: from the cache
    assert len(reads) == 2 and len(datamodule.splits["val"]) == 20


def test_a_hub_source_is_left_to_the_run(monkeypatch):
    """No download in the pre-flight check: a hub data set (no folder) is not read there."""
    from adls_lightning.data import sources

    def no_read(*args):
        raise AssertionError("read in the pre-flight check")

    monkeypatch.setattr(folder, "load_raw_splits", no_read)
    monkeypatch.setattr(sources, "load_glue", no_read)
    monkeypatch.delenv("ADLS_IMDB_DIR", raising=False)
    monkeypatch.setattr(folder, "default_data_dir", lambda: None)  # 'auto' finds no folder: the hub
    sources.check_local_data({"_target_": "adls_lightning.data.IMDbDataModule", "data_dir": "auto"})
    sources.check_local_data({"_target_": "adls_lightning.data.IMDbDataModule", "data_dir": None})
    sources.check_local_data(
        {"_target_": "adls_lightning.data.FolderDataModule", "data_dir": None, "hub_name": "a/b"}
    )
    sources.check_local_data(
        {"_target_": "adls_lightning.data.GlueDataModule", "task": "rte", "data_dir": None}
    )


def test_a_search_space_is_checked_without_the_model_libraries():
    """The pre-flight check of a search builds its space (to check the choices) without importing torch."""
    code = (
        "import sys\n"
        "from adls_lightning.errors import ConfigError\n"
        "from adls_lightning.search.spaces import NasSpace\n"
        "try:\n"
        "    NasSpace([2], [2], [], [64])\n"
        "except ConfigError as err:\n"
        "    print(err)\n"
        "print([m for m in ('torch', 'transformers') if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == [
        "hydra.sweeper.search_space.hidden_size: must be a non-empty list of choices",
        "[]",
    ], proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["model=tiny_random", "-m", "seed=1,2", "x=1"], ["-m", "model=tiny_random", "seed=1,2", "x=1"]),
        (["a=1", "--cfg", "job", "b=2"], ["--cfg", "job", "a=1", "b=2"]),
        (["-m", "seed=1,2", "x=1"], ["-m", "seed=1,2", "x=1"]),  # one run of overrides: as it was
        (["a=1", "--info"], ["a=1", "--info"]),
    ],
)
def test_overrides_on_both_sides_of_a_flag_all_reach_hydra(argv, expected):
    from hydra._internal.utils import get_args_parser

    from adls_lightning.app.cli import overrides_last

    reordered = overrides_last(argv)
    assert reordered == expected
    # Hydra's own parser (parse_args, as @hydra.main calls it) now takes every override
    assert sorted(get_args_parser().parse_args(reordered).overrides) == sorted(a for a in argv if "=" in a)
