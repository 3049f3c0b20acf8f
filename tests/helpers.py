"""Helpers for the tests: :func:`compose_config` (the project's configs composed in-process, as the entry points
compose them), :func:`requires` (skip unless the machine has a GPU / a PostgreSQL server); for the tests that run the entry points as subprocesses, kill-and-resume runs of ``train.py`` and
the one-line error check of bad input.

Two callbacks ride along in a ``train.py`` subprocess through ``ADLS_EXTRA_TARGETS``: :class:`RecordBatches`
writes a fingerprint of every training batch per global step, :class:`KillAtStep` ends the process at a given
step the way SIGKILL would (``os._exit``: no checkpoint, no clean-up, nothing flushed), so a kill lands at the
same step on every machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
KILLED_EXIT = 17


def compose_config(config_name: str, overrides=(), *, return_hydra_config: bool = False) -> DictConfig:
    """``conf/<config_name>.yaml`` with ``overrides``, composed as the entry points compose it (no version_base:
    Hydra's current defaults, as ``adls_lightning.app.cli``)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR)):
        return compose(config_name, list(overrides), return_hydra_config=return_hydra_config)


#: What a test may need that a machine may lack: (is it here?, the skip reason). ``gpu`` and ``postgres`` are also
#: pytest markers (``-m "not gpu"``), which :func:`requires` adds.
REQUIREMENTS: dict[str, tuple[Callable[[], bool], str]] = {
    "gpu": (lambda: torch.cuda.is_available(), "needs a CUDA device"),
    "postgres": (
        lambda: shutil.which("initdb") is not None,
        "no PostgreSQL server binary (initdb) on this machine: apt-get install postgresql",
    ),
}


def requires(*needs: str) -> Callable:
    """Decorator: mark a test with each of ``needs`` and skip it unless the machine has them all."""
    missing = [REQUIREMENTS[need][1] for need in needs if not REQUIREMENTS[need][0]()]

    def decorate(test: Callable) -> Callable:
        for need in needs:
            test = getattr(pytest.mark, need)(test)
        return pytest.mark.skipif(bool(missing), reason="; ".join(missing))(test)

    return decorate


class RecordBatches(L.Callback):
    """Append ``{"step": global_step, "rows": [crc32 of each row's tokens]}`` per training batch to a file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rows = [zlib.crc32(row[row != 0].numpy().tobytes()) for row in batch["input_ids"]]
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": trainer.global_step, "rows": rows}) + "\n")


class KillAtStep(L.Callback):
    """``os._exit(KILLED_EXIT)`` when the given global step is about to run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os._exit(KILLED_EXIT)


def train_cmd(data_dir: Path, cache_dir: Path, out: Path, *extra: str) -> list[str]:
    """``train.py`` on the tiny random BERT and ``data_dir``, writing into ``out``; ``extra`` overrides last."""
    from tests.conftest import TINY_OVERRIDES

    paths = [f"data.data_dir={data_dir}", f"paths.cache_dir={cache_dir}", f"hydra.run.dir={out}"]
    return [sys.executable, str(ROOT / "train.py"), *TINY_OVERRIDES, *paths, *extra]


def run_train(
    data_dir: Path, cache_dir: Path, out: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run :func:`train_cmd` to the end (this module's callbacks allowed as targets); output captured."""
    full_env = {
        **os.environ,
        "ADLS_EXTRA_TARGETS": f"{__name__}.*",
        "PYTHONPATH": str(ROOT),
        "WANDB_MODE": "offline",
        **(env or {}),
    }
    return subprocess.run(
        train_cmd(data_dir, cache_dir, out, *extra),
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def batches_file(out: Path) -> Path:
    """Where :func:`recording` makes a run in ``out`` write its batches (beside the run folder, not in it)."""
    return out.parent / f"{out.name}-batches.jsonl"


def recording(out: Path) -> list[str]:
    """Overrides adding :class:`RecordBatches` to a run in ``out``."""
    return [
        f"+callbacks.record._target_={__name__}.RecordBatches",
        f"+callbacks.record.path={batches_file(out)}",
    ]


def recorded_batches(out: Path) -> dict[int, list[int]]:
    """Step -> row fingerprints; a step trained twice (before the kill and again after) keeps its last record."""
    lines = batches_file(out).read_text().splitlines()
    return {rec["step"]: rec["rows"] for rec in map(json.loads, lines)}


def kill_and_resume(
    data_dir: Path,
    cache_dir: Path,
    base: Path,
    overrides: list[str],
    kill_at_step: int,
    *,
    uninterrupted: bool = True,
    on_killed: Callable[[Path], None] | None = None,
) -> dict[str, Path | str | int]:
    """Train ``overrides`` in ``base/killed``, killed before ``kill_at_step``, then resume it with ``ckpt_path=last``.

    With ``uninterrupted`` the same run trains whole in ``base/whole`` meanwhile (side by side with the run to be
    killed). Both record their batches (:func:`recorded_batches`). ``on_killed(folder)`` sees the killed run's
    folder before the resume.

    Returns:
        ``{"killed": folder, "whole": folder (with uninterrupted), "resumed_stderr": ..., "resumed_from_step":
        the global step of the last.ckpt the resume started from}``.
    """
    killed = base / "killed"
    kill = [f"+callbacks.kill._target_={__name__}.KillAtStep", f"+callbacks.kill.step={kill_at_step}"]
    runs = {"killed": (killed, [*overrides, *recording(killed), *kill])}
    if uninterrupted:
        runs["whole"] = (base / "whole", [*overrides, *recording(base / "whole")])
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {
            name: pool.submit(run_train, data_dir, cache_dir, out, *args)
            for name, (out, args) in runs.items()
        }
        results = {name: future.result() for name, future in futures.items()}
    if uninterrupted:
        assert results["whole"].returncode == 0, results["whole"].stderr[-3000:]
    assert results["killed"].returncode == KILLED_EXIT, results["killed"].stderr[-3000:]
    assert not (killed / "metrics.json").exists()
    last = killed / "checkpoints" / "last.ckpt"
    resumed_from = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    if on_killed is not None:
        on_killed(killed)
    resumed = run_train(data_dir, cache_dir, killed, *overrides, *recording(killed), "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out: dict[str, Path | str | int] = {
        "killed": killed,
        "resumed_stderr": resumed.stderr,
        "resumed_from_step": resumed_from,
    }
    if uninterrupted:
        out["whole"] = base / "whole"
    return out


def assert_one_line_error(
    proc: subprocess.CompletedProcess, starts: str = "error: ", contains: str = ""
) -> str:
    """Bad input's promise: exit code 2, stderr's last line ``error: ...`` (starting with ``starts``, holding
    ``contains``), no traceback anywhere. Returns that line."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and lines[-1].startswith(starts), proc.stderr[-3000:]
    assert contains in lines[-1], lines[-1]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]
