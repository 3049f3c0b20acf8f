"""Up-front validation of a composed run config, so bad input fails before any training starts or file is written.

:func:`preflight` wraps the entry points: it checks every target and value of the config Hydra composes, as the
composition returns (the config is composed once), and turns a refusal into one line on stderr and exit code 2 --
before Hydra instantiates its callbacks or writes anything into a run folder. Objects check their own arguments (the data
module its ``data.*`` keys, the sweeper its ``hydra.sweeper.*``); this module checks only what no object owns.
A single run's input files (local data, checkpoints) are then read by the same library functions the run calls
(:func:`check_run_inputs`), so a bad file is refused before torch or Lightning is imported.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from adls_lightning.configs import group_presets
from adls_lightning.data.settings import check_loader_settings
from adls_lightning.data.tasks import REGRESSION_BIAS_INITS, check_swappable
from adls_lightning.errors import (
    ConfigError,
    informational_flags,
    refusing_in_one_line,
    require_choice,
    require_fraction,
    require_positive_int,
    require_positive_number,
)
from adls_lightning.errors import exit_with as exit_with
from adls_lightning.runs.folder import check_output_dir as check_output_dir
from adls_lightning.runtime import EVAL_PRECISIONS, GEMM_BACKENDS


def _get(cfg: Mapping, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


# Every `trainer.precision` value Lightning accepts (its `_PRECISION_INPUT` type, in its order): listed here so a
# refusal does not import Lightning (10 s on a 2-core machine) to read it; tests/test_bad_input.py checks the list
# against the installed Lightning's type.
LIGHTNING_PRECISIONS = (
    64, 32, 16,
    "transformer-engine", "transformer-engine-float16",
    "16-true", "16-mixed", "bf16-true", "bf16-mixed", "32-true", "64-true",
    "64", "32", "16", "bf16",
)  # fmt: skip
# This project's own value (adls_lightning.precision): resolved per run before the trainer is built.
AUTO_PRECISION = "auto"
# Lightning's spellings of fp16 autocast, which it swaps for bf16-mixed on a CPU with a warning only
FP16_AUTOCAST = (16, "16", "16-mixed")
# The values that compute on a CPU as they read
CPU_PRECISIONS = (AUTO_PRECISION, "32-true", "bf16-mixed")


def validate_trainer(trainer: Mapping) -> None:
    """``trainer.precision`` among Lightning's values and ``trainer.accelerator`` present on this machine."""
    precision = trainer.get("precision")
    import importlib.util

    # Lightning's Transformer Engine values need NVIDIA's package; without it Lightning raises a traceback
    engine = importlib.util.find_spec("transformer_engine") is not None
    usable = [str(v) for v in LIGHTNING_PRECISIONS if engine or not str(v).startswith("transformer-engine")]
    if precision is not None and str(precision).startswith("transformer-engine") and not engine:
        raise ConfigError(
            f"trainer.precision={precision}: needs NVIDIA Transformer Engine (the transformer_engine package), "
            f"not installed here; valid: auto, {', '.join(dict.fromkeys(usable))}"
        )
    if precision is not None and precision != AUTO_PRECISION and precision not in LIGHTNING_PRECISIONS:
        raise ConfigError(
            f"trainer.precision={precision!r}: must be one of auto, " + ", ".join(dict.fromkeys(usable))
        )
    accelerator = trainer.get("accelerator")
    if isinstance(accelerator, str):
        _check_accelerator(accelerator)
    # Lightning (its own default accelerator: auto) would train such a run in bf16, saying so in a warning only
    if precision in FP16_AUTOCAST and runs_on_cpu("auto" if accelerator is None else accelerator):
        raise ConfigError(
            f"trainer.precision={precision}: fp16 autocast does not run on a CPU (Lightning would train in "
            f"bf16-mixed instead); on a CPU give one of {', '.join(CPU_PRECISIONS)} "
            "(16-mixed needs a GPU: trainer=gpu)"
        )


def runs_on_cpu(accelerator: object) -> bool:
    """Whether Lightning's ``accelerator`` setting (a name) puts the run on the CPU (``auto``: when no GPU is
    present)."""
    if accelerator == "cpu":
        return True
    if accelerator != "auto":
        return False
    import torch  # asked only here: 2 s to import

    return not torch.cuda.is_available() and not torch.backends.mps.is_available()


