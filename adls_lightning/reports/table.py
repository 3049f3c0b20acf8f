"""One results table for any runs (:func:`results_table`: the runs found, one row per configuration, mean ± std
over its seeds; markdown, CSV and a figure). The command is ``adls-table`` / ``python -m adls_lightning.reports.table``
(:mod:`adls_lightning.tools.results_table`, where the table's rows and columns are described).
"""

from __future__ import annotations

import csv
import glob
import io
import json
import math
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from adls_lightning.errors import ConfigError
from adls_lightning.reports.output import check_report_folder
from adls_lightning.runs.folder import check_writable
from adls_lightning.runs.record import (
    METRICS_FILE,
    PRECISION_KEY,
    read_run_config,
    read_run_data,
    read_run_record,
)

USAGE = "adls-table RUN_OR_GLOB... [out=DIR]  (or python -m adls_lightning.reports.table RUN_OR_GLOB... [out=DIR])"
OUTPUTS = ("table.md", "table.csv", "table.png")
OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
# Hydra's own record of the run: its ``hydra.runtime.choices`` name the config group options the run composed.
HYDRA_FILE = Path(".hydra") / "hydra.yaml"
# What a row shows for a key its runs never had (an uncompiled run's ``compile.backend``).
UNSET = "none"
# The sweeper's way to find a trial again (adls_lightning.reports.study.TRIAL_IDENTITY): not what the trial trained.
TRIAL_IDENTITY = "search.trial."
MISSING = "–"
# What a run reports besides its task's metrics, shown where some run has it: key -> (heading, format).
EXTRAS = {
    "params/trainable": ("trainable params", "params"),
    "params/total": ("total params", "params"),
    "quant/avg_weight_bits": ("bits/weight", ".2f"),
    "prune/weight_sparsity": ("weight sparsity", ".3f"),
    "quant/weight_bytes": ("size (MB)", "mb"),
    "mxint8/model_bytes_packed": ("packed size (MB)", "mb"),
}
# ... and the text values a run records, shown where some run has them: key -> heading. A row's cell holds each value
# its runs recorded (a run recorded before the key existed adds nothing; a cell of such runs only is blank).
TEXT_EXTRAS = {PRECISION_KEY: "precision"}


@dataclass(frozen=True)
class Run:
    """One run: its folder, its overrides (``key -> value``, per-seed keys left out) and its metrics; a job folder
    with a run record and no ``metrics.json`` (failed, killed or still running) is a run that did not finish."""

    path: Path
    overrides: dict[str, str]
    metrics: dict[str, Any]
    task: str
    main_metric: str
    data: str  # what the run read (adls_lightning.data.sources.data_read): the footer's provenance
    seed: str = (
        ""  # its per-seed settings ("seed=1"): runs of one row with the same seed are not seed samples
    )
    finished: bool = True
    config: dict[str, Any] = field(default_factory=dict)  # its saved .hydra/config.yaml
    choices: dict[str, Any] = field(default_factory=dict)  # its config groups' options (HYDRA_FILE)
    # the data it read by content (runs.record.read_run_data); None: recorded before runs recorded it
    data_identity: str | None = None


@dataclass(frozen=True)
class Cell:
    """One column of one row: the numbers averaged, the runs left out (``(run, why)``), the row's run count."""

    numbers: tuple[float, ...]
    left_out: tuple[tuple[Path, str], ...]
    runs: int

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.numbers) if self.numbers else None

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.numbers) if len(self.numbers) > 1 else None


