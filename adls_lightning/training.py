"""The training task: compose objects from a Hydra config, fit, evaluate the best checkpoint, record metrics.

``train.py`` and ``search.py`` are thin shells over :func:`run`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from adls_lightning.build import build
from adls_lightning.config import ConfigError, validate_run_config
from adls_lightning.io_utils import atomic_write_json
from adls_lightning.module import parameter_metrics
from adls_lightning.runtime import keep_freed_memory

log = logging.getLogger(__name__)

# Config groups whose preset builds one callback each, appended after ``cfg.callbacks`` in this order:
# quantize first, then prune the (possibly quantized) layers, then compress, then compile the result.
COMPRESSION_GROUPS = ("quant", "prune", "compress", "compile")
METRICS_FILE = "metrics.json"


def instantiate_callbacks(cfg: DictConfig) -> list[L.Callback]:
    """Callbacks from ``cfg.callbacks`` (dict order) followed by the compression groups that are set."""
    leaves: list[tuple[str, Any]] = [(f"callbacks.{k}", v) for k, v in (cfg.get("callbacks") or {}).items()]
    leaves += [(group, cfg.get(group)) for group in COMPRESSION_GROUPS]
    callbacks = []
    for name, leaf in leaves:
        if isinstance(leaf, Mapping) and "_target_" in leaf:
            log.info("Instantiating callback %s <%s>", name, leaf["_target_"])
            callbacks.append(build(leaf, name, _convert_="partial"))
    return callbacks


def instantiate_loggers(cfg: DictConfig) -> list[Logger]:
    """Loggers from ``cfg.logger`` (a dict of ``_target_`` leaves; empty for ``logger=none``)."""
    loggers = []
    for name, leaf in (cfg.get("logger") or {}).items():
        if isinstance(leaf, Mapping) and "_target_" in leaf:
            log.info("Instantiating logger %s <%s>", name, leaf["_target_"])
            extra = {}
            if leaf["_target_"].endswith("WandbLogger") and not leaf.get("group") and _is_multirun():
                # One W&B group per sweep, so a multirun's jobs sit together in the UI.
                extra["group"] = Path(HydraConfig.get().sweep.dir).name
            loggers.append(build(leaf, f"logger.{name}", **extra))
    return loggers


def _is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def check_output_dir(output_dir: Path, cfg: DictConfig) -> None:
    """Refuse to start a fresh run in a folder that already holds a finished run or checkpoints.

    Raises:
        ConfigError: unless resuming (``ckpt_path``) or ``overwrite=true``.
    """
    if cfg.get("ckpt_path") or cfg.get("overwrite"):
        return
    earlier = [p for p in (output_dir / METRICS_FILE, output_dir / "checkpoints") if p.exists()]
    if earlier:
        raise ConfigError(
            f"hydra.run.dir={output_dir}: holds an earlier run ({earlier[0].name}); choose another hydra.run.dir, "
            "resume it with ckpt_path=last, or pass overwrite=true"
        )


def _float_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value) if isinstance(value, float) else value
    return out


def run(cfg: DictConfig) -> dict[str, float]:
    """Fit, then validate and test the best checkpoint; write ``metrics.json`` into ``cfg.paths.output_dir``.

    Returns:
        The recorded metrics (``val/acc``, ``test/acc``, ``params/trainable``, ... and callbacks' reports).
    """
    validate_run_config(OmegaConf.to_container(cfg, resolve=True))
    output_dir = Path(cfg.paths.output_dir)
    check_output_dir(output_dir, cfg)
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.get("keep_freed_memory", True) and not keep_freed_memory():
        log.info("keep_freed_memory: not available on this platform (glibc malloc only)")

    log.info("Instantiating datamodule <%s>", cfg.data._target_)
    datamodule = build(cfg.data, "data")
    datamodule.setup("fit")  # fail fast on data problems, before the model is built
    log.info("Instantiating model <%s>", cfg.model._target_)
    init = {"init_ckpt": str(cfg.init_ckpt)} if cfg.get("init_ckpt") else {}
    model = build(cfg.model, "model", _convert_="partial", **init)
    callbacks = instantiate_callbacks(cfg)
    loggers = instantiate_loggers(cfg)
    trainer: L.Trainer = build(cfg.trainer, "trainer", callbacks=callbacks, logger=loggers or False)

    metrics: dict[str, float] = {}
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    try:
        start = time.perf_counter()
        if cfg.get("train", True):
            trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            metrics.update(_float_metrics(trainer.callback_metrics))
        metrics["time/fit_s"] = time.perf_counter() - start
        if cfg.get("train", True):
            best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
            if not best:
                log.warning("No best checkpoint found: evaluating the current weights")
        else:  # evaluation only: the given checkpoint, or the initial weights
            best = cfg.get("ckpt_path") or ""
        ckpt = best or None
        trainer.validate(model, datamodule=datamodule, ckpt_path=ckpt, verbose=False)
        metrics.update(_float_metrics(trainer.callback_metrics))
        # Counted now, after the callbacks' setup (quantization, LoRA merge, train_base) shaped the model.
        metrics.update(parameter_metrics(model))
        if cfg.get("test", True):
            trainer.test(model, datamodule=datamodule, ckpt_path=ckpt, verbose=False)
            metrics.update(_float_metrics(trainer.callback_metrics))
        for callback in callbacks:
            if callable(getattr(callback, "report", None)):
                metrics.update(_float_metrics(callback.report()))
        metrics["time/total_s"] = time.perf_counter() - start
        metrics.pop("train/loss_step", None)
        atomic_write_json(output_dir / METRICS_FILE, metrics)
        for logger in loggers:
            logger.log_metrics({f"final/{k}": v for k, v in metrics.items()})
    finally:
        for logger in loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.finish()
    print_summary(metrics, output_dir)
    return metrics


def print_summary(metrics: Mapping[str, float], output_dir: Path) -> None:
    """A short, human-readable summary of the run."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Run summary ({output_dir})", show_header=False)
    rows = [
        ("val/acc", "val accuracy", "{:.4f}"),
        ("test/acc", "test accuracy", "{:.4f}"),
        ("test/f1", "test F1", "{:.4f}"),
        ("params/trainable", "trainable params", "{:,.0f}"),
        ("params/total", "total params", "{:,.0f}"),
        ("train/samples_per_sec", "train samples/s", "{:.1f}"),
        ("time/fit_s", "fit wall time (s)", "{:.1f}"),
        ("time/total_s", "total wall time (s)", "{:.1f}"),
    ]
    for key, label, fmt in rows:
        if key in metrics:
            table.add_row(label, fmt.format(metrics[key]))
    extra = sorted(k for k in metrics if k.split("/")[0] in ("quant", "prune", "ptq", "compress", "mxint8"))
    for key in extra:
        table.add_row(key, f"{metrics[key]:.4g}")
    Console(stderr=False).print(table)


@contextmanager
def one_line_errors():
    """Turn a ConfigError into one line on stderr and exit code 2 (single runs only).

    In a multirun the error propagates, so the sweeper records the job (trial) as failed and goes on.
    """
    try:
        yield
    except ConfigError as err:
        if _is_multirun():
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