def _check_accelerator(accelerator: str) -> None:
    """``trainer.accelerator`` a name Lightning knows, and its device present on this machine."""
    known = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
    if accelerator not in known:
        raise ConfigError(f"trainer.accelerator={accelerator!r}: must be one of {', '.join(known)}")
    if accelerator not in ("gpu", "cuda", "mps"):
        return  # torch (2 s to import) is asked only about the devices it must find
    import torch

    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={accelerator}: no CUDA GPU on this machine "
            "(use trainer=cpu, or trainer.accelerator=auto to take a GPU when there is one)"
        )
    if accelerator == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("trainer.accelerator=mps: no Apple GPU on this machine (use trainer=cpu)")


class Problems:
    """Collects the ConfigErrors of independent checks, so a refusal names every problem at once:
    ``with problems.check(): ...`` per check, then :meth:`raise_all`."""

    def __init__(self) -> None:
        self.found: list[str] = []

    @contextlib.contextmanager
    def check(self) -> typing.Iterator[None]:
        try:
            yield
        except ConfigError as err:
            self.found.append(str(err))

    def raise_all(self) -> None:
        """Raise one ConfigError naming every problem found (``; ``-separated), if any."""
        if self.found:
            raise ConfigError("; ".join(dict.fromkeys(self.found)))


def validate_model_settings(cfg: Mapping) -> None:
    """Check the ``model.*`` settings of a composed config that no object checks itself (what ``train.py``'s
    pre-flight checks of them): for a command that builds the model without training it (``adls_lightning.graph``).

    Raises:
        ConfigError: naming every offending key.
    """
    problems = Problems()
    _check_model_settings(cfg, problems)
    problems.raise_all()


def _check_model_settings(cfg: Mapping, problems: Problems) -> None:
    lora = _get(cfg, "model.lora")
    if lora:
        with problems.check():
            require_positive_int("model.lora.r", lora.get("r"))
        with problems.check():
            require_fraction("model.lora.lora_dropout", lora.get("lora_dropout", 0.0))
    optimizer = _get(cfg, "model.optimizer") or {}
    with problems.check():
        require_positive_number("model.optimizer.lr", optimizer.get("lr"), allow_none=True)
    with problems.check():
        require_positive_number("model.merged_lr", _get(cfg, "model.merged_lr"), allow_none=True)
    missing = object()
    for flag in ("model.merge_lora_before_compress", "model.freeze_embeddings"):
        value = _get(cfg, flag, missing)
        if value is not missing and not isinstance(value, bool):
            problems.found.append(f"{flag}={value!r}: must be true or false")
    with problems.check():
        require_fraction("model.warmup_ratio", _get(cfg, "model.warmup_ratio", 0.0))
    with problems.check():
        require_choice("model.eval_precision", _get(cfg, "model.eval_precision", "auto"), EVAL_PRECISIONS)
    with problems.check():
        require_choice(
            "model.regression_bias_init",
            _get(cfg, "model.regression_bias_init", "mean"),
            REGRESSION_BIAS_INITS,
        )


def validate_run_config(cfg: Mapping) -> None:
    """Check the values of a composed ``train.yaml`` config that no object checks itself.

    Unknown keys are already rejected by Hydra (``Key 'x' is not in struct``); of ``data.*``, the loader settings
    are checked here and the data itself by the data module when it is built (before anything is written; a single
    run's local files are read before that by :func:`check_run_inputs`).

    Raises:
        ConfigError: naming every offending key.
    """
    problems = Problems()
    data = cfg.get("data") or {}
    # the loader settings of the project's own data modules (another _target_ checks its own arguments)
    if str(data.get("_target_", "")).startswith("adls_lightning.data."):
        with problems.check():
            check_loader_settings(data)
        # a one-way GLUE task refused here, before a search starts trials that would each fail on it
        if data.get("swap_pairs") is True and data.get("task") is not None:
            with problems.check():
                check_swappable(str(data.get("task")))
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
        problems.found.append(f"seed={seed!r}: must be an integer in [0, 2**32) or null")
    trainer = cfg.get("trainer") or {}
    with problems.check():
        require_positive_int("trainer.max_epochs", trainer.get("max_epochs"))
    with problems.check():
        validate_trainer(trainer)
    _check_model_settings(cfg, problems)
    with problems.check():
        require_choice("runtime.gemm", _get(cfg, "runtime.gemm", "auto"), GEMM_BACKENDS)
    with problems.check():  # callback_order names config nodes
        callback_nodes(cfg)
    init_head = cfg.get("init_head", "checkpoint")
    with problems.check():
        require_choice("init_head", init_head, ("checkpoint", "new"))
    if init_head == "new" and not cfg.get("init_ckpt"):
        problems.found.append(
            "init_head=new: replaces the head of an init_ckpt model; give init_ckpt=<a .ckpt path>"
        )
    for key, path in checkpoint_files(cfg):
        from adls_lightning.checkpoints import check_checkpoint_file, missing_checkpoint

        if not Path(str(path)).is_file():
            valid = "a .ckpt path, 'last', or null" if key == "ckpt_path" else "a .ckpt path or null"
            problems.found.append(str(missing_checkpoint(path, key, valid)))
            continue
        with problems.check():
            check_checkpoint_file(path, key)
    problems.raise_all()


