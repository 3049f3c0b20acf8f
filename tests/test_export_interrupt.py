"""Ctrl-C during ``adls-export``: one ``interrupted: ...`` line, exit code 130 (as ``train.py`` and the graph tool),
and ``out=`` as it was before the export: no half-written folder to be taken for a whole one, and under
``overwrite=true`` the earlier export's files back, byte for byte."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from adls_lightning.tools.export import main
from tests.helpers import ENV, ROOT, TINY, call, trained_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"
    trained_checkpoint(path, TINY)
    return path


def interrupted_export(ready: Callable[[], bool], *args: str) -> subprocess.CompletedProcess:
    """``adls-export ARGS``, sent SIGINT (a terminal's Ctrl-C) as soon as ``ready()`` holds: in the middle of it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "adls_lightning.export", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=ENV,
        # SIGINT's default action, as from a terminal: pytest-xdist's workers ignore it, and a child inherits that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 600
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, stderr = proc.communicate()
            pytest.fail(f"the export ended (or hung) before the moment to interrupt it: {stderr[-3000:]}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _files(folder: Path) -> dict[str, bytes]:
    """Every entry of ``folder`` (hidden ones too) with its bytes."""
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def test_ctrl_c_leaves_no_half_written_out(tiny_ckpt, tmp_path):
    """Ctrl-C once the folder's first files are written (the self-check still to run): no out= folder, nor the
    folder above it that the export created."""
    out = tmp_path / "new" / "out"
    result = interrupted_export(
        lambda: (out / "config.json").exists(), f"ckpt={tiny_ckpt}", f"out={out}", "format=hf", *TINY
    )
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"interrupted: out={out} is as it was before this export; run the command again"
    ]
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_under_overwrite_puts_the_earlier_export_back(tiny_ckpt, tmp_path):
    """Ctrl-C while overwrite=true writes the new export (the earlier one's files set aside): they are all back,
    byte for byte, with the user's file, and none of the interrupted export's is left."""
    out = tmp_path / "out"
    code, _, stderr = call(main, f"ckpt={tiny_ckpt}", f"out={out}", "format=mxint8", "check=none", *TINY)
    assert code == 0, stderr[-3000:]
    (out / "notes.txt").write_text("mine\n")
    earlier = _files(out)
    result = interrupted_export(
        # the earlier config.json set aside, and this export's written in its place
        lambda: (out / ".earlier-export" / "config.json").exists() and (out / "config.json").exists(),
        f"ckpt={tiny_ckpt}",
        f"out={out}",
        "format=hf",
        "overwrite=true",
        *TINY,
    )
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"interrupted: out={out} is as it was before this export; run the command again"
    ]
    assert _files(out) == earlier