@dataclass(frozen=True)
class Table:
    """Rows (configurations, in the order their first run was found) by columns (metric keys)."""

    keys: list[str]  # the overrides that differ between the runs: one heading each
    shared: list[str]  # the overrides every run has alike
    rows: list[tuple[dict[str, str], list[Run]]]
    columns: list[str]
    main: str  # the main metric's column
    texts: list[str]  # the TEXT_EXTRAS columns, after the metrics
    task: str
    data: list[str]  # what the runs read, each source once

    def cell(self, runs: Sequence[Run], column: str) -> Cell:
        """The column's numbers over the row's finished runs (a run that did not finish is the row's footnote)."""
        runs = [run for run in runs if run.finished]
        numbers, left_out = [], []
        for run in runs:
            value = run.metrics.get(column)
            if _number(value) is not None:
                numbers.append(float(value))
            elif column in run.metrics:
                left_out.append((run.path, f"has {column} = {value}"))
            elif any(
                column in r.metrics for r in runs
            ):  # absent from every run of a row: not this row's metric
                left_out.append((run.path, f"has no {column}"))
        return Cell(tuple(numbers), tuple(left_out), len(runs))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _natural(path: Path) -> list[Any]:
    """Sort key that puts job 10 after job 9."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def find_runs(sources: Sequence[str], search_dir: Path | None = None) -> list[Path]:
    """The run folders of each source, in order, each once (two spellings of one folder, relative, absolute or
    through a symlink, are one run); see the module docstring. A run folder holds ``metrics.json``; below a folder
    given, a job folder with a run record (``.hydra/overrides.yaml``) and no ``metrics.json`` is found too (a job
    that failed or has not finished: the table names it).

    Raises:
        ConfigError: naming the source that matches no run folder (or the study that cannot be read).
    """
    folders: list[Path] = []
    for source in sources:
        path = Path(source).expanduser()
        if glob.has_magic(source):
            matches = sorted(map(Path, glob.glob(str(path), recursive=True)), key=_natural)
            found = [run for match in matches if match.is_dir() for run in _runs_under(match)]
            found += [match.parent for match in matches if match.name == METRICS_FILE]
        elif path.is_dir():
            found = _runs_under(path)
        elif path.name == METRICS_FILE and path.is_file():
            found = [path.parent]
        elif path.is_file() or "://" in source or "/" not in source:
            found = _study_runs(source, search_dir)
        else:
            raise ConfigError(f"{source}: no such run folder, glob or study")
        if not any((folder / METRICS_FILE).is_file() for folder in found):
            raise ConfigError(f"{source}: no run found (no {METRICS_FILE} in or below it)")
        folders += found
    unique: dict[Path, Path] = {}
    for folder in folders:
        unique.setdefault(folder.resolve(), folder)  # the first spelling names it
    return list(unique.values())


def _runs_under(folder: Path) -> list[Path]:
    """The run folders in or below ``folder``: those with ``metrics.json`` and the job folders with a run record
    and none."""
    finished = {p.parent for p in folder.rglob(METRICS_FILE)}
    unfinished = {p.parent.parent for p in folder.rglob(str(OVERRIDES_FILE))} - finished
    return sorted(finished | unfinished, key=_natural)


def _study_runs(source: str, search_dir: Path | None) -> list[Path]:
    """The folders the study's trials recorded (``output_dir``) that still hold a run; a trial whose folder is
    gone is named on stderr."""
    from adls_lightning.reports.study import load_study  # optuna: only for a study

    study, _ = load_study(source, search_dir=search_dir)
    folders = []
    for trial in study.get_trials(deepcopy=False):
        recorded = trial.user_attrs.get("output_dir")
        if recorded and (Path(recorded) / METRICS_FILE).is_file():
            folders.append(Path(recorded))
        else:  # a trial pruned or failed before its job started records no folder
            missing = f"no {METRICS_FILE} in {recorded}" if recorded else "no run folder recorded"
            print(
                f"skipping trial {trial.number} of {source} ({trial.state.name.lower()}): {missing}",
                file=sys.stderr,
            )
    return folders


def read_run(folder: Path) -> Run:
    """The run of ``folder``: metrics, overrides (per-seed keys left out), task and main metric; without
    ``metrics.json``, a run that did not finish (no metrics).

    Raises:
        ConfigError: a damaged ``metrics.json``, config or overrides record, or no overrides record (the run's
            configuration is then unknown), naming the file.
    """
    finished = (folder / METRICS_FILE).is_file()
    try:
        metrics, config = read_run_record(folder) if finished else ({}, read_run_config(folder))
        identity = read_run_data(folder)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    record = folder / OVERRIDES_FILE
    if not record.is_file():
        raise ConfigError(
            f"{record}: missing (the run's overrides; without them its configuration is unknown)"
        )
    try:
        overrides = yaml.safe_load(record.read_text()) or []
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"{record}: not readable YAML ({' '.join(str(error).split())})") from None
    if not isinstance(overrides, list):
        raise ConfigError(f"{record}: not a list of overrides (holds {type(overrides).__name__})")
    task, main = run_task(config)
    from adls_lightning.data.sources import data_read  # the data libraries: only once a run is read

    data = data_read(config.get("data") or {})
    seed, choices = _seed(overrides, config), _choices(folder)
    configuration = _configuration(overrides)
    return Run(folder, configuration, metrics, task, main, data, seed, finished, config, choices, identity)


def _choices(folder: Path) -> dict[str, Any]:
    """The config group options a run composed (``compile: none``, ``model/lora: default``), from Hydra's record;
    ``{}`` when it has none.

    Raises:
        ConfigError: the record is damaged, naming the file.
    """
    record = folder / HYDRA_FILE
    if not record.is_file():
        return {}
    try:
        hydra = (yaml.safe_load(record.read_text()) or {}).get("hydra") or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError) as error:
        raise ConfigError(f"{record}: not readable YAML ({' '.join(str(error).split())})") from None
    choices = (hydra.get("runtime") or {}).get("choices") if isinstance(hydra, dict) else None
    return choices if isinstance(choices, dict) else {}


def recorded_setting(run: Run, key: str) -> str:
    """What ``run``, which did not override ``key``, ran with: the config group option it composed (``compile``:
    ``none``), else the value its saved config holds (``compile.backend``: ``inductor``), else :data:`UNSET` (an
    uncompiled run has no ``compile.backend``)."""
    name = key.lstrip("+~")
    if run.choices.get(name) is not None:
        return str(run.choices[name])
    value: Any = run.config
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return UNSET
        value = value[part]
    if value is None or isinstance(value, bool):
        return json.dumps(value)  # null, true, false: as an override spells them
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":")) if value else UNSET
    return str(value)


def run_task(config: dict[str, Any]) -> tuple[str, str]:
    """(task, main metric) of a run's saved config (``.hydra/config.yaml``): what its table or page compares."""
    data = config.get("data") or {}
    task = str(data.get("task") or data.get("hub_name") or data.get("_target_") or "unknown")
    main = data.get("main_metric")
    if not isinstance(main, str) or main.startswith(
        "${"
    ):  # GLUE's comes from its task, unresolved in the record
        from adls_lightning.data.tasks import task_main_metric

        main = task_main_metric(task) if data.get("task") else "acc"
    return task, main


