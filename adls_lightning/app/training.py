"""The training task: compose objects from a Hydra config, fit, evaluate the best checkpoint, record metrics.

``train.py`` and ``search.py`` are thin shells over :func:`run`.
"""

from __future__ import annotations

import logging
import logging.handlers
import math
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from adls_lightning.app.preflight import callback_nodes, check_output_dir, runs_on_cpu, validate_run_config
from adls_lightning.build import build
from adls_lightning.checkpoints import (
    check_shapes,
    complete_light_state,
    last_checkpoint,
    read_checkpoint,
)
from adls_lightning.compression_record import CompressionRecord
from adls_lightning.configs import CONF_DIR
from adls_lightning.data.datamodule import FolderDataModule, TextDataModule, checkpoint_task
from adls_lightning.data.sources import data_identity
from adls_lightning.data.tasks import Task
from adls_lightning.errors import ConfigError
from adls_lightning.export.compressed import run_overrides
from adls_lightning.files.atomic import atomic_write_json
from adls_lightning.files.lightning_io import AtomicCheckpointIO
from adls_lightning.gemm import batch_rows, gemm_backend, native_bfloat16
from adls_lightning.gemm import choose as choose_gemm
from adls_lightning.logs import drop_unset_wandb_settings, wandb_location
from adls_lightning.models import head_outputs, without_task_head
from adls_lightning.module import parameter_metrics
from adls_lightning.precision import choose as choose_precision
from adls_lightning.quant import weight_storage
from adls_lightning.runs.folder import entries, remove_unused_run_folder, replace_earlier_run
from adls_lightning.runs.record import METRICS_FILE, PRECISION_KEY, write_run_record
from adls_lightning.runtime import keep_freed_memory

log = logging.getLogger(__name__)


@runtime_checkable
class Reporter(Protocol):
    """A callback whose measurements go into ``metrics.json`` (and a search trial's values): quantization bit
    widths, pruning sparsity, compression accuracies, compile times... ``report`` is called once, after the
    final evaluation."""

    def report(self) -> Mapping[str, float]: ...


def instantiate_callbacks(cfg: DictConfig) -> list[L.Callback]:
    """The run's callbacks, built in the order :func:`~adls_lightning.app.preflight.callback_nodes` lists them."""
    callbacks = []
    for name, leaf in callback_nodes(cfg):
        log.debug("Instantiating callback %s <%s>", name, leaf["_target_"])
        callbacks.append(build(leaf, name, _convert_="partial"))
    return callbacks


def instantiate_loggers(cfg: DictConfig) -> list[Logger]:
    """Loggers from ``cfg.logger`` (a dict of ``_target_`` leaves; empty for ``logger=none``)."""
    loggers = []
    for name, leaf in (cfg.get("logger") or {}).items():
        if isinstance(leaf, Mapping) and "_target_" in leaf:
            log.debug("Instantiating logger %s <%s>", name, leaf["_target_"])
            extra = {}
            if leaf["_target_"].endswith("WandbLogger") and not leaf.get("group") and _is_multirun():
                # One W&B group per sweep, so a multirun's jobs sit together in the UI.
                extra["group"] = Path(HydraConfig.get().sweep.dir).name
            loggers.append(build(leaf, f"logger.{name}", **extra))
            drop_unset_wandb_settings(loggers[-1])
    return loggers


def _is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _float_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value) if isinstance(value, float) else value
    return out


