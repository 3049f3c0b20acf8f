"""IMDb (or any text/label binary classification set) as a LightningDataModule.

Sources: a local folder holding ``train`` and ``test`` files (parquet, CSV or JSON lines, columns ``text`` and
``label``), or the Hugging Face hub (``stanfordnlp/imdb``). The validation split is carved out of train (seeded,
stratified); test is used only for the final number. Each split is tokenized once and cached on disk under a key
made from the data files, the tokenizer and ``max_length``, so a second run (or another Optuna trial) re-uses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import datasets
import numpy as np
import torch
from lightning import LightningDataModule
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding
from transformers.trainer_pt_utils import LengthGroupedSampler

from adls_lightning.errors import ConfigError, require_positive_int
from adls_lightning.models import load_tokenizer

log = logging.getLogger(__name__)

DATA_EXTENSIONS = {".parquet": "parquet", ".csv": "csv", ".jsonl": "json", ".json": "json"}
SPLITS = ("train", "test")
# Bumped whenever the cached layout changes, so stale caches are never read.
CACHE_VERSION = 1
# Project root, used to find ../shared/data/imdb beside the checkout when data_dir is 'auto'.
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def default_data_dir() -> Path | None:
    """``$ADLS_IMDB_DIR`` if set, else ``../shared/data/imdb`` beside the project when it exists, else None (hub)."""
    if env := os.environ.get("ADLS_IMDB_DIR"):
        return Path(env)
    shared = PROJECT_ROOT.parent / "shared" / "data" / "imdb"
    return shared if shared.is_dir() else None


def find_split_files(data_dir: Path) -> dict[str, Path]:
    """Map each split to its file in ``data_dir`` (``train.parquet``, ``test.csv``, ``train.jsonl``, ...).

    Raises:
        ConfigError: a split has no file, or more than one.
    """
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
    """Load train/test as a DatasetDict with ``text`` and ``label``; also return a string identifying the source.

    Loaded once per process and source (local files by path, size and modification time; a hub data set by name).
    """
    source = f"hub:{hub_name}" if data_dir is None else _local_identity(find_split_files(data_dir))
    if source not in _RAW_SPLITS:
        _RAW_SPLITS[source] = _load_raw_splits(data_dir, hub_name)
    return _RAW_SPLITS[source]


def _local_identity(files: dict[str, Path]) -> str:
    return json.dumps(
        {s: [str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for s, p in files.items()}
    )


def _load_raw_splits(data_dir: Path | None, hub_name: str) -> tuple[datasets.DatasetDict, str]:
    if data_dir is None:
        raw = datasets.load_dataset(hub_name)
        identity = f"hub:{hub_name}:{raw['train']._fingerprint}:{raw['test']._fingerprint}"
    else:
        files = find_split_files(data_dir)
        raw = datasets.DatasetDict({split: read_data_file(path) for split, path in files.items()})
        identity = _local_identity(files)
    for split in SPLITS:
        check_rows(raw[split], files[split] if data_dir is not None else f"split '{split}'")
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
    """Columns ``text`` (strings) and ``label`` (0 or 1), no nulls; ConfigError naming the file and first bad row."""
    missing = {"text", "label"} - set(split.column_names)
    if missing:
        raise ConfigError(
            f"data.data_dir: {source}: lacks column(s) {sorted(missing)} "
            f"(has {split.column_names}; need 'text' and 'label')"
        )
    texts = split["text"]
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise ConfigError(
            f"data.data_dir: {source}: row {bad} has text {texts[bad]!r} (every row needs a string in 'text')"
        )
    labels = split["label"]
    bad = next((i for i, label in enumerate(labels) if isinstance(label, bool) or label not in (0, 1)), None)
    if bad is not None:
        raise ConfigError(
            f"data.data_dir: {source}: row {bad} has label {labels[bad]!r} (labels must be 0 or 1)"
        )


def stratified_subset(labels: np.ndarray, size: int | None, seed: int) -> np.ndarray:
    """Indices of a seeded, label-stratified subset of ``size`` rows (all rows, shuffled, when size is None)."""
    index = np.arange(len(labels))
    if size is None or size >= len(labels):
        return np.random.default_rng(seed).permutation(index)
    chosen, _ = train_test_split(index, train_size=size, stratify=labels, random_state=seed)
    return chosen


class IMDbDataModule(LightningDataModule):
    """Tokenized, cached, length-grouped IMDb splits.

    Args:
        tokenizer: checkpoint whose tokenizer to use (hub id, local folder or ``pkg:`` name).
        data_dir: local folder with train/test files; ``"auto"`` = ``$ADLS_IMDB_DIR`` or ``../shared/data/imdb``
            when present, else the hub; ``None`` = the hub.
        hub_name: hub data set used when there is no local folder.
        cache_dir: where tokenized splits are cached.
        max_length: truncation length in tokens.
        truncation_side: ``right`` keeps the start of a long review, ``left`` keeps its end (where reviews
            usually give their verdict).
        batch_size: batch size for all loaders.
        train_size / val_size / test_size: rows used (None = all); val is carved out of train first.
        seed: seed of the validation split, the subsets and the length-grouped shuffling.
        group_by_length: batch training examples of similar length (less padding, faster).
        num_workers: DataLoader workers.
        pad_to_multiple_of: pad each batch to a multiple of this many tokens (None = to its longest row), so a
            compiled model sees at most ``max_length / pad_to_multiple_of`` sequence lengths (see docs/compile.md).
    """

    def __init__(
        self,
        tokenizer: str,
        data_dir: str | None = "auto",
        hub_name: str = "stanfordnlp/imdb",
        cache_dir: str = ".cache",
        max_length: int = 256,
        truncation_side: str = "right",
        batch_size: int = 32,
        train_size: int | None = None,
        val_size: int = 1000,
        test_size: int | None = None,
        seed: int = 42,
        group_by_length: bool = True,
        num_workers: int = 0,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        super().__init__()
        require_positive_int("data.max_length", max_length)
        require_positive_int("data.batch_size", batch_size)
        require_positive_int("data.val_size", val_size)
        require_positive_int("data.train_size", train_size, allow_none=True)
        require_positive_int("data.test_size", test_size, allow_none=True)
        require_positive_int("data.pad_to_multiple_of", pad_to_multiple_of, allow_none=True)
        if truncation_side not in ("left", "right"):
            raise ConfigError(f"data.truncation_side={truncation_side!r}: must be 'left' or 'right'")
        self.save_hyperparameters(logger=False)
        if data_dir == "auto":
            self.data_dir = default_data_dir()
        elif data_dir is None:
            self.data_dir = None
        else:
            self.data_dir = Path(data_dir)
            if not self.data_dir.is_dir():
                raise ConfigError(f"data.data_dir={data_dir}: no such directory")
        self.tokenizer = load_tokenizer(tokenizer)
        # Fingerprint now: calling a fast tokenizer with truncation changes its serialised state.
        self.tokenizer_fingerprint = self._fingerprint(self.tokenizer)
        self.tokenizer.truncation_side = truncation_side
        self.collator = DataCollatorWithPadding(
            self.tokenizer, pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt"
        )
        self.splits: dict[str, datasets.Dataset] = {}
        self.cache_hits: dict[str, bool] = {}
        self._train_loader: ResumableLoader | None = None
        self._loader_state: dict | None = None

    # ----------------------------------------------------------------------------------------------- tokenization
    @staticmethod
    def _fingerprint(tokenizer) -> str:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        state = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
        return hashlib.sha256(f"{type(tokenizer).__name__}:{state}".encode()).hexdigest()

    def _cache_key(self, source_identity: str, split: str, rows: np.ndarray) -> str:
        blob = json.dumps(
            [
                CACHE_VERSION,
                source_identity,
                split,
                hashlib.sha256(np.ascontiguousarray(rows, dtype=np.int64).tobytes()).hexdigest(),
                self.tokenizer_fingerprint,
                self.hparams.max_length,
                self.hparams.truncation_side,
            ]
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def _tokenized(
        self, raw: datasets.Dataset, source_identity: str, split: str, rows: np.ndarray
    ) -> datasets.Dataset:
        """Rows ``rows`` of ``raw``, tokenized: from the cache when an identical request was made before."""
        path = Path(self.hparams.cache_dir) / "tokenized" / self._cache_key(source_identity, split, rows)
        if (path / "dataset_info.json").is_file():
            log.info("Tokenized cache hit for '%s': %s", split, path)
            self.cache_hits[split] = True
            return datasets.load_from_disk(str(path))
        log.info(
            "Tokenizing '%s' (%d rows, max_length=%d) -> %s", split, len(rows), self.hparams.max_length, path
        )
        self.cache_hits[split] = False
        max_length = self.hparams.max_length

        def encode(batch):
            enc = self.tokenizer(batch["text"], truncation=True, max_length=max_length)
            return {"input_ids": enc["input_ids"], "length": [len(ids) for ids in enc["input_ids"]]}

        tokenized = raw.select(rows).map(
            encode,
            batched=True,
            batch_size=1000,
            remove_columns=[c for c in raw.column_names if c != "label"],
            desc=f"Tokenizing {split}",
            load_from_cache_file=False,
        )
        # Save under a temporary name and rename, so a killed run never leaves a half-written cache entry.
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tokenized.save_to_disk(str(tmp))
        try:
            tmp.rename(path)
        except OSError:  # another process cached the same split first; keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        return datasets.load_from_disk(str(path))

    # --------------------------------------------------------------------------------------------- Lightning hooks
    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        hp = self.hparams
        raw, identity = load_raw_splits(self.data_dir, hp.hub_name)
        train_labels = np.asarray(raw["train"]["label"])
        if hp.val_size >= len(train_labels):
            raise ConfigError(
                f"data.val_size={hp.val_size}: larger than or equal to the {len(train_labels)} training rows"
            )
        rest, val_idx = train_test_split(
            np.arange(len(train_labels)), test_size=hp.val_size, stratify=train_labels, random_state=hp.seed
        )
        train_idx = rest[stratified_subset(train_labels[rest], hp.train_size, hp.seed)]
        test_idx = stratified_subset(np.asarray(raw["test"]["label"]), hp.test_size, hp.seed)
        # Only the rows this run uses are tokenized (and cached under a key that includes which rows).
        self.splits = {
            "train": self._tokenized(raw["train"], identity, "train", train_idx),
            "val": self._tokenized(raw["train"], identity, "val", np.sort(val_idx)),
            "test": self._tokenized(raw["test"], identity, "test", np.sort(test_idx)),
        }
        for split in self.splits.values():
            split.set_format("torch", columns=["input_ids", "label"])
        log.info("Splits: %s", {k: len(v) for k, v in self.splits.items()})

    def _collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.collator([{"input_ids": r["input_ids"]} for r in rows])
        batch["labels"] = torch.stack([r["label"] for r in rows])
        return batch

    def _lengths(self, split: str) -> list[int]:
        return self.splits[split].with_format(None)["length"]

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        # One seeded generator per fit: each epoch draws a new order, the same in every run with this seed.
        generator = torch.Generator().manual_seed(hp.seed)
        if hp.group_by_length:
            sampler = LengthGroupedSampler(hp.batch_size, lengths=self._lengths("train"), generator=generator)
        else:
            sampler = torch.utils.data.RandomSampler(self.splits["train"], generator=generator)
        loader = ResumableLoader(
            self.splits["train"],
            order_generator=generator,
            sampler=sampler,
            batch_size=hp.batch_size,
            collate_fn=self._collate,
            num_workers=hp.num_workers,
        )
        if self._loader_state is not None:
            loader.load_state_dict(self._loader_state)
            self._loader_state = None
        self._train_loader = loader
        return loader

    # The training loader's position also travels as the data module's state: Lightning hands a loader its saved
    # state only when the loader is created after the checkpoint's loops are restored, and a scheduler sized by
    # `trainer.estimated_stepping_batches` creates it before. The data module is restored before either.
    def state_dict(self) -> dict:
        return {"train_loader": self._train_loader.state_dict()} if self._train_loader is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        self._loader_state = state_dict.get("train_loader")
        if self._train_loader is not None and self._loader_state is not None:
            self._train_loader.load_state_dict(self._loader_state)

    def _eval_loader(self, split: str) -> DataLoader:
        # Evaluation order does not matter: sort by length so each batch carries almost no padding.
        order = np.argsort(self._lengths(split), kind="stable").tolist()
        return DataLoader(
            torch.utils.data.Subset(self.splits[split], order),
            batch_size=self.hparams.batch_size,
            collate_fn=self._collate,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


class _SkippingSampler(torch.utils.data.Sampler):
    """``sampler``'s order with its first ``skip`` indices dropped (once): a resumed pass starts where it stopped."""

    def __init__(self, sampler: torch.utils.data.Sampler) -> None:
        self.sampler = sampler
        self.skip = 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        for position, index in enumerate(self.sampler):
            if position >= skip:
                yield index

    def __len__(self) -> int:
        return len(self.sampler)