def check_one_task(runs: Sequence[tuple[Path, str]]) -> None:
    """Refuse ``(folder, task)`` pairs of more than one task: one metric is not comparable across tasks.

    Raises:
        ConfigError: naming the first run and the first run of another task.
    """
    first, first_task = runs[0] if runs else (None, None)
    for path, task in runs:
        if task != first_task:
            raise ConfigError(
                f"runs of different tasks: {first} is {first_task}, {path} is {task}; give the runs of one task"
            )


def check_same_data(runs: Sequence[Run]) -> None:
    """Refuse a row whose finished runs recorded reading different data (files replaced between two seeds): their
    mean would be over data sets, not seeds. Runs that recorded none (before the record existed) are not compared.

    Raises:
        ConfigError: naming two such runs and the data each read.
    """
    recorded = [run for run in runs if run.finished and run.data_identity is not None]
    for run in recorded[1:]:
        first = recorded[0]
        if run.data_identity != first.data_identity:
            raise ConfigError(
                f"{first.path}, {run.path}: runs of one configuration read different data ({first.data}: "
                f"{first.data_identity}; {run.data}: {run.data_identity}); give the runs on one data set"
            )


def _is_per_seed(name: str) -> bool:
    return name == "seed" or name.endswith(".seed")


def _configuration(overrides: list[Any]) -> dict[str, str]:
    """``key -> value`` of the overrides, without the per-seed keys and a search trial's identity."""
    kept = {}
    for override in map(str, overrides):
        key, _, value = override.partition("=")
        name = key.lstrip("+~")
        if _is_per_seed(name) or name.startswith(TRIAL_IDENTITY):
            continue
        kept[key] = value
    return kept