def callback_nodes(cfg: Mapping) -> list[tuple[str, Mapping]]:
    """``(key, node)`` of every callback a run config builds, in the order ``callback_order`` names their nodes: a
    dict of leaves (``callbacks``, in its dict order) or a config group whose preset is one leaf (``quant``,
    ``prune``...); an empty node builds none. The run builds them in this order; the pre-flight check reads the
    checkpoint folders (``dirpath``) among their settings.

    Raises:
        ConfigError: ``callback_order`` names a key that is not a config node.
    """
    order = cfg.get("callback_order") or []
    unknown = next((name for name in order if name not in cfg), None)
    if unknown is not None:
        raise ConfigError(
            f"callback_order: {unknown!r} is not a config node (give top-level keys, e.g. [callbacks, quant])"
        )
    leaves: list[tuple[str, Any]] = []
    for node_name in order:
        node = cfg.get(node_name)
        if isinstance(node, Mapping) and "_target_" not in node:
            leaves += [(f"{node_name}.{k}", v) for k, v in node.items()]
        else:
            leaves.append((node_name, node))
    built = [(key, leaf) for key, leaf in leaves if isinstance(leaf, Mapping) and "_target_" in leaf]
    for key, leaf in leaves:
        if leaf is not None and (key, leaf) not in built:
            # said, not refused: a multirun's baseline job (quant=none,int8 ++quant.mode=ptq) carries the others'
            # settings on purpose; Python shows each message once per process
            group = key.partition(".")[0]
            holds_callbacks = any(k.startswith(f"{group}.") for k, _ in built)
            warnings.warn(unread_setting_line(key, leaf, holds_callbacks), stacklevel=2)
    return built


def unread_setting_line(key: str, value: Any, holds_callbacks: bool) -> str:
    """What a setting under a callback node that builds nothing is told: a group without a preset chosen
    (``+compile.backend=aot_eager`` with ``compile=none``), or a leaf beside callbacks (``holds_callbacks``: a
    ``callbacks`` leaf that is no callback), is read by nothing, and the run goes on without it."""
    group, _, _ = key.partition(".")
    presets = group_presets(group)
    if presets and not holds_callbacks:
        return (
            f"{key}={value}: no {group}= preset is chosen, so nothing reads this setting (the run goes on without "
            f"it); to use it, choose one (valid: {', '.join(f'{group}={p}' for p in presets)})"
        )
    return (
        f"{key}={value}: not a callback, so nothing reads it (a leaf of {group} is a node with _target_, or null "
        "to turn it off)"
    )


#: The project's callbacks (quantization, pruning, compression, compile, ...): their settings' types are checked here.
PROJECT_CALLBACKS = "adls_lightning.callbacks."