def run(cfg: DictConfig, checked: bool = False) -> dict[str, float | str]:
    """Fit, then validate and test the best checkpoint; write ``metrics.json`` into ``cfg.paths.output_dir``.

    ``checked``: the entry point's pre-flight already checked this config's values
    (:func:`~adls_lightning.app.preflight.check_config`), so they are not checked again.

    Returns:
        The recorded metrics (``val/acc``, ``test/acc``, ``params/trainable``, ... and callbacks' reports) and
        the precision the trainer computed in (``trainer/precision``: ``32-true``, ``bf16-mixed``, ...).
    """
    with held_log_file() as release_log:
        datamodule, model, callbacks, loggers, trainer, ckpt_path = _checked_objects(cfg, checked)
        # Every check passed: only now does anything land in the run folder (DDP: rank zero writes it).
        output_dir, replaced = Path(cfg.paths.output_dir), []
        if trainer.is_global_zero and HydraConfig.initialized():
            # what the run reads, by content: a table never averages seeds on data replaced between them
            data = data_identity(OmegaConf.to_container(cfg.data, resolve=True))
            if cfg.get("overwrite") and not ckpt_path:  # checked: the run reads nothing among them
                replaced = replace_earlier_run(output_dir)
            write_run_record(output_dir, cfg, HydraConfig.instance().cfg, data)
        release_log()
        if replaced:
            log.info("overwrite=true: replaced the earlier run's %s in %s", ", ".join(replaced), output_dir)
    # Every linear layer of fit, validation and test on the chosen GEMM backend (docs/gemm.md).
    model.resolved_gemm = _gemm_choice(cfg, model, trainer)  # recorded in its checkpoints (RESOLVED_KEY)
    with gemm_backend(model.resolved_gemm):
        return _fit_and_record(cfg, datamodule, model, callbacks, loggers, trainer, ckpt_path)


def _checked_objects(cfg: DictConfig, checked: bool = False) -> tuple:
    """Validate and build everything a run needs, writing nothing: model, checkpoints, trainer, then the data.

    The cheap checks come first: the data module is built without reading its splits (its task, which shapes the
    model, is known from its definition, or from the training file's labels alone), the model with its LoRA wrapping
    is built and checked, then the trainer; only then are the splits tokenized (minutes on a whole data set).
    """
    if not checked:  # a search's trial (its sampled values), or a config no entry point checked
        validate_run_config(OmegaConf.to_container(cfg, resolve=True))
    output_dir = Path(cfg.paths.output_dir)
    check_output_dir(output_dir, cfg)
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.get("keep_freed_memory", True) and not keep_freed_memory():
        log.info("keep_freed_memory: not available on this platform (glibc malloc only)")

    log.debug("Instantiating datamodule <%s>", cfg.data._target_)
    datamodule = build(cfg.data, "data")
    task = datamodule.task  # checks data.main_metric against the task's metrics
    check_monitored_metrics(cfg, task)
    log.debug("Instantiating model <%s>", cfg.model._target_)
    init_head = cfg.get("init_head", "checkpoint")
    init = {"init_ckpt": str(cfg.init_ckpt), "init_head": init_head} if cfg.get("init_ckpt") else {}
    # The task shapes the model: head size (1 = regression), label names, metrics, evaluation splits.
    model = build(cfg.model, "model", _convert_="partial", **init, **task.model_overrides())
    check_max_length(model, cfg.data.get("max_length"))
    if init:
        checkpoint = read_checkpoint(init["init_ckpt"], "init_ckpt", mmap=True)
        check_compression(checkpoint, cfg.init_ckpt, "init_ckpt", cfg)
        state = checkpoint["state_dict"]
        if init_head == "new":  # the head is not loaded: another task's checkpoint is a start for this one
            state = without_task_head(state)
        else:
            check_label_count(state, task, cfg.init_ckpt, "init_ckpt")
        check_shapes(state, model, cfg.init_ckpt, "init_ckpt", structured=_prunes_structurally(cfg))
        # after the head size and shapes: a head of the same size trained for another task loads without error
        check_task(checkpoint, task, cfg.init_ckpt, "init_ckpt", cfg)
    callbacks = instantiate_callbacks(cfg)
    loggers = instantiate_loggers(cfg)
    # Checkpoints are written beside their target and renamed (never moved in from $TMPDIR).
    trainer: L.Trainer = build(
        cfg.trainer,
        "trainer",
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[AtomicCheckpointIO()],
        precision=_precision_choice(cfg, model),
    )
    if (
        str(trainer.precision).startswith("bf16")
        and isinstance(trainer.accelerator, CPUAccelerator)
        and native_bfloat16() is False
    ):
        log.warning(
            "trainer.precision=%s on a CPU without bfloat16 arithmetic (no AMX, AVX-512 BF16 or Arm BF16 in "
            "/proc/cpuinfo): autocast emulates it, likely slower than trainer.precision=32-true",
            trainer.precision,
        )
    if trainer.world_size > 1 and _is_multirun():
        raise ConfigError(
            f"trainer.devices={cfg.trainer.get('devices')}: a search trial runs in one process (Lightning's DDP "
            "re-runs the script for each rank, which would re-run the sweep); scale a search with several workers "
            "or hydra/launcher=parallel instead (docs/scale-out.md)"
        )
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), trainer)
    if ckpt_path is not None and ckpt_path != "best":
        checkpoint = read_checkpoint(ckpt_path, "ckpt_path", mmap=True)
        if cfg.get("train", True) and "loops" not in checkpoint:
            raise ConfigError(
                f"ckpt_path={ckpt_path}: holds model weights only (save_weights_only), no training state to "
                f"resume; start from its weights with init_ckpt={ckpt_path} instead"
            )
        check_compression(checkpoint, ckpt_path, "ckpt_path", cfg)
        check_label_count(checkpoint["state_dict"], task, ckpt_path, "ckpt_path")
        check_shapes(
            checkpoint["state_dict"], model, ckpt_path, "ckpt_path", structured=_prunes_structurally(cfg)
        )
        check_task(checkpoint, task, ckpt_path, "ckpt_path", cfg)
        # a light checkpoint (adapters and heads only) completes from this model's base: refused now if another
        complete_light_state(model, checkpoint, ckpt_path, "ckpt_path")
    # Last, the expensive part: tokenize the splits (cached), only as many rows as the trainer will use
    # (fast_dev_run, limit_*_batches: the debug presets); data problems still fail before anything is written.
    if isinstance(datamodule, TextDataModule):  # the project's data modules (another reads what it reads)
        datamodule.use_at_most(rows_used(trainer, datamodule.hparams.batch_size))
    datamodule.setup("fit")
    return datamodule, model, callbacks, loggers, trainer, ckpt_path


