"""The report of a Hydra multirun of ``train.py``: its jobs (:func:`read_jobs`: overrides and metrics) and the page of
them (:func:`sweep_page`: a sortable table, the main metric against each swept parameter). The command is
``python -m adls_lightning.reports.sweep`` (:mod:`adls_lightning.tools.report`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from adls_lightning.errors import ConfigError
from adls_lightning.reports.page import Page
from adls_lightning.reports.table import check_one_task, run_task
from adls_lightning.runs.record import METRICS_FILE

RECORD = Path(".hydra")
#: the command that writes the page (named in it: a redraw recognises its own earlier page)
COMMAND = "adls_lightning.reports.sweep"


@dataclass(frozen=True)
class Job:
    """One job of a multirun: its folder, overrides (key -> value as written), metrics (empty: none) and task
    (None: no saved config)."""

    folder: Path
    overrides: dict[str, str]
    metrics: dict[str, Any]
    optimized_metric: str | None
    task: str | None = None


def _optimized_metric(config_file: Path) -> str | None:
    """The job's ``optimized_metric``, resolved: Hydra saves the config unresolved (``${main_metric}``)."""
    if not config_file.is_file():
        return None
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.select(OmegaConf.load(config_file), "optimized_metric", default=None)
    except OmegaConfBaseException:  # an interpolation this process cannot resolve: fall back to the default
        return None


def _read(path: Path, parse: Any, kind: type) -> Any:
    """``parse`` of the file's text (None for an empty record), refused in one line naming the file when it is
    damaged (cut, not text) or not a ``kind``."""
    try:
        data = parse(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as error:
        first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise ConfigError(f"sweep: {path}: damaged ({first}); remove the job's folder or re-run it") from None
    if data is not None and not isinstance(data, kind):
        raise ConfigError(
            f"sweep: {path}: a {type(data).__name__}, expected a {kind.__name__} (a damaged file)"
        )
    return data


def read_jobs(sweep: Path) -> list[Job]:
    """The jobs under ``sweep`` (any depth), in folder order (Hydra's job numbers sort numerically).

    Raises:
        ConfigError: ``sweep`` is not a folder, holds no job, or holds jobs of different tasks (one metric is not
            comparable across them; ``adls-table`` refuses them alike).
    """
    if not sweep.is_dir():
        raise ConfigError(
            f"sweep={sweep}: not a folder (give a multirun folder, e.g. outputs/train/multiruns/DATE)"
        )
    jobs = []
    for record in sweep.rglob(str(RECORD / "overrides.yaml")):
        folder = record.parent.parent
        overrides = {}
        for line in _read(record, yaml.safe_load, list) or []:
            key, _, value = str(line).partition("=")
            overrides[key.lstrip("+~")] = value
        metrics_file = folder / METRICS_FILE
        metrics = _read(metrics_file, json.loads, dict) if metrics_file.is_file() else {}
        config_file = folder / RECORD / "config.yaml"
        config = _read(config_file, yaml.safe_load, dict) if config_file.is_file() else None
        task = run_task(config or {})[0] if config is not None else None
        jobs.append(Job(folder, overrides, metrics, _optimized_metric(config_file), task))
    if not jobs:
        raise ConfigError(f"sweep={sweep}: no job folder with a run record (.hydra/overrides.yaml) under it")
    jobs.sort(key=lambda j: [int(p) if p.isdigit() else p for p in j.folder.relative_to(sweep).parts])
    check_one_task([(job.folder, job.task) for job in jobs if job.task is not None])
    return jobs


def swept_keys(jobs: Sequence[Job]) -> list[str]:
    """The override keys whose value differs between jobs (or that some jobs do not set)."""
    keys = sorted({k for j in jobs for k in j.overrides})
    return [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]


def as_number(text: str | None) -> float | str | None:
    """An override's value as a number when it is one (for the figure's axis), else the text."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return text


def metric_figure(jobs: Sequence[Job], key: str, metric: str) -> Any:
    """``metric`` against the swept ``key``, one point per job (hover: the job's folder)."""
    import plotly.graph_objects as go

    points = [
        (as_number(j.overrides.get(key)), j.metrics[metric], j.folder.name)
        for j in jobs
        if metric in j.metrics
    ]
    numeric = all(isinstance(x, float) for x, _, _ in points)
    points.sort(key=lambda p: p[0] if numeric else str(p[0]))
    figure = go.Figure(
        go.Scatter(
            x=[x if numeric else str(x) for x, _, _ in points],
            y=[y for _, y, _ in points],
            text=[name for _, _, name in points],
            mode="markers+lines" if numeric else "markers",
            marker={"size": 10},
            hovertemplate=f"{key}=%{{x}}<br>{metric}=%{{y}}<br>job %{{text}}<extra></extra>",
        )
    )
    values = sorted({x for x, _, _ in points if isinstance(x, float) and x > 0})
    # learning rates, widths, sizes: a sweep over several orders of magnitude reads on a log axis
    log_x = numeric and len(values) == len(points) and len(values) > 2 and values[-1] / values[0] >= 100
    figure.update_layout(
        title=f"{metric} vs {key}",
        xaxis={"title": key, "type": "log" if log_x else None},
        yaxis={"title": metric},
        height=420,
    )
    return figure


def sweep_page(sweep: Path, jobs: Sequence[Job], metric: str | None) -> Page:
    """The page of the sweep's ``jobs``, drawing ``metric`` (None: the jobs' ``optimized_metric``).

    Raises:
        ConfigError: ``metric`` is in no finished job's metrics (naming those they have); with no job finished
            yet, any metric is drawn once one is.
    """
    finished = [j for j in jobs if j.metrics]
    recorded = sorted({m for j in finished for m in j.metrics})
    if metric is not None and finished and metric not in recorded:
        raise ConfigError(f"metric={metric}: no job of the sweep has it; valid: {', '.join(recorded)}")
    metric = metric or next((j.optimized_metric for j in jobs if j.optimized_metric), None) or "val/acc"
    swept = swept_keys(jobs)
    page = Page(f"Sweep {sweep.name}", COMMAND)
    page.facts(
        {
            "folder": str(sweep),
            "jobs": f"{len(jobs)} ({len(finished)} with metrics)",
            "swept": ", ".join(swept) or "nothing (every job has the same overrides)",
            "main metric": metric,
        }
    )
    if not any(metric in j.metrics for j in jobs):
        page.paragraph(f"No job has {metric} in its metrics: nothing to draw.")
    else:
        for key in swept:
            page.heading(f"{metric} vs {key}")
            page.figure(metric_figure(jobs, key, metric))
    fixed = {k: v for k, v in jobs[0].overrides.items() if k not in swept}
    if fixed:
        page.heading("Common overrides")
        page.code(" ".join(f"{k}={v}" for k, v in fixed.items()))
    names = sorted(recorded, key=lambda m: (m != metric, m))
    rows = [
        [str(j.folder.relative_to(sweep)), *(as_number(j.overrides.get(k)) for k in swept)]
        + [j.metrics.get(m) for m in names]
        for j in jobs
    ]
    page.heading(f"Jobs ({len(jobs)})")
    page.table(["job", *swept, *names], rows, table_id="jobs")
    return page


if __name__ == "__main__":  # `python -m adls_lightning.reports.sweep`, the spelling the docs use
    from adls_lightning.tools.report import main

    main()