def _seed(overrides: list[Any], config: dict[str, Any]) -> str:
    """The run's per-seed settings (``seed=1``, and any ``*.seed`` overridden): the seed its row's spread is over."""
    settings = {"seed": str(config["seed"])} if "seed" in config else {}
    for override in map(str, overrides):
        key, _, value = override.partition("=")
        if _is_per_seed(key.lstrip("+~")):
            settings[key.lstrip("+~")] = value
    return " ".join(f"{key}={value}" for key, value in sorted(settings.items()))


def build_table(runs: Sequence[Run]) -> Table:
    """Group ``runs`` by configuration and choose the columns.

    Raises:
        ConfigError: runs of different tasks, naming one run of each; runs of one row that read different data
            (:func:`check_same_data`).
    """
    first = next(run for run in runs if run.finished)
    check_one_task(
        [(first.path, first.task)] + [(r.path, r.task) for r in runs if r.finished or r.task != "unknown"]
    )
    all_keys = list(dict.fromkeys(k for run in runs for k in run.overrides))
    shared = [k for k in all_keys if len({run.overrides.get(k) for run in runs}) == 1]
    keys = [k for k in all_keys if k not in shared]
    rows: dict[tuple, tuple[dict[str, str], list[Run]]] = {}
    for run in runs:
        label = {k: run.overrides[k] if k in run.overrides else recorded_setting(run, k) for k in keys}
        rows.setdefault(tuple(label.values()), (label, []))[1].append(run)
    for _, row in rows.values():
        check_same_data(row)
    found = {k for run in runs for k in run.metrics}
    columns = []
    for split in ("test", "val"):
        names = sorted(k for k in found if k.startswith(f"{split}/") and k != f"{split}/loss")
        main = f"{split}/{first.main_metric}"
        columns += ([main] if main in names else []) + [k for k in names if k != main]
    columns += [k for k in EXTRAS if k in found]
    main = next((c for c in columns if c.endswith(f"/{first.main_metric}")), columns[0] if columns else "")
    return Table(
        keys,
        [f"{k}={first.overrides[k]}" for k in shared],
        list(rows.values()),
        columns,
        main,
        [k for k in TEXT_EXTRAS if k in found],
        first.task,
        list(dict.fromkeys(run.data for run in runs)),
    )


def text_cell(runs: Sequence[Run], key: str) -> str:
    """The values of ``key`` the row's finished runs recorded, each once, in the order found ("" if none)."""
    return ", ".join(
        dict.fromkeys(str(run.metrics[key]) for run in runs if run.finished and key in run.metrics)
    )


def _show(column: str, value: float) -> str:
    kind = EXTRAS.get(column, ("", ".4f"))[1]
    if kind == "params":
        return f"{value / 1e6:.3g}M"
    if kind == "mb":
        return f"{value / 1e6:.2f}"
    return f"{value:{kind}}"


def markdown(table: Table) -> str:
    """The table, its footnotes (every run left out of a mean), and the overrides every run shares."""
    heads = [*(table.keys or ["configuration"]), "n", *(EXTRAS.get(c, (c,))[0] for c in table.columns)]
    heads += [TEXT_EXTRAS[k] for k in table.texts]
    lines = [f"| {' | '.join(heads)} |", "|---" * len(heads) + "|"]
    notes: list[str] = []
    partial = unfinished = False
    for label, runs in table.rows:
        cells = list(label.values()) or ["all runs"]
        finished = [run for run in runs if run.finished]
        count = str(len(finished)) if len(finished) == len(runs) else f"{len(finished)}/{len(runs)}"
        unfinished = unfinished or len(finished) < len(runs)
        for run in runs:
            if not run.finished:
                notes.append(f"{run.path}: no {METRICS_FILE} (failed or unfinished); left out.")
                count += f" [{len(notes)}]"
        by_seed: dict[str, list[Run]] = {}
        for run in finished:
            by_seed.setdefault(run.seed, []).append(run)
        for seed, same in by_seed.items():
            if len(same) > 1:
                notes.append(
                    f"{', '.join(str(run.path) for run in same)}: the same seed ({seed or 'none recorded'}), "
                    "copies or reruns of one run; counted in n, so the row's std is not a spread over seeds."
                )
                count += f" [{len(notes)}]"
        cells.append(count)
        for column in table.columns:
            cell = table.cell(runs, column)
            refs = ""
            for path, why in cell.left_out:
                notes.append(f"not a number: {path} {why}; left out of the mean.")
                refs += f" [{len(notes)}]"
            if cell.mean is None:
                cells.append(f"{MISSING}{refs}" if refs else "")
                continue
            text = _show(column, cell.mean)
            constant = column in EXTRAS and len(set(cell.numbers)) == 1
            if cell.std is not None and not constant:
                text += f" ± {_show(column, cell.std)}"
            if cell.left_out:
                text += f" ({len(cell.numbers)}/{cell.runs})"
                partial = True
            cells.append(text + refs)
        cells += [text_cell(runs, key) for key in table.texts]
        lines.append(f"| {' | '.join(cells)} |")
    lines += [
        "",
        f"{'; '.join(table.data)}: mean ± std (sample) over the n runs (seeds) of each configuration.",
    ]
    for number, note in enumerate(notes, 1):
        lines.append(f"[{number}] {note}")
    if partial:
        lines.append("(n/N): the mean over the n of the row's N runs with a number.")
    if unfinished:
        lines.append("n as n/N: n of the row's N runs finished (the others are named above and left out).")
    if table.shared:
        lines.append(f"Shared by every run: {' '.join(table.shared)}")
    return "\n".join(lines)