def check_monitored_metrics(cfg: DictConfig, task: Task) -> None:
    """``main_metric`` (what checkpoint selection and the compression callbacks monitor) is a validation metric
    the task logs, and ``optimized_metric`` (what a search optimises) one the run records, before any work:
    Lightning would stop with a traceback after the first validation, a search would get no value.

    Raises:
        ConfigError: naming the key and the metrics the task logs.
    """
    validation = [f"val/{name}" for name in task.metrics]
    main = cfg.get("main_metric")
    if main is not None and main not in validation:
        raise ConfigError(
            f"main_metric={main}: not a validation metric this task ({task.name}) logs; give one of "
            f"{', '.join(validation)} (or name one in data.main_metric: {', '.join(task.metrics)})"
        )
    optimized = cfg.get("optimized_metric")
    if optimized is None or optimized == main:
        return
    splits = ("val", *task.test_splits)
    recorded = [f"{split}/{name}" for split in splits for name in (*task.metrics, "loss")]
    # Other namespaces (params/, time/, quant/, prune/...) are the callbacks' reports, known only once they ran.
    if optimized not in recorded and (("/" not in str(optimized)) or str(optimized).split("/")[0] in splits):
        raise ConfigError(
            f"optimized_metric={optimized}: not a metric this run records; give one of {', '.join(recorded)}, "
            "or a callback's report (e.g. quant/avg_weight_bits)"
        )


#: What every run records of its model's storage, from :func:`weight_storage` of the model after its fit: an
#: uncompressed run has its 32 bits and fp32 size too, so ``adls-table`` compares a compressed row with its base in
#: those columns. A callback that stores the model otherwise while it evaluates (quantization, MXINT8 packing)
#: reports the same keys of the model it evaluated, which replace these.
STORAGE_KEYS = ("quant/avg_weight_bits", "quant/weight_bytes")