class ResumableLoader(DataLoader):
    """The training loader, resumable mid-epoch: Lightning saves its ``state_dict`` in every checkpoint and hands
    it back to ``load_state_dict`` on ``ckpt_path=...``, so a resumed run trains on exactly the batches it had
    left, in the same order, with the same dropout masks.

    A pass's order is drawn from ``order_generator`` when the pass starts. The state holds that generator's
    state at the start of the current pass, how many batches of it were delivered (Lightning does not prefetch
    from a loader with a length, so delivered = trained), and the global torch RNG state (dropout), which is put
    back where the interrupted run stood: after the pass's start for a pass cut mid-way, before it otherwise.
    """

    def __init__(self, dataset, *, order_generator: torch.Generator, sampler, **kwargs) -> None:
        super().__init__(dataset, sampler=_SkippingSampler(sampler), **kwargs)
        self.order_generator = order_generator
        self._pass_start = order_generator.get_state()
        self._delivered = 0
        self._restore: dict | None = None

    def __iter__(self):
        restore, self._restore = self._restore, None
        mid_pass = restore is not None and restore["batches"] > 0
        if restore is not None:
            self.order_generator.set_state(restore["order_generator"])
            self.sampler.skip = restore["batches"] * self.batch_size
            if not mid_pass:
                torch.set_rng_state(restore["torch_rng"])
        self._pass_start = self.order_generator.get_state()
        self._delivered = restore["batches"] if restore is not None else 0
        iterator = super().__iter__()  # draws the workers' base seed from the global RNG, as every pass does
        if mid_pass:
            torch.set_rng_state(restore["torch_rng"])
        for batch in iterator:
            self._delivered += 1
            yield batch

    def state_dict(self) -> dict:
        if self._delivered >= len(self):  # pass finished: the next one draws from the generator as it is now
            start, delivered = self.order_generator.get_state(), 0
        else:
            start, delivered = self._pass_start, self._delivered
        return {"order_generator": start, "batches": delivered, "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self._restore = state
