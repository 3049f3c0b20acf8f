"""overwrite=true's set-aside of a tool's earlier outputs (adls_lightning.files.earlier_outputs): never a lost file,
even when Ctrl-C lands while the earlier files are being moved."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from adls_lightning.files.earlier_outputs import earlier_outputs_kept_until_done, set_aside


def outputs(out: Path) -> list[Path]:
    return sorted(p for p in out.glob("*.txt")) if out.is_dir() else []


def earlier_run(out: Path) -> dict[str, str]:
    out.mkdir(parents=True)
    files = {f"{name}.txt": f"earlier {name}" for name in "abc"}
    for name, text in files.items():
        (out / name).write_text(text)
    return files


def contents(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in out.iterdir()}


def test_set_aside_interrupted_part_way_puts_back_what_it_moved(tmp_path, monkeypatch):
    out = tmp_path / "out"
    files = earlier_run(out)
    real_replace = Path.replace
    calls = []

    def replace_then_interrupt(self, target):
        calls.append(self.name)
        if len(calls) == 2:  # the second file: Ctrl-C between two moves
            raise KeyboardInterrupt
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        set_aside(outputs(out), out / ".kept")
    monkeypatch.setattr(Path, "replace", real_replace)
    assert contents(out) == files  # the first file came back; no .kept folder left


def test_an_interrupt_before_the_set_aside_deletes_only_this_runs_files(tmp_path):
    out = tmp_path / "out"
    files = earlier_run(out)
    with (
        pytest.raises(KeyboardInterrupt),
        earlier_outputs_kept_until_done(out, ".kept", outputs, interrupts=[signal.SIGINT]),
    ):
        (out / "d.txt").write_text("this run's")
        raise KeyboardInterrupt
    assert contents(out) == files


# "dropped": a Ctrl-C noted but swallowed on its way (Python prints "Exception ignored in" for one raised in a
# callback, as matplotlib's clean-up during savefig) lets the block finish: the run is undone all the same, and the
# caller sees the interrupt
@pytest.mark.parametrize("reaches_the_block", [True, False], ids=["raised", "dropped"])
def test_an_interrupt_after_the_set_aside_restores_the_earlier_run_and_removes_new_folders(
    tmp_path, reaches_the_block
):
    def interrupted() -> None:
        if reaches_the_block:
            raise KeyboardInterrupt

    out = tmp_path / "out"
    files = earlier_run(out)
    with (
        pytest.raises(KeyboardInterrupt),
        earlier_outputs_kept_until_done(out, ".kept", outputs, interrupts=[signal.SIGINT]),
    ):
        set_aside(outputs(out), out / ".kept")
        (out / "a.txt").write_text("this run's a")
        interrupted()
    assert contents(out) == files
    fresh = tmp_path / "new" / "out"
    with (
        pytest.raises(KeyboardInterrupt),
        earlier_outputs_kept_until_done(fresh, ".kept", outputs, interrupts=[signal.SIGINT]),
    ):
        fresh.mkdir(parents=True)
        (fresh / "a.txt").write_text("this run's a")
        interrupted()
    assert not (tmp_path / "new").exists()