def check_callback_settings(job: Any, key: str = "") -> None:
    """The type of every setting of every node that builds one of the project's callbacks (``quant``, ``prune``,
    ``compress``, ``compile``, entries of ``callbacks``), against the callback's constructor's annotations and the
    schemas they name (:mod:`adls_lightning.typed_settings`): a wrong type is one line naming its full key
    (``quant.gptq.batches``) before anything is built or written, not a ``TypeError`` inside the constructor.

    The class is found as the guarded builder finds it (:func:`~adls_lightning.build.check_resolved_target` first),
    so this module names no callback.

    Raises:
        ConfigError: naming the first offending key.
    """
    if not key:
        from adls_lightning.registry import import_config_plugins

        # the entries plugins register (a format, a pruning method) are named in the settings checked below
        import_config_plugins(job)
    if isinstance(job, Mapping):
        from adls_lightning.build import current_target

        target = current_target(job.get("_target_"))
        if isinstance(target, str) and target.startswith(PROJECT_CALLBACKS):
            from adls_lightning.build import check_resolved_target, resolve_target
            from adls_lightning.typed_settings import check_call

            where = f"{key}._target_" if key else "_target_"
            check_resolved_target(where, target)
            check_call(key, resolve_target(target), job)
            return
        for name, value in job.items():
            check_callback_settings(value, f"{key}.{name}" if key else str(name))
    elif isinstance(job, list):
        for index, value in enumerate(job):
            check_callback_settings(value, f"{key}[{index}]")


def checkpoint_files(cfg: Mapping) -> Iterator[tuple[str, Any]]:
    """``(key, path)`` of each checkpoint file a run config names: ``init_ckpt``, and ``ckpt_path`` unless it is
    ``last`` or ``best`` (found by the run)."""
    for key in ("init_ckpt", "ckpt_path"):
        path = cfg.get(key)
        if path is not None and not (key == "ckpt_path" and path in ("last", "best")):
            yield key, path


def check_run_inputs(job: Mapping) -> None:
    """A single run's input files, read and checked as the run reads them, before it imports Lightning: the data
    module's local splits (:func:`~adls_lightning.data.sources.check_local_data`; the run then takes them from
    this process's cache), the checkpoints' contents (the guarded reader, tensors mapped, not read: a plain
    tensor, a hostile pickle or a file that is not Lightning's is refused here) and, for ``ckpt_path=last``, that
    a ``last*.ckpt`` is there to resume (in the folders of the callbacks that set a ``dirpath``: the run's
    checkpoint callbacks are among them). Whether a checkpoint fits the model is the run's check, once the model
    is built.

    Not for a multirun: its jobs may sweep the data keys, and each job checks its own when built.

    Raises:
        ConfigError: naming every problem found.
    """
    problems = Problems()
    data = job.get("data") or {}
    if str(data.get("_target_", "")).startswith("adls_lightning.data."):
        from adls_lightning.data.sources import check_local_data
        from adls_lightning.logs import quiet_progress_bars

        quiet_progress_bars(transformers_too=False)  # read before the run's console is set up
        with problems.check():
            check_local_data(data)
    for key, path in checkpoint_files(job):
        from adls_lightning.checkpoints import read_checkpoint

        with problems.check():
            read_checkpoint(path, key, mmap=True)
    if job.get("ckpt_path") == "last":
        from adls_lightning.checkpoints import last_checkpoint

        with problems.check():
            last_checkpoint(node["dirpath"] for _, node in callback_nodes(job) if node.get("dirpath"))
    problems.raise_all()


