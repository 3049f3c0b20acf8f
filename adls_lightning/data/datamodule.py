"""Text (or text-pair) classification and regression tasks as a LightningDataModule.

:class:`TextDataModule` tokenizes, caches, length-groups and resumably loads the splits that a source hands it:
:class:`FolderDataModule` (files with ``text``, optional ``text_pair``, ``label``, or a hub data set; IMDb is its
preset :class:`IMDbDataModule`) and :class:`GlueDataModule` (GLUE's TSVs or ``nyu-mll/glue``). The validation
split is carved out of train (seeded, stratified for classes); the labelled evaluation sets are used only for the
final number. Each split is tokenized once and cached on disk under a key made from the data, the tokenizer and
``max_length``, so a second run (or another Optuna trial) re-uses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from lightning import LightningDataModule
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding
from transformers.trainer_pt_utils import LengthGroupedSampler

from adls_lightning.data.folder import (
    AUTO,
    IMDB_HUB_NAME,
    IMDB_LABEL_NAMES,
    IMDB_LABELS,
    class_names,
    column_values,
    folder_data_dir,
    imdb_data_dir,
    load_folder,
    resolve_data_dir,
)
from adls_lightning.data.glue import HUB_NAME as GLUE_HUB_NAME
from adls_lightning.data.glue import load_glue
from adls_lightning.data.settings import check_loader_settings, check_val_size
from adls_lightning.data.tasks import (
    METRICS,
    Task,
    check_swappable,
    default_metrics,
    glue_task,
    with_main_metric,
)
from adls_lightning.errors import ConfigError
from adls_lightning.models import load_tokenizer
from adls_lightning.registry import import_plugins

log = logging.getLogger(__name__)

# Bumped whenever the cached layout changes, so stale caches are never read.
CACHE_VERSION = 2


def plain_list(value: object) -> object:
    """A list (Hydra's ListConfig or a tuple) as a plain list, for hyperparameters that checkpoints load with
    ``weights_only``; anything else as it is (for the check that refuses it)."""
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


def stratified_subset(labels: np.ndarray, size: int | None, seed: int, stratify: bool = True) -> np.ndarray:
    """Indices of a seeded subset of ``size`` rows, label-stratified when ``stratify`` (classes; not for a
    regression's scores); all rows, shuffled, when size is None."""
    index = np.arange(len(labels))
    if size is None or size >= len(labels):
        return np.random.default_rng(seed).permutation(index)
    if stratify:
        # stratifying needs every class at least twice and a place for each class on both sides of the cut
        counts = np.unique(labels, return_counts=True)[1]
        stratify = counts.min() >= 2 and min(size, len(labels) - size) >= len(counts)
    chosen, _ = train_test_split(
        index, train_size=size, stratify=labels if stratify else None, random_state=seed
    )
    return chosen


class TextDataModule(LightningDataModule):
    """Tokenized, cached, length-grouped splits of a text or text-pair task; a subclass names the source.

    A subclass implements :meth:`load` (the raw splits with columns ``text``, optional ``text_pair`` and
    ``label``, encoded) and :meth:`_describe_task` (the :class:`~adls_lightning.data.tasks.Task`). Pairs are
    tokenized as pairs: the tokenizer's pair encoding with ``token_type_ids`` where the model family has them,
    truncation shortening the longer text first.

    Args:
        tokenizer: checkpoint whose tokenizer to use (hub id, local folder or ``pkg:`` name).
        cache_dir: where tokenized splits are cached.
        max_length: truncation length in tokens (of the pair together).
        truncation_side: ``right`` keeps the start of a long text, ``left`` keeps its end (where reviews
            usually give their verdict).
        batch_size: batch size for all loaders.
        train_size / val_size / test_size: rows used (None = all); val is carved out of train first.
        seed: seed of the validation split, the subsets and the length-grouped shuffling.
        group_by_length: batch training examples of similar length (less padding, faster).
        num_workers: DataLoader workers.
        pad_to_multiple_of: pad each batch to a multiple of this many tokens (None = to its longest row), so a
            compiled model sees at most ``max_length / pad_to_multiple_of`` sequence lengths (see docs/compile.md).
        main_metric: the task's main metric (checkpoint selection, search objectives); checked against the
            task's metrics. ``conf/train.yaml`` reads it as ``main_metric: val/${data.main_metric}``.
        swap_pairs: also train on every training pair with its two texts swapped (twice the training rows), for
            tasks whose label does not depend on the texts' order (paraphrase, similarity). The model reads a
            pair as one sequence, so the mirrored pair is a new example with the same label; validation and test
            are left as they are.
        metrics: the metrics to report, names in :data:`adls_lightning.data.tasks.METRICS` (None = the task's
            own); ``main_metric`` must be one of them.
        plugins: modules to import first, so that the metrics they register (``register_metric``) exist; allowed
            as ``quant.plugins`` are (``ADLS_EXTRA_TARGETS``).
    """

    def __init__(
        self,
        tokenizer: str,
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
        main_metric: str | None = None,
        swap_pairs: bool = False,
        metrics: Sequence[str] | None = None,
        plugins: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        import_plugins(plugins, "data.plugins")
        plugins = None if plugins is None else list(plugins)
        if metrics is not None:
            if isinstance(metrics, str) or not isinstance(metrics, Sequence) or not metrics:
                unknown = [metrics]
            else:
                metrics = list(metrics)
                unknown = [name for name in metrics if name not in METRICS]
            if unknown:
                raise ConfigError(
                    f"data.metrics={metrics!r}: must be a non-empty list of registered metrics "
                    f"(known: {', '.join(METRICS)}; a plugin's need data.plugins=[its module])"
                )
        check_loader_settings(
            {
                "max_length": max_length,
                "batch_size": batch_size,
                "val_size": val_size,
                "train_size": train_size,
                "test_size": test_size,
                "pad_to_multiple_of": pad_to_multiple_of,
                "truncation_side": truncation_side,
                "swap_pairs": swap_pairs,
            }
        )
        self.save_hyperparameters(logger=False)
        # plain lists, also where a subclass passed Hydra's ListConfig on in **kwargs (weights_only checkpoints)
        self.hparams.update(metrics=metrics, plugins=plugins)
        self.tokenizer = load_tokenizer(tokenizer)
        # Fingerprint now: calling a fast tokenizer with truncation changes its serialised state.
        self.tokenizer_fingerprint = self._fingerprint(self.tokenizer)
        self.tokenizer.truncation_side = truncation_side
        self.collator = DataCollatorWithPadding(
            self.tokenizer, pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt"
        )
        self.splits: dict[str, datasets.Dataset] = {}
        self.cache_hits: dict[str, bool] = {}
        self._task: Task | None = None
        self._train_loader: ResumableLoader | None = None
        self._loader_state: dict | None = None
        self._at_most: dict[str, int] = {}

    # ---------------------------------------------------------------------------------------------------- source
    def load(self) -> tuple[datasets.DatasetDict, str, Task]:
        """The raw splits (``train`` and the task's test splits; labels encoded), their identity, the task."""
        raise NotImplementedError

    def _describe_task(self) -> Task:
        """The task without tokenizing anything (from its definition, or from the training labels)."""
        return self.load()[2]

    def _label_identity(self) -> object:
        """What decides which label value gets which id, for the cache key: the task's class names, where they
        are the values (a subclass whose names are set apart from its values adds the values)."""
        return self.task.label_names

    def _check_swap_pairs(self, raw: datasets.DatasetDict) -> None:
        """Refuses ``swap_pairs`` where mirroring a pair would not keep its label (a subclass adds its rules)."""
        if "text_pair" not in raw["train"].column_names:
            raise ConfigError("data.swap_pairs=true: this data has single texts, no text_pair column to swap")

    @property
    def task(self) -> Task:
        """What the model and the metrics need to know: labels (or regression), metrics, main metric."""
        if self._task is None:
            task = self._describe_task()
            chosen = task.metrics if self.hparams.metrics is None else tuple(self.hparams.metrics)
            metrics = with_main_metric(chosen, self.hparams.main_metric)
            self._task = Task(task.name, task.label_names, metrics, task.test_splits)
        return self._task

    def train_target_mean(self) -> float | None:
        """The mean of the training rows' targets for a regression task (after :meth:`setup`), else None: where a
        fresh regression head's output starts (``model.regression_bias_init``)."""
        if not self.task.is_regression or "train" not in self.splits:
            return None
        return float(self.splits["train"]["label"][:].double().mean())

    # ----------------------------------------------------------------------------------------------- tokenization
    @staticmethod
    def _fingerprint(tokenizer) -> str:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        state = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
        return hashlib.sha256(f"{type(tokenizer).__name__}:{state}".encode()).hexdigest()

    def _cache_key(self, source_identity: str, split: str, rows: np.ndarray, swapped: bool) -> str:
        blob = json.dumps(
            [
                CACHE_VERSION,
                source_identity,
                split,
                hashlib.sha256(np.ascontiguousarray(rows, dtype=np.int64).tobytes()).hexdigest(),
                self.tokenizer_fingerprint,
                self.hparams.max_length,
                self.hparams.truncation_side,
                self._label_identity(),  # which label is which id
                swapped,
            ]
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def _tokenized(
        self, raw: datasets.Dataset, source_identity: str, split: str, rows: np.ndarray, swapped: bool = False
    ) -> datasets.Dataset:
        """Rows ``rows`` of ``raw``, tokenized (with each pair's texts in the other order when ``swapped``): from
        the cache when an identical request was made before."""
        key = self._cache_key(source_identity, split, rows, swapped)
        path = Path(self.hparams.cache_dir) / "tokenized" / key
        if (path / "dataset_info.json").is_file():
            log.debug("Tokenized cache hit for '%s': %s", split, path)
            self.cache_hits[split] = True
            return datasets.load_from_disk(str(path))
        log.debug(
            "Tokenizing '%s' (%d rows, max_length=%d) -> %s", split, len(rows), self.hparams.max_length, path
        )
        self.cache_hits[split] = False
        max_length = self.hparams.max_length
        pairs = "text_pair" in raw.column_names

        first, second = ("text_pair", "text") if swapped else ("text", "text_pair")

        def encode(batch):
            enc = self.tokenizer(
                batch[first], batch[second] if pairs else None, truncation=True, max_length=max_length
            )
            out = {"input_ids": enc["input_ids"], "length": [len(ids) for ids in enc["input_ids"]]}
            if pairs and "token_type_ids" in enc:
                out["token_type_ids"] = enc["token_type_ids"]
            return out

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

    def use_at_most(self, rows: Mapping[str, int]) -> None:
        """Tokenize at most ``rows[split]`` rows of a split (``train``, ``val``, ``test``: every test split), a
        seeded, stratified subset: what a trainer limited to a few batches (``fast_dev_run``, the ``debug=``
        presets) can reach, instead of the whole split. Called before :meth:`setup`."""
        if self.splits:
            raise RuntimeError("use_at_most: the splits are tokenized already")
        self._at_most = {split: int(n) for split, n in rows.items()}

    def _capped(self, split: str, size: int | None) -> int | None:
        cap = self._at_most.get("test" if split in self.task.test_splits else split)
        return size if cap is None else cap if size is None else min(size, cap)

    # --------------------------------------------------------------------------------------------- Lightning hooks
    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        hp = self.hparams
        raw, identity, _ = self.load()
        task = self.task  # checks data.main_metric against the task's metrics before anything is tokenized
        classes = not task.is_regression
        train_labels = np.asarray(column_values(raw["train"], "label"))
        check_val_size(hp.val_size, len(train_labels))
        if hp.swap_pairs:
            self._check_swap_pairs(raw)
        rest, val_idx = train_test_split(
            np.arange(len(train_labels)),
            test_size=hp.val_size,
            stratify=train_labels if classes else None,
            random_state=hp.seed,
        )
        train_idx = rest[
            stratified_subset(train_labels[rest], self._capped("train", hp.train_size), hp.seed, classes)
        ]
        if "val" in self._at_most:  # the carve stays val_size rows (train never holds them); fewer are read
            val_idx = val_idx[
                stratified_subset(train_labels[val_idx], self._capped("val", None), hp.seed, classes)
            ]
        # Only the rows this run uses are tokenized (and cached under a key that includes which rows).
        train = self._tokenized(raw["train"], identity, "train", train_idx)
        if hp.swap_pairs:
            mirrored = self._tokenized(raw["train"], identity, "train", train_idx, swapped=True)
            train = datasets.concatenate_datasets([train, mirrored])
        self.splits = {
            "train": train,
            "val": self._tokenized(raw["train"], identity, "val", np.sort(val_idx)),
        }
        for split in task.test_splits:
            labels = np.asarray(column_values(raw[split], "label"))
            test_idx = stratified_subset(labels, self._capped(split, hp.test_size), hp.seed, classes)
            self.splits[split] = self._tokenized(raw[split], identity, split, np.sort(test_idx))
        for split in self.splits.values():
            split.set_format(
                "torch",
                columns=[c for c in ("input_ids", "token_type_ids", "label") if c in split.column_names],
            )
        # one line for the whole data set (the per-split detail is at DEBUG): a run's log stays short
        sources = {
            "from the cache" if hit else "tokenized now": [k for k, h in self.cache_hits.items() if h == hit]
            for hit in (False, True)
        }
        log.info(
            "Data: %s rows%s%s, max_length=%d (%s; cache %s)",
            ", ".join(f"{k} {len(v)}" for k, v in self.splits.items()),
            " (train: each pair also swapped)" if hp.swap_pairs else "",
            " (as many as the trainer's batch limits reach)" if self._at_most else "",
            hp.max_length,
            "; ".join(f"{how}: {', '.join(names)}" for how, names in sources.items() if names),
            Path(hp.cache_dir) / "tokenized",
        )

    def _collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        keys = [k for k in ("input_ids", "token_type_ids") if k in rows[0]]
        batch = self.collator([{k: r[k] for k in keys} for r in rows])
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

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        # MNLI: matched and mismatched, as dataloaders 0 and 1 (the model logs them as test/ and test_mm/)
        loaders = [self._eval_loader(split) for split in self.task.test_splits]
        return loaders[0] if len(loaders) == 1 else loaders


class FolderDataModule(TextDataModule):
    """The generic folder task: ``train`` and ``test`` files with ``text``, optional ``text_pair``, ``label``
    (see :mod:`adls_lightning.data.folder`), or a hub data set with those columns and splits.

    Args:
        data_dir: local folder with train/test files; None = the hub data set ``hub_name``.
        hub_name: hub data set used when there is no local folder.
        labels: the label values in id order (e.g. ``[0, 1]``, ``[neg, pos]``); None = from the training labels
            (integers 0..K-1, strings in sorted order, floats = regression).
        label_names: the classes' names in id order (the model's ``id2label``, what an export's predictions
            print), one per class; None = the label values as strings.
        **kwargs: see :class:`TextDataModule`.
    """

    #: the task's name (the run summary's title, an export's ``adls_inputs.task``)
    TASK_NAME = "folder"

    def __init__(
        self,
        tokenizer: str,
        data_dir: str | None = None,
        hub_name: str | None = None,
        labels: Sequence | None = None,
        label_names: Sequence[str] | None = None,
        **kwargs,
    ) -> None:
        # plain lists (not Hydra's ListConfig) in the hyperparameters, so checkpoints load with weights_only
        labels = None if labels is None else list(labels)
        label_names = plain_list(label_names)
        super().__init__(tokenizer, **kwargs)
        self.data_dir = folder_data_dir(data_dir, hub_name)
        self.hub_name = hub_name
        self.labels = labels
        self.label_names = label_names
        if labels is not None:  # a bad data.label_names is refused now, before any data is read
            class_names(labels, label_names)
        self._encoded: tuple[datasets.DatasetDict, str, Task] | None = None

    def _describe_task(self) -> Task:
        if self.labels is None:  # inferred from the training labels
            return self.load()[2]
        names = class_names(self.labels, self.label_names)
        return Task(self.TASK_NAME, names, default_metrics(len(self.labels)))

    def _label_identity(self) -> object:
        return [self.labels, self.task.label_names]

    def load(self) -> tuple[datasets.DatasetDict, str, Task]:
        if self._encoded is None:
            self._encoded = load_folder(
                self.data_dir,
                self.hub_name,
                self.labels,
                self.hparams.main_metric,
                self.label_names,
                self.TASK_NAME,
                self.hparams.metrics,
            )
        return self._encoded


class IMDbDataModule(FolderDataModule):
    """IMDb: the folder task with IMDb's defaults (``$ADLS_IMDB_DIR``, ``../shared/data/imdb`` or the hub's
    ``stanfordnlp/imdb``; labels 0 and 1, named ``negative`` and ``positive``).

    Args:
        data_dir: ``"auto"`` = ``$ADLS_IMDB_DIR`` or ``../shared/data/imdb`` when present, else the hub;
            ``None`` = the hub; else a folder.
    """

    TASK_NAME = "imdb"

    def __init__(
        self,
        tokenizer: str,
        data_dir: str | None = AUTO,
        hub_name: str = IMDB_HUB_NAME,
        labels: Sequence | None = IMDB_LABELS,
        label_names: Sequence[str] | None = IMDB_LABEL_NAMES,
        **kwargs,
    ) -> None:
        labels = None if labels is None else list(labels)  # plain, as in FolderDataModule
        label_names = plain_list(label_names)
        super().__init__(
            tokenizer,
            data_dir=imdb_data_dir(data_dir),
            hub_name=hub_name,
            labels=labels,
            label_names=label_names,
            **kwargs,
        )


class GlueDataModule(TextDataModule):
    """A GLUE task (:data:`~adls_lightning.data.tasks.GLUE_TASKS`): GLUE's TSVs from ``data_dir`` or the hub.

    Args:
        task: ``cola``, ``sst2``, ``mrpc``, ``stsb``, ``qqp``, ``mnli``, ``qnli``, ``rte`` or ``wnli``.
        data_dir: the folder holding ``<TASK>/train.tsv`` and ``<TASK>/dev.tsv`` (GLUE's folder names); None =
            the hub's ``nyu-mll/glue``.
        **kwargs: see :class:`TextDataModule`.
    """

    def __init__(self, tokenizer: str, task: str, data_dir: str | None = None, **kwargs) -> None:
        self.spec = glue_task(task)  # refuses an unknown task before the tokenizer loads
        if kwargs.get("swap_pairs"):
            check_swappable(task)
        super().__init__(tokenizer, **kwargs)
        self.task_name = task
        self.data_dir = resolve_data_dir(data_dir)
        self._loaded: tuple[datasets.DatasetDict, str, Task] | None = None

    def _describe_task(self) -> Task:
        return self.spec.task(self.task_name)

    def load(self) -> tuple[datasets.DatasetDict, str, Task]:
        if self._loaded is None:
            if self.data_dir is None:
                log.info("GLUE %s from the hub (%s)", self.task_name, GLUE_HUB_NAME)
            raw, identity, _ = load_glue(self.data_dir, self.task_name)
            self._loaded = raw, identity, self._describe_task()
        return self._loaded


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


def checkpoint_task(checkpoint: Mapping[str, Any]) -> str | None:
    """The task a ``train.py`` checkpoint was trained on, spelt as :attr:`Task.name` (``imdb``, ``glue/mrpc``), read
    from the data module Lightning saved with it (its state under the class's name, its hyper-parameters): the same
    whichever folder or hub copy it read. None when it records none (a checkpoint saved outside ``train.py``) or a
    generic folder task (``folder``: any data set), which cannot be told apart by name."""
    hparams = checkpoint.get("datamodule_hyper_parameters")
    if not isinstance(hparams, Mapping):
        return None
    kinds = [TextDataModule]
    while kinds:
        kind = kinds.pop()
        kinds.extend(kind.__subclasses__())
        if kind.__qualname__ not in checkpoint:
            continue
        if issubclass(kind, GlueDataModule) and isinstance(hparams.get("task"), str):
            try:
                return glue_task(hparams["task"]).task(hparams["task"]).name
            except ConfigError:  # a GLUE task this version does not know: not compared
                return None
        name = getattr(kind, "TASK_NAME", None)
        return name if isinstance(name, str) and name != FolderDataModule.TASK_NAME else None
    return None