def csv_text(table: Table) -> str:
    """One row per configuration: its override values, n, ``<metric> mean``/``std``/``n`` per column, its runs."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    stats = [f"{c} {s}" for c in table.columns for s in ("mean", "std", "n")]
    writer.writerow([*(table.keys or ["configuration"]), "n", *stats, *table.texts, "runs"])
    for label, runs in table.rows:
        runs = [run for run in runs if run.finished]
        values: list[Any] = [*(label.values() or ["all runs"]), len(runs)]
        for column in table.columns:
            cell = table.cell(runs, column)
            values += [_blank(cell.mean), _blank(cell.std), len(cell.numbers)]
        values += [text_cell(runs, key) for key in table.texts]
        writer.writerow([*values, " ".join(str(run.path) for run in runs)])
    return out.getvalue()


def _blank(value: float | None) -> Any:
    return "" if value is None else value


def figure_png(table: Table) -> bytes:
    """The main metric's mean ± std per configuration, as PNG bytes (drawn before any file is written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, means, stds = [], [], []
    for label, runs in table.rows:
        cell = table.cell(runs, table.main)
        labels.append(" ".join(f"{k}={v}" for k, v in label.items()) or "all runs")
        means.append(math.nan if cell.mean is None else cell.mean)
        stds.append(cell.std or 0.0)
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(labels), 3.8))
    ax.bar(range(len(labels)), means, yerr=stds, capsize=4, color="tab:blue", alpha=0.8)
    rotation = 20 if len(labels) > 3 else 0
    ax.set_xticks(range(len(labels)), labels, rotation=rotation, ha="right" if rotation else "center")
    ax.set_ylabel(f"{table.main} (mean ± std over seeds)")
    ax.set_title(table.task)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    return buffer.getvalue()


def results_table(sources: Sequence[str], out: Path | None = None, search_dir: Path | None = None) -> str:
    """The markdown table of the runs of ``sources``; with ``out``, also ``table.md``, ``table.csv`` and
    ``table.png`` there, written only once all three are ready.

    Raises:
        ConfigError: see the module docstring.
    """
    from adls_lightning.files.atomic import atomic_write_bytes

    if not sources:
        raise ConfigError(f"no runs given (usage: {USAGE})")
    if out is not None:
        check_writable(out, "out")
        check_report_folder(out, "adls-table", OUTPUTS)
    table = build_table([read_run(folder) for folder in find_runs(sources, search_dir)])
    if not table.columns:
        raise ConfigError(f"{table.rows[0][1][0].path / METRICS_FILE}: no test/ or val/ metric in the runs")
    text = markdown(table)
    if out is not None:
        outputs = dict(zip(OUTPUTS, ((text + "\n").encode(), csv_text(table).encode(), figure_png(table))))
        out.mkdir(parents=True, exist_ok=True)
        for name, data in outputs.items():
            atomic_write_bytes(out / name, data)
    return text


if __name__ == "__main__":  # `python -m adls_lightning.reports.table`, the spelling the docs use
    from adls_lightning.tools.results_table import main

    sys.exit(main())