def check_composed_config(
    cfg: Any,
    multirun: bool,
    sweep_overrides: bool = False,
    *,
    callback_settings: bool = True,
    sweep_job: bool = False,
) -> dict:
    """Every check that needs no object built: targets of the whole config (``hydra`` included), values, run dir.

    ``cfg`` is composed with ``return_hydra_config=True`` (as Hydra will run it); ``sweep_overrides``: the command
    line holds sweep overrides (``key=interval(...)``), a search's parameters; ``callback_settings``: also check
    the types of the project's callbacks' settings (:func:`check_callback_settings`, which imports Lightning);
    ``sweep_job``: ``cfg`` is one job of a multirun (its folder is ``hydra.sweep.dir``/``hydra.sweep.subdir``,
    checked as a run's).

    Returns:
        The job's config, resolved, without ``hydra`` (what :func:`check_run_inputs` reads).
    """
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    from adls_lightning.build import check_config_targets

    check_config_targets(cfg)
    # Resolve as the job will see it: ${hydra:runtime.output_dir} is the run dir (the sweep dir for a search),
    # and the run dir itself may use ${hydra:runtime.choices...} (a search's study name), so Hydra's config is
    # set before either is resolved.
    HydraConfig.instance().set_config(copy.deepcopy(cfg))  # set_config makes what it is given read-only
    try:
        run_dir = Path(
            str(OmegaConf.select(cfg, "hydra.sweep.dir" if multirun or sweep_job else "hydra.run.dir"))
        ).absolute()
        if sweep_job:
            run_dir = run_dir / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(run_dir)
            if not sweep_job:  # a sweep's job keeps its own number (its folder, ${hydra:job.num})
                cfg.hydra.job.num = 0
        HydraConfig.instance().set_config(cfg)
        job = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:  # raised by a resolver (an unknown data.task): its own line
            raise cause from None
        raise ConfigError(f"{err.full_key}: {err.msg}") from None
    finally:
        HydraConfig.instance().cfg = None
    # Independent checks, each run: a refusal names every problem of the command line, not only the first.
    problems = Problems()
    space = OmegaConf.select(cfg, "hydra.sweeper.search_space")
    sweeper = cfg.hydra.sweeper or {}
    if multirun and space is None and not sweep_overrides and "params" in sweeper and not sweeper.params:
        # a study with no parameter (search=hparams without overrides): one line now, not the sweeper's later
        choice = OmegaConf.select(cfg, "hydra.runtime.choices.search", default=None)
        where = f"search={choice}" if choice else "hydra.sweeper"
        raise ConfigError(
            f"{where}: nothing to search; give sweep overrides such as "
            "'model.optimizer.lr=tag(log, interval(1e-5, 1e-2))' 'model.lora.r=choice(4, 8, 16)' "
            "(or hydra.sweeper.params)"
        )
    if multirun and space is not None:
        from adls_lightning.build import build

        # A space checks its own choices when built (cheap: nothing is sampled); built here, a bad choice list
        # is refused before the sweep starts instead of failing every trial.
        with problems.check():
            build(space, "hydra.sweeper.search_space")
    job.pop("hydra", None)
    with problems.check():
        validate_run_config(job)
    if callback_settings:
        with problems.check():
            check_callback_settings(job)
    with problems.check():
        check_output_dir(
            run_dir,
            job,
            "hydra.sweep.dir" if multirun or sweep_job else "hydra.run.dir",
            earlier_run=not multirun,
        )
    problems.raise_all()
    return job


def preflight(hydra_main: Callable[[], Any]) -> Callable[[], Any]:
    """Wrap a ``@hydra.main`` function so the config Hydra composes is checked before Hydra runs anything with it.

    Hydra instantiates ``hydra.callbacks``, makes the run folder and starts the sweep right after composing; a
    refusal must come first, so the checks run on Hydra's own composition, as it returns
    (:func:`checks_on_composition`): the config is composed once. ``--help``, ``--cfg`` and other informational
    flags, ``--config-dir`` and ``--experimental-rerun`` go straight to Hydra.
    """

    @functools.wraps(hydra_main)
    def checked_main() -> Any:
        from hydra._internal.utils import get_args_parser  # the parser @hydra.main itself uses
        from hydra.core.override_parser.overrides_parser import OverridesParser

        args, _ = get_args_parser().parse_known_args()
        if informational_flags(args) or args.config_dir is not None or args.experimental_rerun is not None:
            return hydra_main()
        with refusing_in_one_line():  # Hydra parses them before it composes: a bad one is one line here too
            OverridesParser.create().parse_overrides(args.overrides)
        with checks_on_composition():
            return hydra_main()

    return checked_main


#: Whether the checks of :func:`checks_on_composition` passed in this process (a single run's task then checks
#: no value again: :func:`adls_lightning.app.training.run` with ``checked=True``).
_composition_checked = False


def composition_checked() -> bool:
    """Whether this process's run config passed the pre-flight checks (a single run; a search's trials are
    sampled later and each is checked by its run)."""
    return _composition_checked