def storage_metrics(model: torch.nn.Module) -> dict[str, float]:
    """The model's :data:`STORAGE_KEYS`: bits per linear-layer weight and bytes to store."""
    storage = weight_storage(model)
    return {key: storage[key] for key in STORAGE_KEYS}


def rows_used(trainer: L.Trainer, batch_size: int | None) -> dict[str, int]:
    """How many rows of each split (``train``, ``val``, ``test``) the trainer can reach, where it is limited to a
    number of batches (``fast_dev_run``, an integer ``limit_<split>_batches``); a split left out reads all its rows.

    Each pass takes that many batches per device; training passes ``max_epochs`` times, each over batches drawn
    anew (no epoch limit: all rows). A fraction (``limit_val_batches=0.25``) is left to Lightning: a split cut
    to it would be cut once more by the trainer.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        return {}
    limits = {
        "train": trainer.limit_train_batches,
        "val": trainer.limit_val_batches,
        "test": trainer.limit_test_batches,
    }
    passes = {"train": trainer.max_epochs}
    rows = {}
    for split, limit in limits.items():
        if isinstance(limit, bool) or not isinstance(limit, int):  # a fraction, or all
            continue
        times = passes.get(split, 1)
        if times is None or times < 0:
            continue
        rows[split] = max(limit, 1) * batch_size * trainer.world_size * max(times, 1)
    return rows


def _prunes_structurally(cfg: DictConfig) -> bool:
    """The run's pruning callback gives the model a structurally pruned checkpoint's sizes (prune.structured)."""
    return bool(OmegaConf.select(cfg, "prune.structured", default=None))


def resolve_ckpt_path(ckpt_path: str | None, trainer: L.Trainer) -> str | None:
    """``last`` -> the newest last*.ckpt of the run's checkpoint callbacks (:func:`last_checkpoint`, which refuses
    when there is none)."""
    if ckpt_path != "last":
        return ckpt_path
    return str(
        last_checkpoint(cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None))
    )


def check_label_count(state: Mapping[str, torch.Tensor], task: Task, path: str, key: str) -> None:
    """Refuse a checkpoint whose classifier head has another number of outputs than the task has labels."""
    outputs = head_outputs(state)
    if outputs is not None and outputs != task.num_labels:
        wanted = "1 (a regression)" if task.is_regression else str(task.num_labels)
        hint = "; to start from its encoder with a new head, add init_head=new" if key == "init_ckpt" else ""
        raise ConfigError(
            f"{key}={path}: its classifier has {outputs} output(s), task {task.name} needs {wanted} "
            f"(a checkpoint of another task{hint})"
        )


def check_task(checkpoint: Mapping[str, Any], task: Task, path: str, key: str, cfg: DictConfig) -> None:
    """Refuse a checkpoint trained on another task where its classifier would be used for this one: ``ckpt_path=``,
    an evaluation-only run (``train=false``), or ``init_ckpt=`` without ``init_head=new``. A checkpoint of the same
    number of labels loads without error and scores like any other; only the recorded task tells."""
    recorded = checkpoint_task(checkpoint)
    if recorded is None or task.name == FolderDataModule.TASK_NAME or recorded == task.name:
        return
    where = f"{key}={path}: a {recorded} checkpoint, this run's task is {task.name}"
    if not cfg.get("train", True):
        raise ConfigError(
            f"{where}, and train=false evaluates its classifier, trained for {recorded}, on {task.name}; valid: a "
            f"checkpoint of {task.name} (or data= of {recorded} to evaluate it on its own task)"
        )
    if key == "ckpt_path":
        raise ConfigError(
            f"{where}; valid: a checkpoint of {task.name} to resume, or init_ckpt={path} init_head=new to start "
            "from its encoder with a new head"
        )
    if cfg.get("init_head", "checkpoint") != "new":
        raise ConfigError(
            f"{where}: its classifier was trained for {recorded}; to start from its encoder with a new head, add "
            "init_head=new"
        )


def check_compression(checkpoint: Mapping[str, Any], path: str, key: str, cfg: DictConfig) -> None:
    """Refuse, naming the preset to add, a checkpoint whose layers a compression changed (masks of a pruned run,
    quantized layers of a QAT or PTQ-evaluated one: its compression record says which) loaded into a run without
    that compression, whose layers its state cannot load into."""
    record = CompressionRecord.from_checkpoint(checkpoint, key)
    if record is None:
        return
    state = checkpoint.get("state_dict") or {}
    compress = cfg.get("compress") if isinstance(cfg.get("compress"), Mapping) else {}
    needs = []
    masked = any(".parametrizations.weight." in name for name in state)
    if record.pruning is not None and masked and not (_has_target(cfg.get("prune")) or compress.get("prune")):
        needs.append(("prune", "pruned", _preset_of(path, "prune", _pruning_preset(record.pruning.weight))))
    quantization = record.quantization
    applied = quantization is not None and quantization.applied and quantization.layers
    if applied and not (_has_target(cfg.get("quant")) or compress.get("quant")):
        needs.append(("quant", "quantized", _preset_of(path, "quant", None)))
    if not needs:
        return
    what = " and ".join(kind for _, kind, _ in needs)
    add = " ".join(preset or f"{group}=<its {group} preset>" for group, _, preset in needs)
    raise ConfigError(
        f"{key}={path}: a {what} checkpoint ({add}), and this run has no "
        f"{' or '.join(group + '=' for group, _, _ in needs)} to load its layers into; valid: add {add} to this "
        "run, or start from the checkpoint it was compressed from"
    )


def _has_target(node: Any) -> bool:
    return isinstance(node, Mapping) and "_target_" in node


def _pruning_preset(weight: Mapping[str, Any] | None) -> str | None:
    """``prune=<method>_<sparsity>`` when such a preset exists (the record's weight spec), else None."""
    if not weight or weight.get("pattern") or weight.get("sparsity") is None:
        return None
    name = f"{weight.get('method')}_{weight['sparsity']}"
    return f"prune={name}" if (CONF_DIR / "prune" / f"{name}.yaml").is_file() else None


def _preset_of(path: str, group: str, fallback: str | None) -> str | None:
    """The ``group=`` override (with its ``group.*`` ones) of the run that wrote the checkpoint at ``path``, read
    from its run record beside it; else ``fallback``."""
    try:
        overrides = run_overrides(Path(path))
    except ConfigError:
        overrides = []
    chosen = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") == group]
    if not chosen or chosen[-1].endswith("=none"):
        return fallback
    extra = [o for o in overrides if o.split("=", 1)[0].lstrip("+~").startswith(f"{group}.")]
    return " ".join([chosen[-1], *extra])


def check_max_length(model: torch.nn.Module, max_length: int | None) -> None:
    """``data.max_length`` within the model's position embeddings (beyond them the embedding lookup fails)."""
    config = getattr(getattr(model, "model", None), "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and isinstance(max_length, int) and max_length > limit:
        raise ConfigError(
            f"data.max_length={max_length}: above the model's {limit} positions (give at most {limit})"
        )


@contextmanager
def held_log_file():
    """Hold back the records of the run's log file until the run's checks passed (a refused run writes nothing).

    Yields a ``release()`` that writes the held records to the file handlers and lets later ones through.
    """
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    held = [
        logging.handlers.MemoryHandler(capacity=10**6, flushLevel=logging.CRITICAL + 1, target=h)
        for h in files
    ]
    for file_handler, memory in zip(files, held):
        memory.setLevel(file_handler.level)
        memory.setFormatter(file_handler.formatter)
        root.removeHandler(file_handler)
        root.addHandler(memory)

    def release() -> None:
        for file_handler, memory in zip(files, held):
            root.removeHandler(memory)
            memory.flush()
            root.addHandler(file_handler)
        held.clear()

    try:
        yield release
    finally:
        for file_handler, memory in zip(files, held):  # refused: drop what was held, restore the handlers
            root.removeHandler(memory)
            memory.buffer.clear()
            root.addHandler(file_handler)


def _fit_and_record(cfg, datamodule, model, callbacks, loggers, trainer, ckpt_path) -> dict[str, float | str]:
    output_dir = Path(cfg.paths.output_dir)
    metrics: dict[str, float | str] = {}
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    try:
        start = time.perf_counter()
        if cfg.get("train", True):
            trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
            metrics.update(_float_metrics(trainer.callback_metrics))
        metrics["time/fit_s"] = time.perf_counter() - start
        if cfg.get("train", True):
            best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
            if not best:
                log.warning("No best checkpoint found: evaluating the current weights")
        else:  # evaluation only: the given checkpoint, or the initial weights
            best = ckpt_path or ""
        ckpt = best or None
        log.info("Evaluating %s", f"the checkpoint {ckpt}" if ckpt else "the current weights")
        trainer.validate(model, datamodule=datamodule, ckpt_path=ckpt, verbose=False)
        metrics.update(_float_metrics(trainer.callback_metrics))
        # Counted now, after the callbacks' setup (quantization, LoRA merge, train_base) shaped the model.
        metrics.update(parameter_metrics(model))
        metrics.update(storage_metrics(model))
        if cfg.get("test", True):
            trainer.test(model, datamodule=datamodule, ckpt_path=ckpt, verbose=False)
            metrics.update(_float_metrics(trainer.callback_metrics))
        for callback in callbacks:
            if isinstance(callback, Reporter):
                metrics.update(_float_metrics(callback.report()))
        metrics["time/total_s"] = time.perf_counter() - start
        metrics.pop("train/loss_step", None)
        # what the run computed in (auto's choice, Lightning's spelling of a value given): adls-table's column
        metrics[PRECISION_KEY] = str(trainer.precision)
        if trainer.is_global_zero:  # DDP: one metrics.json (metrics are synced across ranks by torchmetrics)
            atomic_write_json(output_dir / METRICS_FILE, metrics)
        for logger in loggers:
            logger.log_metrics({f"final/{k}": v for k, v in metrics.items() if k != PRECISION_KEY})
    finally:
        places = []  # where the loggers keep the run, for the summary's last lines
        for logger in loggers:
            if isinstance(logger, WandbLogger):
                if place := wandb_location(logger.experiment):
                    places.append(place)
                logger.experiment.finish()
    if trainer.is_global_zero:
        print_summary(metrics, output_dir, datamodule.task, places)
    return metrics


def _precision_choice(cfg: DictConfig, model: torch.nn.Module) -> str | int:
    """``trainer.precision`` resolved for this run, once, before the trainer is built: ``auto`` measures on a CPU
    run only (docs/precision.md) and means ``32-true`` on a GPU or other accelerator; any other value unchanged."""
    precision = cfg.trainer.get("precision", "32-true")
    if precision != "auto":
        return precision
    if not _runs_on_cpu(cfg.trainer.get("accelerator", "auto")):
        log.info(
            "trainer.precision=auto: 32-true (not a CPU run: give a GPU preset, e.g. trainer=gpu, for bf16)"
        )
        return "32-true"
    quant = cfg.get("quant")
    if isinstance(quant, Mapping) and "_target_" in quant:
        # fake quantization stands for the integer model only in fp32: under bf16 the quantized weights and
        # activations are rounded once more, off the grid the export computes (make-train MiniLM, int8_scaled PTQ:
        # test/acc 0.8665 evaluated in bf16, 0.8710 in fp32, the exported int8 graph 0.8715; docs/precision.md)
        log.info(
            "trainer.precision=auto: 32-true (the run quantizes: its fake quantizers simulate the integer model in "
            "fp32, which bf16 would round off the grid; trainer.precision=bf16-mixed to train in bf16 anyway)"
        )
        return "32-true"
    return choose_precision(precision, model, batch_rows(cfg.data), cfg.paths.get("cache_dir"))


def _runs_on_cpu(accelerator: object) -> bool:
    """Whether Lightning's ``accelerator`` setting (a name or an accelerator) puts the run on the CPU."""
    return isinstance(accelerator, CPUAccelerator) or runs_on_cpu(accelerator)


def _gemm_choice(cfg: DictConfig, model: torch.nn.Module, trainer: L.Trainer) -> str:
    """``runtime.gemm`` resolved for this run: ``auto`` times the backends on a CPU run only (the routing touches
    CPU tensors only) and keeps aten under ``torch.compile`` (it traces aten's linear and fuses around it)."""
    backend = OmegaConf.select(cfg, "runtime.gemm", default="auto")
    compiled = isinstance(cfg.get("compile"), Mapping) and "_target_" in cfg.compile
    if backend == "auto" and (trainer.strategy.root_device.type != "cpu" or compiled):
        return "aten"
    return choose_gemm(backend, model, batch_rows(cfg.data), cfg.paths.get("cache_dir"))


def print_summary(
    metrics: Mapping[str, float], output_dir: Path, task: Task | None = None, elsewhere: Sequence[str] = ()
) -> None:
    """A short, human-readable summary of the run: the task's metrics (main metric first), sizes, times; then
    the run folder and ``elsewhere``'s lines (where a logger keeps the run)."""
    from rich.console import Console
    from rich.table import Table

    # The folder goes below the table, not in its title: Rich wraps a title inside the table's width.
    # No outer edge: the column rule alone separates names from values, two lines fewer of the run's output.
    table = Table(
        title="Run summary" + (f" ({task.name})" if task else ""), show_header=False, show_edge=False
    )
    names = task.metrics if task is not None else ("acc", "f1")
    splits = ("val", *(task.test_splits if task is not None else ("test",)))
    rows = [
        *((f"{split}/{name}", f"{split} {name}", "{:.4f}") for split in splits for name in names),
        ("params/trainable", "trainable params", "{:,.0f}"),
        ("params/total", "total params", "{:,.0f}"),
        ("train/samples_per_sec", "train samples/s", "{:.1f}"),
        ("time/fit_s", "fit wall time (s)", "{:.1f}"),
        ("time/total_s", "total wall time (s)", "{:.1f}"),
    ]
    for key, label, fmt in rows:
        if key in metrics:
            shown = fmt.format(metrics[key])
            if math.isnan(metrics[key]) and key.endswith(("/pearson", "/spearman")):
                # torchmetrics' correlation of predictions that do not vary (a collapsed regression head)
                shown += " (the predictions do not vary)"
            table.add_row(label, shown)
    extra = sorted(
        k for k in metrics if k.split("/")[0] in ("quant", "prune", "ptq", "compress", "mxint8", "compile")
    )
    for key in extra:
        table.add_row(key, f"{metrics[key]:.4g}")
    console = Console(stderr=False)
    console.print(table)
    console.print(f"Run folder: {output_dir}", soft_wrap=True, highlight=False)
    for line in elsewhere:
        console.print(line, soft_wrap=True, highlight=False)


@contextmanager
def one_line_errors():
    """Turn a ConfigError into one line on stderr and exit code 2 (single runs only).

    In a multirun the error propagates, so the sweeper records the job (trial) as failed and goes on. A single
    run's folder, made by Hydra before the task started, goes again when the refusal left nothing of value in it
    (:func:`~adls_lightning.runs.folder.remove_unused_run_folder`): a refused run leaves nothing behind.
    """
    folder = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None
    at_start = entries(folder) if folder is not None else None
    try:
        yield
    except ConfigError as err:
        if _is_multirun():
            raise
        if folder is not None:
            remove_unused_run_folder(folder, at_start)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
