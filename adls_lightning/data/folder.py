"""The generic folder task: ``train`` and ``test`` files (parquet, CSV or JSON lines) with ``text``, optionally
``text_pair``, and ``label`` -- or the same splits from a Hugging Face hub data set. IMDb is one preset of it. The
validation split is carved out of train, so a validation file in the folder is refused, naming it, not left unread.

Labels are integers 0..K-1, strings (ids given in sorted order, or in the order of ``data.labels``) or floats (a
regression); other integers (1/2) are refused unless ``data.labels`` lists them (their ids in that order). The
class names the model records as its ``id2label`` (and an export's predictions print) are ``data.label_names`` when
given, else the label values as strings: IMDb's preset names its 0 and 1 ``negative`` and ``positive``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa

from adls_lightning.data.tasks import Task, default_metrics, with_main_metric
from adls_lightning.errors import ConfigError

DATA_EXTENSIONS = {".parquet": "parquet", ".csv": "csv", ".jsonl": "json", ".json": "json"}
SPLITS = ("train", "test")
# A validation file's usual names: refused, not read (the validation split is carved out of train, data.val_size).
VALIDATION_NAMES = ("validation", "valid", "val", "dev")
# Project root, used to find ../shared/data/imdb beside the checkout when data_dir is 'auto'.
PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
# The IMDb preset's source: its data module's defaults, and what the pre-flight check assumes for an absent key.
AUTO = "auto"
IMDB_HUB_NAME = "stanfordnlp/imdb"
IMDB_LABELS = (0, 1)
# what IMDb's labels mean (its dataset card: 0 = a negative review, 1 = a positive one), in id order
IMDB_LABEL_NAMES = ("negative", "positive")


def default_data_dir() -> Path | None:
    """``$ADLS_IMDB_DIR`` if set, else ``../shared/data/imdb`` beside the project when it exists, else None (hub)."""
    if env := os.environ.get("ADLS_IMDB_DIR"):
        return Path(env)
    shared = PROJECT_ROOT.parent / "shared" / "data" / "imdb"
    return shared if shared.is_dir() else None


def imdb_data_dir(data_dir: str | None) -> str | None:
    """IMDb's ``data.data_dir``: ``auto`` = :func:`default_data_dir` (None when there is none: the hub)."""
    if data_dir != AUTO:
        return data_dir
    found = default_data_dir()
    return None if found is None else str(found)


def resolve_data_dir(data_dir: str | None) -> Path | None:
    """A ``data.data_dir`` as a folder; None = the hub.

    Raises:
        ConfigError: the path is not a folder.
    """
    if data_dir is None:
        return None
    path = Path(data_dir)
    if not path.is_dir():
        raise ConfigError(f"data.data_dir={data_dir}: no such directory")
    return path


def folder_data_dir(data_dir: str | None, hub_name: str | None) -> Path | None:
    """The folder task's source folder, or None for the hub data set ``hub_name``.

    Raises:
        ConfigError: no such folder, or neither a folder nor a hub data set.
    """
    path = resolve_data_dir(data_dir)
    if path is None and not hub_name:
        raise ConfigError(
            "data.data_dir: required by data=folder: give data.data_dir=<your folder>, holding one train and one "
            f"test file ({'/'.join(DATA_EXTENSIONS)}) with columns text, label and optionally text_pair; or "
            "data.hub_name=<a Hugging Face data set with those splits and columns>"
        )
    return path


def find_split_files(data_dir: Path) -> dict[str, Path]:
    """Map each split to its file in ``data_dir`` (``train.parquet``, ``test.csv``, ``train.jsonl``, ...).

    Raises:
        ConfigError: a split has no file, or more than one; or the folder holds a validation file, which would
            otherwise be left unread without a word.
    """
    validation = [p for name in VALIDATION_NAMES for p in sorted(data_dir.glob(f"{name}.*"))]
    validation = [p for p in validation if p.suffix in DATA_EXTENSIONS]
    if validation:
        raise ConfigError(
            f"data.data_dir={data_dir}: {validation[0].name} is not read: the folder task's validation split is "
            f"carved out of the train file (data.val_size rows, seeded, stratified); move {validation[0].name} "
            "out of the folder, or add its rows to the train file"
        )
    files = {}
    for split in SPLITS:
        found = [p for p in sorted(data_dir.glob(f"{split}.*")) if p.suffix in DATA_EXTENSIONS]
        if len(found) != 1:
            what = "no" if not found else f"{len(found)}"
            raise ConfigError(
                f"data.data_dir={data_dir}: {what} '{split}' file found "
                f"(expected exactly one of {', '.join(split + ext for ext in DATA_EXTENSIONS)})"
            )
        files[split] = found[0]
    return files


