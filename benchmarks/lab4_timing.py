"""Timing shared by the Lab 4 commands: warm-up kept apart, CUDA timed with events, median and spread of repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch


class Timing(NamedTuple):
    first_s: float  # the first call: compilation (for a compiled callable) plus one run
    median_s: float
    low_s: float  # 25th percentile of the timed repeats
    high_s: float  # 75th percentile
    repeats: int

    def spread(self) -> str:
        return f"[{1e3 * self.low_s:.1f}, {1e3 * self.high_s:.1f}] ms"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, repeats: int = 10, warmup: int = 2) -> Timing:
    """Time ``fn()`` (inputs prepared by the caller, outside the timed region).

    The first call is timed on its own (it includes compilation), then ``warmup`` untimed calls, then
    ``repeats`` timed ones: with CUDA events after a synchronisation on CUDA, ``perf_counter`` on CPU.
    """
    _synchronize(device)
    start = time.perf_counter()
    fn()
    _synchronize(device)
    first = time.perf_counter() - start
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _synchronize(device)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    quartiles = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return Timing(first, statistics.median(samples), quartiles[0], quartiles[2], len(samples))


def machine_line() -> str:
    """What the numbers were measured on (the limit they are subject to)."""
    if torch.cuda.is_available():
        return (
            f"device: {torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), torch {torch.__version__}"
        )
    return f"device: CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def save_figure(fig, title: str, path: Path) -> None:
    """Title the figure with the machine it was measured on, and write it."""
    fig.suptitle(f"{title} ({machine_line()})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
