"""Progress as lines of text, for a console that is not a terminal (``nohup``, CI, a SLURM job's output file),
where a redrawn bar shows nothing until it closes: :class:`StageClock` times one stage (an epoch of training, a
validation, a test) and says when the next line is due; :func:`progress_line` writes it; :func:`trial_line` is
the one line of a finished search trial. ``adls_lightning/callbacks/progress.py`` is the Lightning glue.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` (``m:ss`` under an hour); ``?`` for an unknown (infinite or NaN) duration."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """``name value`` pairs, floats to 4 significant digits (``train/loss 0.6931 val/acc 0.5``)."""
    shown = []
    for name, value in metrics.items():
        if hasattr(value, "item"):
            value = value.item()
        shown.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
    return " ".join(shown)


@dataclass
class StageClock:
    """Counts the batches and samples of one stage and times it.

    Attributes:
        stage: ``train``, ``val`` or ``test``.
        total: batches in the stage (None or infinite: unknown, no ETA).
        interval_s: seconds between two progress lines.
        clock: the time source (``time.monotonic``; tests pass their own).
    """

    stage: str
    total: float | None
    interval_s: float
    clock: Callable[[], float] = time.monotonic
    batches: int = 0
    samples: int = 0
    started: float = field(init=False)
    last_line: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.last_line = self.clock()

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    def advance(self, samples: int) -> bool:
        """Count one batch of ``samples``; whether a progress line is due (``interval_s`` since the last one)."""
        self.batches += 1
        self.samples += samples
        return self.due()

    def due(self) -> bool:
        """Whether a line is due without a new batch (a step longer than the interval); marks it written."""
        now = self.clock()
        if now - self.last_line >= self.interval_s:
            self.last_line = now
            return True
        return False

    def eta(self) -> float:
        """Seconds left in the stage at the rate so far (NaN when unknown)."""
        if not self.total or not math.isfinite(self.total) or not self.batches:
            return math.nan
        return self.elapsed / self.batches * max(self.total - self.batches, 0)


class Heartbeat:
    """A daemon thread calling ``beat()`` every ``period_s`` until :meth:`stop`: progress lines stay on time while
    one step takes longer than the interval (a loaded CPU, a first compiled step, a slow data loader)."""

    def __init__(self, period_s: float, beat: Callable[[], None]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s, beat), daemon=True, name="progress")
        self._thread.start()

    def _run(self, period_s: float, beat: Callable[[], None]) -> None:
        while not self._stop.wait(period_s):
            beat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def progress_line(clock: StageClock, epoch: str = "", metrics: Mapping[str, Any] | None = None) -> str:
    """``train epoch 1/3 step 40/125 (32%) | train/loss 0.41 | 21.3 samples/s | elapsed 0:31 ETA 1:06``."""
    known = clock.total is not None and math.isfinite(clock.total) and clock.total > 0
    total = int(clock.total) if known else "?"
    percent = f" ({100 * clock.batches / clock.total:.0f}%)" if known else ""
    parts = [f"{clock.stage}{' epoch ' + epoch if epoch else ''} step {clock.batches}/{total}{percent}"]
    if metrics:
        parts.append(format_metrics(metrics))
    elapsed = clock.elapsed
    rate = clock.samples / elapsed if elapsed > 0 else math.nan
    parts.append(f"{rate:.1f} samples/s")
    parts.append(f"elapsed {format_duration(elapsed)} ETA {format_duration(clock.eta())}")
    return " | ".join(parts)


def trial_line(
    number: int,
    values: Sequence[float],
    params: Mapping[str, Any],
    names: Sequence[str],
    best: Sequence[tuple[int, Sequence[float]]],
) -> str:
    """One finished search trial: its number, values, params, and the best trial(s) so far.

    ``best`` is the study's best trials after this one (one for a single objective, the Pareto front otherwise).
    """

    def values_of(vals: Sequence[float]) -> str:
        return ", ".join(f"{name}={value:.4f}" for name, value in zip(names, vals))

    shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
    if len(best) == 1:
        so_far = f"best so far: trial {best[0][0]} ({values_of(best[0][1])})"
    else:
        so_far = f"Pareto front so far: trials {', '.join(str(n) for n, _ in best) or 'none'}"
    return f"Trial {number} finished: {values_of(values)} | {shown or 'no params'} | {so_far}"