# Raw splits already loaded by this process, by source: Optuna trials and multirun jobs run in one process and
# would otherwise re-read and re-check 50,000 reviews per trial (about 1.5-3 s here). Datasets are immutable.
_RAW_SPLITS: dict[str, tuple[datasets.DatasetDict, str]] = {}


def load_raw_splits(data_dir: Path | None, hub_name: str) -> tuple[datasets.DatasetDict, str]:
    """Load train/test as a DatasetDict with ``text`` (``text_pair``) and ``label``; also return a string
    identifying the source.

    Loaded once per process and source (local files by path, size and modification time; a hub data set by name).
    """
    source = f"hub:{hub_name}" if data_dir is None else local_identity(find_split_files(data_dir))
    if source not in _RAW_SPLITS:
        _RAW_SPLITS[source] = _load_raw_splits(data_dir, hub_name)
    return _RAW_SPLITS[source]


def local_identity(files: dict[str, Path]) -> str:
    """The files' paths, sizes and modification times: changes whenever their content may have."""
    return json.dumps(
        {s: [str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for s, p in files.items()}
    )


def load_hub_dataset(name: str, config: str | None, local: str) -> datasets.DatasetDict:
    """A Hugging Face hub data set, or a one-line ConfigError when it cannot be had (offline without a cached copy,
    or no such data set), saying what ``data.data_dir`` would read instead (``local``)."""
    try:
        return datasets.load_dataset(name, config)
    # ConnectionError offline, FileNotFoundError (DatasetNotFoundError) for an unknown name: both OSErrors
    except OSError as err:
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        source = name if config is None else f"{name} ({config})"
        raise ConfigError(
            f"data.data_dir: none given or found, so the data come from the Hugging Face hub's {source}, which "
            f"failed ({reason}); set data.data_dir to {local}"
        ) from err


def _load_raw_splits(data_dir: Path | None, hub_name: str) -> tuple[datasets.DatasetDict, str]:
    if data_dir is None:
        raw = load_hub_dataset(
            hub_name, None, "a folder with train and test files (parquet, CSV or JSON lines)"
        )
        identity = f"hub:{hub_name}:{raw['train']._fingerprint}:{raw['test']._fingerprint}"
    else:
        files = find_split_files(data_dir)
        raw = datasets.DatasetDict({split: read_data_file(path) for split, path in files.items()})
        identity = local_identity(files)
    sources = {
        split: files[split] if data_dir is not None else f"{hub_name} split '{split}'" for split in SPLITS
    }
    for split in SPLITS:
        check_rows(raw[split], sources[split])
    check_pair_columns(raw, sources)
    return raw, identity


def _innermost(err: BaseException) -> BaseException:
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return err


def read_data_file(path: Path) -> datasets.Dataset:
    """One data file, parsed whole, or a ConfigError naming the file (and the row where the parser says).

    A file that does not parse whole is never trained on: the loader raises rather than keeping the rows before
    the damage.
    """
    fmt = DATA_EXTENSIONS[path.suffix]
    if path.stat().st_size == 0:
        raise ConfigError(f"data.data_dir: {path}: empty file (0 bytes)")
    try:
        return datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as err:  # pyarrow, pandas and json parsers each raise their own types
        reason = " ".join(str(_innermost(err)).split())[:300] or type(_innermost(err)).__name__
        content = path.read_bytes()
        if fmt == "parquet" and content[:4] == b"PAR1" and content[-4:] != b"PAR1":
            raise ConfigError(
                f"data.data_dir: {path}: truncated parquet file (its footer is missing; {len(content)} bytes)"
            ) from None
        raise ConfigError(f"data.data_dir: {path}: not a readable {fmt} file ({reason})") from None


def check_rows(split: datasets.Dataset, source: Path | str) -> None:
    """Columns ``text`` (and ``text_pair`` if present) holding strings, and ``label``; ConfigError naming the
    file and the first bad row. Labels are checked against the task's label set by :func:`encode_labels`."""
    missing = {"text", "label"} - set(split.column_names)
    if missing:
        raise ConfigError(
            f"data.data_dir: {source}: lacks column(s) {sorted(missing)} "
            f"(has {split.column_names}; need 'text' and 'label', optionally 'text_pair')"
        )
    for column in ("text", "text_pair"):
        if column not in split.column_names:
            continue
        arrow = column_array(split, column)
        strings = pa.types.is_string(arrow.type) or pa.types.is_large_string(arrow.type)
        if strings and arrow.null_count == 0:  # strings throughout, known without a look at each row
            continue
        texts = arrow.to_pylist()
        bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
        if bad is not None:
            raise ConfigError(
                f"data.data_dir: {source}: row {bad} has {column} {texts[bad]!r} "
                f"(every row needs a string in '{column}')"
            )


def check_pair_columns(raw: datasets.DatasetDict, sources: dict[str, Path | str]) -> None:
    """Every split of single texts, or every split of pairs: a model trained on pairs and tested on the first text
    alone (or the reverse) would report a score of another task, without a word.

    Raises:
        ConfigError: naming the file (or hub split) that lacks ``text_pair`` and the one that has it.
    """
    paired = [split for split in SPLITS if "text_pair" in raw[split].column_names]
    if paired and len(paired) < len(SPLITS):
        single = next(split for split in SPLITS if split not in paired)
        raise ConfigError(
            f"data.data_dir: {sources[single]}: lacks column 'text_pair', which {sources[paired[0]]} has (a "
            f"{single} split of single texts for a task of pairs); give every split a text_pair column, or none"
        )


def column_array(dataset: datasets.Dataset, column: str) -> pa.ChunkedArray:
    """One column as Arrow holds it: checked and read whole in milliseconds, where ``dataset[column]`` formats
    its rows one by one (about 0.2 s per 25,000)."""
    return dataset.select_columns([column]).with_format("arrow")[:][column]


def column_values(dataset: datasets.Dataset, column: str) -> list:
    """One column as a list of Python values (:func:`column_array`'s speed)."""
    return column_array(dataset, column).to_pylist()


def _one_of(values: Sequence) -> str:
    shown = [str(v) for v in values[:10]] + (["..."] if len(values) > 10 else [])
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def infer_labels(values: list, source: Path | str) -> list | None:
    """The label set of a training column (read from ``source``): integers 0..K-1 -> themselves, strings ->
    sorted, floats -> None (regression).

    Raises:
        ConfigError: naming ``source``: a label of none of these kinds, or integers that are not 0..K-1 (binary
            1/2 would otherwise be three classes, one never seen); ``data.labels`` maps any integers to ids.
    """
    if values and all(_is_int(v) for v in values):
        found = sorted({int(v) for v in values})
        if found != list(range(len(found))):
            shown = [str(v) for v in found[:10]] + (["..."] if len(found) > 10 else [])
            raise ConfigError(
                f"data.data_dir: {source}: integer labels {', '.join(shown)} are not 0..K-1 (integer labels are "
                f"class ids 0..K-1; give data.labels=[{','.join(shown)}] to take them as classes in that order, "
                "or use string labels)"
            )
        return found
    if values and all(isinstance(v, str) for v in values):
        return sorted(set(values))
    if values and all(_is_number(v) for v in values):
        return None
    bad = next((i for i, v in enumerate(values) if not (_is_number(v) or isinstance(v, str))), 0)
    raise ConfigError(
        f"data.data_dir: {source}: row {bad} has label {values[bad] if values else None!r} "
        "(labels are integers 0..K-1, strings or floats)"
    )


def check_class_rows(labels: Sequence[int], label_set: Sequence, source: Path | str) -> None:
    """Every class that the training labels (ids of ``label_set``, read from ``source``) hold occurs at least
    twice: the validation split is carved out of train stratified, one row of each class on each side at least.

    Raises:
        ConfigError: naming ``source`` and the labels with a single row.
    """
    ids, counts = np.unique(np.asarray(labels), return_counts=True)
    single = [label_set[i] for i in ids[counts < 2]]
    if single:
        raise ConfigError(
            f"data.data_dir: {source}: {'label' if len(single) == 1 else 'labels'} "
            f"{_one_of([repr(v) for v in single])} {'has' if len(single) == 1 else 'each have'} a single row "
            "(each class needs at least 2 training rows for the stratified validation split; fix the label, or "
            "add rows)"
        )


def encode_labels(
    raw: datasets.DatasetDict, labels: Sequence | None, regression: bool, sources: dict[str, str]
) -> datasets.DatasetDict:
    """Every split's ``label`` as class ids of ``labels`` (their positions) or, for a regression, float32.

    Raises:
        ConfigError: naming the split's source and the first row whose label is outside the set (or, for a
            regression, not a number).
    """
    out = {}
    for split, dataset in raw.items():
        values = column_values(dataset, "label")
        if regression:
            bad = next((i for i, v in enumerate(values) if not _is_number(v)), None)
            if bad is not None:
                raise ConfigError(
                    f"data.data_dir: {sources[split]}: row {bad} has label {values[bad]!r} "
                    "(a regression target must be a number)"
                )
            ids = np.asarray(values, dtype=np.float32)
        else:
            index = {value: i for i, value in enumerate(labels)}
            bad = next(
                (i for i, v in enumerate(values) if isinstance(v, (bool, np.bool_)) or v not in index), None
            )
            if bad is not None:
                raise ConfigError(
                    f"data.data_dir: {sources[split]}: row {bad} has label {values[bad]!r} "
                    f"(labels must be {_one_of(list(labels))})"
                )
            if list(labels) == list(range(len(labels))):
                out[split] = dataset  # already ids
                continue
            ids = np.asarray([index[v] for v in values], dtype=np.int64)
        out[split] = dataset.remove_columns("label").add_column("label", ids.tolist())
    return datasets.DatasetDict(out)


def class_names(label_set: Sequence | None, label_names: Sequence[str] | None) -> tuple[str, ...] | None:
    """The class names in id order (the model's ``id2label``): ``data.label_names`` when given, else the label
    values as strings; None for a regression (``label_set`` None).

    Raises:
        ConfigError: ``label_names`` is not a list of distinct non-empty strings, one per class, or names a
            regression's classes.
    """
    if label_names is None:
        return None if label_set is None else tuple(str(v) for v in label_set)
    listed = isinstance(label_names, Sequence) and not isinstance(label_names, str)
    shown = list(label_names) if listed else label_names
    if not listed or not all(isinstance(name, str) and name for name in label_names):
        raise ConfigError(
            f"data.label_names={shown!r}: must be a list of names (non-empty strings), one per class in id order"
        )
    if label_set is None:
        raise ConfigError(
            f"data.label_names={shown}: the labels are floats (a regression), which has no classes to name; "
            "remove data.label_names"
        )
    if len(label_names) != len(label_set):
        raise ConfigError(
            f"data.label_names={shown}: {len(label_names)} names for {len(label_set)} classes (labels "
            f"{', '.join(map(str, label_set))}); give one name per class, in id order"
        )
    if len(set(label_names)) != len(label_names):
        raise ConfigError(f"data.label_names={shown}: a name given twice; each class needs its own name")
    return tuple(label_names)


def folder_task(
    raw: datasets.DatasetDict,
    labels: Sequence | None,
    main_metric: str | None,
    sources: dict[str, str],
    name: str = "folder",
    label_names: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
) -> tuple[datasets.DatasetDict, Task]:
    """The splits with labels encoded, and their :class:`Task` (label set given, or inferred from train; class
    names from ``label_names``, see :func:`class_names`; ``metrics`` = ``data.metrics``, None = the defaults
    for the number of classes, with ``main_metric`` first)."""
    if labels is not None:
        label_set = list(labels)
    else:
        label_set = infer_labels(column_values(raw["train"], "label"), sources["train"])
    regression = label_set is None
    if not regression and len(label_set) < 2:
        raise ConfigError(
            f"data.labels: the task needs at least two classes (found {label_set} in {sources['train']})"
        )
    names = class_names(label_set, label_names)
    encoded = encode_labels(raw, label_set, regression, sources)
    if not regression:
        check_class_rows(column_values(encoded["train"], "label"), label_set, sources["train"])
    num_labels = 1 if regression else len(label_set)
    listed = isinstance(metrics, Sequence) and not isinstance(metrics, str) and len(metrics) > 0
    # a data.metrics that is no list is refused by the data module, by name; no main-metric error about it here
    if metrics is not None and not listed:
        return encoded, Task(name, names, default_metrics(num_labels))
    logged = default_metrics(num_labels) if metrics is None else tuple(metrics)
    return encoded, Task(name, names, with_main_metric(logged, main_metric))


def load_folder(
    data_dir: Path | None,
    hub_name: str | None,
    labels: Sequence | None,
    main_metric: str | None,
    label_names: Sequence[str] | None = None,
    name: str = "folder",
    metrics: Sequence[str] | None = None,
) -> tuple[datasets.DatasetDict, str, Task]:
    """The folder task's splits (labels encoded), their identity and the :class:`Task` named ``name``: what the
    data module trains on, and what the pre-flight check reads (the raw splits are then in this process's cache).
    ``main_metric`` must be one of ``metrics`` (``data.metrics``; None = the task's defaults).

    Raises:
        ConfigError: naming the file (or hub split) and what is wrong with it, or a bad ``data.label_names``.
    """
    raw, identity = load_raw_splits(data_dir, hub_name)
    if data_dir is None:
        sources = {split: f"{hub_name} {split}" for split in raw}
    else:
        sources = {split: str(path) for split, path in find_split_files(data_dir).items()}
    encoded, task = folder_task(raw, labels, main_metric, sources, name, label_names, metrics)
    return encoded, identity, task
