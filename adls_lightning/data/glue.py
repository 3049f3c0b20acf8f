"""GLUE's tasks from the distribution's TSV files (``<data_dir>/<TASK>/train.tsv``, ``dev.tsv``; MNLI
``dev_matched.tsv`` and ``dev_mismatched.tsv``) or from the Hugging Face hub (``nyu-mll/glue``, the task as its
config). Either way the result has the columns ``text``, ``text_pair`` (pair tasks) and ``label`` (class ids in
the hub's order, or a float score for STS-B); splits ``train`` and the labelled dev sets under this project's test
names (``test``; MNLI ``test`` matched and ``test_mm`` mismatched). GLUE's own test labels are private.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import datasets

from adls_lightning.data.folder import load_hub_dataset, local_identity
from adls_lightning.data.tasks import GlueTask, glue_task
from adls_lightning.errors import ConfigError

HUB_NAME = "nyu-mll/glue"

# The TSVs are read with quoting off (as GLUE's loaders do): a sentence may contain any quote character.
csv.field_size_limit(sys.maxsize)

_RAW: dict[str, tuple[datasets.DatasetDict, str]] = {}


def glue_files(data_dir: Path, name: str) -> dict[str, Path]:
    """``{split: file}`` of a task in ``data_dir``; ConfigError naming the first expected file that is missing."""
    spec = glue_task(name)
    wanted = {"train": "train.tsv", **{split: file for split, (file, _) in spec.dev.items()}}
    files = {split: data_dir / spec.folder / file for split, file in wanted.items()}
    for path in files.values():
        if not path.is_file():
            raise ConfigError(
                f"data.data_dir={data_dir}: no {spec.folder}/{path.name} (GLUE {name} expects "
                f"{', '.join(f'{spec.folder}/{f}' for f in wanted.values())})"
            )
    return files


def read_glue_tsv(path: Path, name: str) -> dict[str, list]:
    """One GLUE TSV as ``{"text": [...], ("text_pair": [...],) "label": [...]}``.

    Raises:
        ConfigError: naming the file: a header that is not the task's, a row with too few fields, a label outside
            the task's set, a score that is not a number.
    """
    spec = glue_task(name)
    with path.open(encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        if spec.header is None:
            columns = {"text": spec.text, "label": spec.label}
            first_line = 1
        else:
            header = next(rows, [])
            named = [c for c in (spec.text, spec.text_pair, spec.label) if c is not None]
            if not set(named) <= set(header):
                raise ConfigError(
                    f"data.data_dir: {path}: header {header[:12]} is not GLUE {name}'s (its columns "
                    f"{named} are missing; GLUE's header: {list(spec.header)})"
                )
            columns = {"text": header.index(spec.text), "label": header.index(spec.label)}
            if spec.text_pair is not None:
                columns["text_pair"] = header.index(spec.text_pair)
            first_line = 2
        width = max(columns.values()) + 1
        out: dict[str, list] = {key: [] for key in columns}
        labels = {value: i for i, value in enumerate(spec.file_labels or ())}
        for line, row in enumerate(rows, start=first_line):
            if not row:
                continue
            if len(row) < width:
                raise ConfigError(
                    f"data.data_dir: {path}: line {line} has {len(row)} tab-separated fields, "
                    f"GLUE {name} needs at least {width}"
                )
            for key, position in columns.items():
                out[key].append(row[position])
            out["label"][-1] = _label(out["label"][-1], spec, labels, path, line, name)
    if not out["label"]:
        raise ConfigError(f"data.data_dir: {path}: no rows")
    return out


def _label(value: str, spec: GlueTask, labels: dict[str, int], path: Path, line: int, name: str):
    if spec.file_labels is None:
        try:
            return float(value)
        except ValueError:
            raise ConfigError(
                f"data.data_dir: {path}: line {line} has score {value!r} (GLUE {name} needs a number)"
            ) from None
    if value not in labels:
        raise ConfigError(
            f"data.data_dir: {path}: line {line} has label {value!r} "
            f"(GLUE {name}'s labels: {', '.join(spec.file_labels)})"
        )
    return labels[value]


def load_glue(data_dir: Path | None, name: str) -> tuple[datasets.DatasetDict, str, dict[str, str]]:
    """The task's splits, a string identifying their source, and each split's source for messages.

    Loaded once per process and source, like the folder task's splits.
    """
    spec = glue_task(name)
    if data_dir is None:
        key = f"hub:{HUB_NAME}:{name}"
        sources = {split: f"{HUB_NAME}/{name} {hub}" for split, (_, hub) in spec.dev.items()}
        sources["train"] = f"{HUB_NAME}/{name} train"
        if key not in _RAW:
            _RAW[key] = _load_hub(name, spec)
    else:
        files = glue_files(data_dir, name)
        key = local_identity(files) + name
        sources = {split: str(path) for split, path in files.items()}
        if key not in _RAW:
            splits = {split: read_glue_tsv(path, name) for split, path in files.items()}
            features = datasets.Features(
                {
                    **{c: datasets.Value("string") for c in splits["train"] if c != "label"},
                    "label": datasets.Value("float32" if spec.file_labels is None else "int64"),
                }
            )
            raw = datasets.DatasetDict(
                {split: datasets.Dataset.from_dict(c, features=features) for split, c in splits.items()}
            )
            _RAW[key] = raw, json.dumps(["glue", name, key])
    raw, identity = _RAW[key]
    return raw, identity, sources


def _load_hub(name: str, spec: GlueTask) -> tuple[datasets.DatasetDict, str]:
    files = ", ".join(f"{spec.folder}/{file}" for file in ("train.tsv", *(f for f, _ in spec.dev.values())))
    hub = load_hub_dataset(HUB_NAME, name, f"the GLUE folder holding {files}")
    renames = dict(zip(spec.hub_columns, ("text", "text_pair")))
    splits = {"train": hub["train"], **{split: hub[hub_split] for split, (_, hub_split) in spec.dev.items()}}
    raw = datasets.DatasetDict(
        {
            split: ds.rename_columns(renames).select_columns([*renames.values(), "label"])
            for split, ds in splits.items()
        }
    )
    if spec.file_labels is None:
        raw = raw.cast_column("label", datasets.Value("float32"))
    identity = json.dumps(["glue-hub", name, *(ds._fingerprint for ds in splits.values())])
    return raw, identity