@contextlib.contextmanager
def checks_on_composition() -> Iterator[None]:
    """Within this block, Hydra's composition of the run's config (``Hydra.run`` / ``Hydra.multirun`` compose it
    once, before anything else) is checked as it returns: composition errors and every refusal of
    :func:`check_composed_config` and :func:`check_run_inputs` become one line and exit code 2, before Hydra
    instantiates its callbacks, makes a run folder or starts a sweep. Later compositions (a sweep's trials,
    composed by the sweeper) go unhooked: the first call restores Hydra's own method.
    """
    from hydra._internal.hydra import Hydra  # the one composition step run() and multirun() share
    from hydra.types import RunMode

    compose_config = Hydra.compose_config

    @functools.wraps(compose_config)
    def compose_and_check(
        self: Any, config_name: Any, overrides: list[str], run_mode: RunMode, *a, **kw
    ) -> Any:
        global _composition_checked
        Hydra.compose_config = compose_config  # once: a run's config, not the sweeper's trials
        with refusing_in_one_line():
            cfg = compose_config(self, config_name, overrides, run_mode, *a, **kw)
            multirun = run_mode == RunMode.MULTIRUN
            check_config(cfg, multirun, self.config_loader)
        _composition_checked = not multirun
        return cfg

    Hydra.compose_config = compose_and_check
    try:
        yield
    finally:
        Hydra.compose_config = compose_config


def check_config(cfg: Any, multirun: bool, config_loader: Any = None) -> None:
    """Every check of a run config composed by Hydra (``hydra`` node included, left unchanged): targets, values and
    run folder; a single run's input files; a basic sweep's jobs (:func:`check_sweep_jobs`, with Hydra's
    ``config_loader``); the project's callbacks' settings.

    Raises:
        ConfigError: naming every problem found.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    task_overrides = list(OmegaConf.select(cfg, "hydra.overrides.task", default=None) or [])
    # a multirun's sweep overrides (a=1,2) are the sweeper's; the composed config is their base
    sweeps = any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(task_overrides))
    # the callbacks' settings last: their types come from the callbacks' modules, which import Lightning,
    # and bad files are refused sooner without it
    job = check_composed_config(copy.deepcopy(cfg), multirun, sweeps, callback_settings=False)
    if not multirun:
        check_run_inputs(job)
    sweep_jobs = check_sweep_jobs(config_loader, cfg) if multirun and config_loader is not None else {}
    check_callback_settings(job)
    for name, sweep_job in sweep_jobs.items():
        with _naming(name):
            check_callback_settings(sweep_job)


@contextlib.contextmanager
def _naming(job_name: str) -> Iterator[None]:
    try:
        yield
    except ConfigError as err:
        raise ConfigError(f"{job_name}: {err}") from None


#: Hydra's own sweeper (``train.py -m a=1,2``): it runs the grid of the command line's lists, jobs numbered from 0.
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def check_sweep_jobs(config_loader: Any, cfg: Any) -> dict[str, dict]:
    """Each job of a basic sweep (``train.py -m quant=int8,int8_scaled seed=1,2``), composed as the sweeper will
    compose it and checked as a single run is (:func:`check_composed_config`, the callbacks' settings aside), before
    the sweep starts: a typo in one value of a list, a bad value in one job, or a job folder holding an earlier run
    (the jobs are numbered from 0 again, so a second sweep into the same ``hydra.sweep.dir`` would land in the first
    one's folders) is refused before the first job runs and before Hydra writes the sweep's ``multirun.yaml``. A
    search's sweeper samples its trials later (each is checked by its run) and numbers them on: not checked here.

    Returns:
        Each job's resolved config (without ``hydra``) by its name, ``job N (its swept values)``.

    Raises:
        ConfigError: naming the job and its swept values.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    if OmegaConf.select(cfg, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return {}
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(cfg.hydra.overrides.task)
    overrides = OverridesParser.create(config_loader=config_loader).parse_overrides(arguments)
    swept = {o.get_key_element() for o in overrides if o.is_sweep_override()}
    jobs: dict[str, dict] = {}
    for number, job_overrides in enumerate(
        job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch
    ):
        name = f"job {number} ({' '.join(o for o in job_overrides if o.split('=', 1)[0] in swept)})"
        job_cfg = config_loader.load_sweep_config(cfg, list(job_overrides))
        with open_dict(job_cfg):  # as Hydra's launchers number them
            job_cfg.hydra.job.id = str(number)
            job_cfg.hydra.job.num = number
        with _naming(name):
            jobs[name] = check_composed_config(
                job_cfg, multirun=False, callback_settings=False, sweep_job=True
            )
    return jobs
