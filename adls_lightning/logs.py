"""One clean console log for a run: each line once, no adverts, and the notices a user cannot act on kept out.

Hydra's job logging owns the console and the run's log file (``conf/hydra/default.yaml``): it is the handler that
also writes ``<run dir>/<task>.log``, held back until a run's checks pass. Lightning adds a console handler of its
own when imported (``lightning/__init__.py``), which printed every Lightning line a second time; :func:`configure`
takes it off, so Lightning's records go through Hydra's handlers once.

Everything this project silences is listed here, in one place, each with the reason. Detail comes back with the
``debug=`` presets (they set the root logger to DEBUG) or ``hydra.verbose=true``: then nothing is filtered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

# Lightning's informational lines (``rank_zero_info``) that are dropped, by how they start, and why.
LIGHTNING_NOTICES: tuple[tuple[str, str], ...] = (
    ("💡 Tip:", "an advert for Lightning's hosted services, shown on every run"),
    ("TPU available:", "this project runs on CPUs and CUDA GPUs; the GPU line stays"),
    ("HPU available:", "this project runs on CPUs and CUDA GPUs; the GPU line stays"),
    # A machine without a GPU has nothing to act on; "GPU available: True, used: False" (a GPU left idle) stays.
    ("GPU available: False, used: False", "no GPU on this machine, none asked for"),
    (
        "`Trainer(val_check_interval=1.0)` was configured",
        "restates Lightning's default (validate once per epoch)",
    ),
    (
        "Loading `train_dataloader` to estimate",
        "Lightning counting the steps for the LR schedule, nothing to do",
    ),
    # Both said twice (validation, then test); training.py says once which checkpoint is evaluated.
    ("Restoring states from the checkpoint path", "training.py names the evaluated checkpoint once"),
    ("Loaded model weights from the checkpoint at", "training.py names the evaluated checkpoint once"),
    ("`Trainer.fit` stopped:", "the last progress line already shows the final step and epoch"),
)
# Lightning logs its notices through these loggers (``rank_zero_info`` / ``rank_zero_warn``).
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")

# Python warnings raised inside libraries, by message, and why the user cannot act on them.
LIBRARY_WARNINGS: tuple[tuple[str, str], ...] = (
    (
        r"`is_gradient_checkpointing` is deprecated",
        "peft reads the deprecated transformers attribute when it wraps the model (a peft matter)",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "Lightning's own use of a torch.utils._pytree API deprecated by the installed torch",
    ),
)

# W&B's terminal output: a run header and a history/summary footer (about 30 lines; 3 with WANDB_QUIET) that
# repeat the run's summary table. Silenced; the summary's last line says where W&B keeps the run instead
# (:func:`wandb_location`). WANDB_SILENT=false in the environment brings W&B's own lines back.
WANDB_SILENT_ENV = "WANDB_SILENT"


class DropNotices(logging.Filter):
    """Drops records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def is_verbose(hydra_verbose: object = False) -> bool:
    """Whether the user asked for detail: ``hydra.verbose`` set, or the root logger at DEBUG (``debug=`` presets)."""
    return bool(hydra_verbose) or logging.getLogger().getEffectiveLevel() <= logging.DEBUG


def is_terminal() -> bool:
    """Whether the console is an interactive terminal, as Rich decides it (``FORCE_COLOR``/``TTY_*`` honoured)."""
    from rich.console import Console

    return Console().is_terminal


def one_console_handler() -> None:
    """Take Lightning's own console handlers off when Hydra's job logging is in place (root has handlers).

    ``lightning`` adds a ``StreamHandler`` at import; ``lightning.pytorch`` / ``lightning.fabric`` add one and stop
    propagation when imported before any root handler exists (the up-front config check may import them).
    """
    import lightning  # noqa: F401  (the import is what adds the handler taken off here)

    if not logging.getLogger().handlers:  # hydra/job_logging=none: Lightning's handler is the only console
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True


def configure(hydra_verbose: object = False) -> None:
    """The run's console: one handler (Hydra's), and unless verbose, the notices above silenced.

    Called by the entry points' tasks once Hydra has configured logging; calling it again changes nothing.
    """
    one_console_handler()
    if is_verbose(hydra_verbose):
        return
    notices = DropNotices(tuple(prefix for prefix, _ in LIGHTNING_NOTICES))
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropNotices) for f in logger.filters):
            logger.addFilter(notices)
    os.environ.setdefault(WANDB_SILENT_ENV, "true")
    configure_tool()


def configure_tool() -> None:
    """What a command-line tool without Hydra's job (export, evaluate) shares with a run's console: the library
    warnings the user cannot act on silenced, and no redrawn progress bars where there is no terminal."""
    quiet_library_warnings()
    quiet_progress_bars()


def quiet_progress_bars(transformers_too: bool = True) -> None:
    """No redrawn progress bars of ``datasets`` (and transformers) where there is no terminal.

    A library not yet imported is told through its environment variable, read when it is imported: a tool that
    answers ``--help`` or refuses an option does not pay seconds of imports for it. The pre-flight check reads a
    run's data files before the run's console is set up: it quiets ``datasets`` only.
    """
    if is_terminal():
        return
    # Progress bars redrawn with carriage returns are one garbled line each in a file or a pipe; the project
    # logs what it tokenizes and loads instead (and adls_lightning/callbacks/progress.py prints timed progress lines).
    loaded = sys.modules
    if "datasets" in loaded:
        loaded["datasets"].disable_progress_bars()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported
    if not transformers_too:
        return
    if "transformers" in loaded:
        loaded["transformers"].utils.logging.disable_progress_bar()
    else:  # transformers takes huggingface_hub's switch when it is imported (tests/test_logs.py, either order)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def quiet_library_warnings() -> None:
    """Silence :data:`LIBRARY_WARNINGS` (also for the command-line tools that run without Hydra's job)."""
    for pattern, _ in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def wandb_location(run: object) -> str | None:
    """One line saying where W&B keeps ``run`` (a ``wandb`` run): its page online; offline, its folder and the
    command that uploads it. None for anything else."""
    settings = getattr(run, "settings", None)
    if getattr(run, "offline", False) and getattr(settings, "sync_dir", None):
        return f"W&B run (offline): {settings.sync_dir} (upload: wandb sync {settings.sync_dir})"
    url = getattr(run, "url", None)
    return f"W&B run: {url}" if url else None


def drop_unset_wandb_settings(logger: object) -> None:
    """Lightning's ``WandbLogger`` always passes ``anonymous=None`` to ``wandb.init``, and W&B warns on every run
    that the setting has no effect; the user never set it, so the unset key is not passed."""
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and init.get("anonymous") is None:
        init.pop("anonymous", None)


@contextlib.contextmanager
def quiet_transformers_load(log: logging.Logger) -> Iterator[None]:
    """Around ``from_pretrained``: no load-report table or weight-loading bar (the caller logs one line of its
    own about the new head); left as transformers prints them when ``log`` is at DEBUG."""
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
