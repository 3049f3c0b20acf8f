"""A tool's earlier outputs under ``overwrite=true``: set aside in a hidden folder beside them while the new run
writes its own, deleted once it has succeeded, and put back in place of the new run's files when it fails (an
error, a refusal, Ctrl-C). The folder then never mixes two runs' files, and a failed run never costs the outputs it
was meant to replace. Files the tool does not write (the user's own) stay where they are.

``adls-export`` (:mod:`adls_lightning.export.from_checkpoint`) and ``python -m adls_lightning.graph``
(:mod:`adls_lightning.tools.graph`) use it. Imports neither torch nor Lightning.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


def set_aside(earlier: Sequence[Path], kept: Path) -> None:
    """Move the files ``earlier`` into ``kept``, a folder made here for them (an existing one is an error: it holds
    the files of a run that was killed before it could put them back). All or none: interrupted part-way (Ctrl-C),
    the files already moved go back and ``kept`` is removed before the interrupt goes on."""
    kept.mkdir()
    moved: list[Path] = []
    try:
        for path in earlier:
            path.replace(kept / path.name)
            moved.append(path)
    except BaseException:
        for path in moved:
            (kept / path.name).replace(path)
        kept.rmdir()
        raise


@contextlib.contextmanager
def earlier_outputs_kept_until_done(
    out: Path,
    kept_name: str,
    outputs: Callable[[Path], Sequence[Path]],
    *,
    restored_line: Callable[[int], str] | None = None,
    discard_on_failure: bool = False,
    interrupts: Sequence[int] = (),
) -> Iterator[None]:
    """Around a run writing into ``out``: the earlier outputs it set aside in ``out/kept_name``
    (:func:`set_aside`) are deleted when the block succeeds, and put back, in place of the files of ``out`` that
    ``outputs`` names (the run's own by then), when the block fails; ``restored_line(count)`` is then printed on
    stderr (not for an interrupt: the caller's one line says it).

    ``discard_on_failure``: a failed run's outputs are deleted even when nothing was set aside, and the folders it
    created, for a tool whose partial outputs are of no use (without it they stay, as a failed export's marked
    folder does). ``interrupts``: Ctrl-C as :func:`adls_lightning.app.cli.noting_interrupts` notes it; an
    interrupted run's outputs are discarded so. Outputs that were there before the run and were not set aside (an
    interrupt before :func:`set_aside` finished) are never deleted.
    """
    created = [folder for folder in (out, *out.parents) if not folder.exists()]  # deepest first
    before = {path.name for path in outputs(out)}
    kept = out / kept_name
    existed = kept.exists()  # not this run's: the tools refuse to go on with one
    try:
        yield
        if interrupts:
            # a Ctrl-C that Python reported and dropped ("Exception ignored in" a callback: matplotlib's clean-up
            # during savefig) let the block finish: interrupted all the same, as the user asked
            raise KeyboardInterrupt
    except BaseException:
        set_aside_here = kept.is_dir() and not existed
        discard = discard_on_failure or bool(interrupts)
        if set_aside_here or discard:
            for path in outputs(out):
                if set_aside_here or path.name not in before:
                    path.unlink()
        if set_aside_here:
            restored = sorted(kept.iterdir())
            for path in restored:
                path.replace(out / path.name)
            kept.rmdir()
            if restored_line is not None and not interrupts:
                print(restored_line(len(restored)), file=sys.stderr)
        if discard:
            for folder in created:
                with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                    folder.rmdir()
        raise
    if kept.is_dir() and not existed:
        shutil.rmtree(kept)


def removed_lines(removed: Sequence[str], whose: str) -> list[str]:
    """What ``overwrite=true`` removed, said in one line (none when nothing was); ``whose`` names the earlier run
    (``export``: "removed the earlier export's 3 files (...)")."""
    if not removed:
        return []
    shown = ", ".join(removed[:6]) + (f" and {len(removed) - 6} more" if len(removed) > 6 else "")
    return [f"overwrite=true: removed the earlier {whose}'s {len(removed)} files ({shown})"]
