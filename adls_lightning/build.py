"""The one guarded builder: every ``_target_`` a config names is checked before anything is instantiated.

Hydra's ``instantiate`` runs whatever callable a ``_target_`` names (``builtins.open`` included). Every object the
project builds from a config -- model, data, callbacks, loggers, trainer, sweeper parts, search spaces, samplers,
pruners, objectives -- goes through :func:`build`, which walks the whole node first and refuses, with one line
naming the config key and the target, anything outside :data:`~adls_lightning.targets.ALLOWED_TARGETS`. Nothing runs before the check.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, read_write

from adls_lightning.errors import ConfigError, did_you_mean
from adls_lightning.targets import EXTRA_TARGETS_ENV, allowed_targets, target_allowed

# Launcher/sweeper plugin classes: Hydra's own and the launcher plugins conf/hydra/launcher/ builds on
# (hydra/launcher=parallel|slurm|submitit_local). Hydra builds only registered plugins from these two nodes.
HYDRA_PLUGIN_TARGETS = (
    "hydra._internal.core_plugins.*",
    "hydra_plugins.hydra_joblib_launcher.*",
    "hydra_plugins.hydra_submitit_launcher.*",
)
# Classes Python's logging may build from hydra.job_logging / hydra.hydra_logging (``class`` and ``()`` keys).
LOGGING_CLASSES = ("logging.*",)


# What a ``_target_`` of an earlier release is called now: the project's callbacks were a top-level package
# ``callbacks`` (a name that can clash in a user's environment) before they moved into the library's package, and
# the CSV logger lived in ``adls_lightning.io_utils`` before the file writers moved into ``adls_lightning.files``.
# Configs recorded by earlier runs still name them so (a run folder's ``.hydra/config.yaml``, a study's stored
# settings, a Hydra ``--experimental-rerun``); :func:`current_target` reads them as today's names wherever a target
# is checked, resolved or built.
RENAMED_TARGET_PREFIXES = {
    "callbacks.": "adls_lightning.callbacks.",
    "adls_lightning.io_utils.": "adls_lightning.files.lightning_io.",
}


def current_target(target: Any) -> Any:
    """``target`` under today's name (``callbacks.pruning.PruningCallback`` ->
    ``adls_lightning.callbacks.pruning.PruningCallback``); anything else unchanged."""
    if isinstance(target, str):
        for old, new in RENAMED_TARGET_PREFIXES.items():
            if target.startswith(old):
                return new + target.removeprefix(old)
    return target


def upgrade_targets(node: Any) -> Any:
    """Rename, in place, every ``_target_`` below ``node`` (a config, a dict, a list) that :func:`current_target`
    renames; returns ``node``. A read-only config is opened for the rename only."""
    plain = (
        OmegaConf.to_container(node, resolve=False) if isinstance(node, (DictConfig, ListConfig)) else node
    )
    renames = list(_renamed_targets(plain, ()))
    if not renames:
        return node
    with read_write(node) if isinstance(node, (DictConfig, ListConfig)) else contextlib.nullcontext():
        for path, target in renames:
            parent = node
            for step in path[:-1]:
                parent = parent[step]
            parent[path[-1]] = target
    return node


def _renamed_targets(node: Any, path: tuple) -> Iterator[tuple[tuple, str]]:
    if isinstance(node, Mapping):
        for name, value in node.items():
            if name == "_target_":
                if current_target(value) != value:
                    yield (*path, name), current_target(value)
            else:
                yield from _renamed_targets(value, (*path, name))
    elif isinstance(node, Sequence) and not isinstance(node, (str, bytes)):
        for index, value in enumerate(node):
            yield from _renamed_targets(value, (*path, index))


def iter_targets(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(dotted key, _target_ value)`` for every ``_target_`` below ``node`` (unresolved interpolations kept)."""
    for where, built in _target_nodes(node, key):
        yield (f"{where}._target_" if where else "_target_"), built["_target_"]


def _target_nodes(node: Any, key: str) -> Iterator[tuple[str, Mapping]]:
    """Yield ``(dotted key, mapping)`` for every mapping with a ``_target_`` at or below ``node``."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, Mapping):
        if "_target_" in node:
            yield key, node
        for name, value in node.items():
            yield from _target_nodes(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, Sequence) and not isinstance(node, (str, bytes)):
        for index, value in enumerate(node):
            yield from _target_nodes(value, f"{key}[{index}]")


def check_targets(node: Any, key: str) -> None:
    """Raise ConfigError naming the first ``_target_`` below ``node`` that is not allowed.

    Raises:
        ConfigError: ``KEY._target_=X: not allowed (targets must be in adls_lightning.*, ...)``.
    """
    for where, target in iter_targets(node, key):
        _refuse(where, target, allowed_targets())


def _refuse(where: str, target: Any, allowed: Sequence[str]) -> None:
    target = current_target(target)
    if not isinstance(target, str) or not any(fnmatch.fnmatchcase(target, p) for p in allowed):
        raise ConfigError(
            f"{where}={target}: not an allowed target (a config may only build objects from "
            f"{', '.join(allowed)}; allow your own package with {EXTRA_TARGETS_ENV}=pkg.*)"
        )


def _iter_logging_classes(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for name, value in node.items():
            child = f"{key}.{name}"
            if name in ("class", "()"):
                yield child, value
            else:
                yield from _iter_logging_classes(value, child)


def check_config_targets(cfg: Any) -> None:
    """Check every callable a whole composed config (``hydra`` node included) could make Hydra or us run.

    ``_target_`` everywhere, Hydra's launcher/sweeper plugins, and the handler/formatter classes of Hydra's
    logging configs (``logging.config.dictConfig`` builds those). Called before Hydra starts a run, so a hostile
    ``hydra.callbacks`` entry is refused before Hydra instantiates it.

    Raises:
        ConfigError: naming the first key whose target is not allowed.
    """
    container = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    hydra_node = dict(container.get("hydra") or {})
    for plugin in ("launcher", "sweeper"):
        plugin_node = dict(hydra_node.pop(plugin, None) or {})
        if "_target_" in plugin_node:
            _refuse(
                f"hydra.{plugin}._target_",
                plugin_node.pop("_target_"),
                allowed_targets() + HYDRA_PLUGIN_TARGETS,
            )
        check_targets(plugin_node, f"hydra.{plugin}")
    for logging_key in ("job_logging", "hydra_logging"):
        for where, target in _iter_logging_classes(hydra_node.pop(logging_key, None), f"hydra.{logging_key}"):
            _refuse(where, target, LOGGING_CLASSES)
    check_targets(hydra_node, "hydra")
    check_targets({k: v for k, v in container.items() if k != "hydra"}, "")


def resolve_target(target: str) -> Any:
    """The object a dotted ``_target_`` names, found as Hydra finds it: the longest importable module prefix, then
    attributes (a target of an earlier release by its :func:`current_target`). None when it names nothing."""
    parts = current_target(target).split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def check_resolved_target(where: str, target: Any) -> None:
    """Refuse a ``_target_`` whose name is inside an allowed package but that reaches, through an attribute, an
    object defined elsewhere (``adls_lightning.files.lightning_io.os.system`` is ``os.system``): the object's own module and
    name must be allowed too; and one that names nothing (Hydra's answer would be a traceback). Called when
    building, where the modules are imported anyway.

    Raises:
        ConfigError: naming ``where`` and where the object really comes from.
    """
    if not isinstance(target, str) or "${" in target:
        return
    obj = resolve_target(target)
    if obj is None:
        raise ConfigError(
            f"{where}={target}: names no importable object (check the module path and the name)"
        )
    if inspect.ismodule(obj):
        home = obj.__name__
    else:
        module = getattr(obj, "__module__", None) or ""
        home = f"{module}.{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}"
    if not target_allowed(home):
        raise ConfigError(
            f"{where}={target}: is {home}, defined outside the allowed packages (a config may only build objects "
            f"from {', '.join(allowed_targets())}; allow your own package with {EXTRA_TARGETS_ENV}=pkg.*)"
        )


def check_argument_names(key: str, obj: Callable[..., Any], kwargs: Mapping[str, Any]) -> list[str] | None:
    """Check that every key a config passes to ``obj`` names one of its arguments (Hydra's own ``_...`` keys aside).
    A callable taking ``**kwargs`` takes any, unless it is one of the project's classes handing them on to its base
    classes (the data modules): then their arguments are the rest.

    Returns:
        The argument names ``obj`` takes by keyword, or None when its signature cannot be read.

    Raises:
        ConfigError: ``key.name: unknown key; valid: ... (did you mean ...?)``.
    """
    try:
        named, takes_any = _keyword_parameters(inspect.signature(obj))
        bases = obj.__mro__[1:] if inspect.isclass(obj) and _in_project(obj) else ()
        for base in bases if takes_any else ():
            if base is object or "__init__" not in base.__dict__:
                continue
            more, takes_any = _keyword_parameters(inspect.signature(base.__dict__["__init__"]))
            named += [name for name in more if name != "self" and name not in named]
            if not takes_any or not _in_project(base):
                break
    except (TypeError, ValueError):
        return None
    if takes_any:
        return named
    for name in kwargs:
        if not str(name).startswith("_") and name not in named:
            hint = did_you_mean(difflib.get_close_matches(str(name), named))
            where = f"{key}.{name}" if key else str(name)
            raise ConfigError(f"{where}: unknown key; valid: {', '.join(named)}{hint}")
    return named


def _keyword_parameters(signature: inspect.Signature) -> tuple[list[str], bool]:
    """The names a signature takes by keyword, and whether it takes ``**kwargs`` too."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = signature.parameters.values()
    named = [p.name for p in parameters if p.kind in kinds]
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _in_project(cls: type) -> bool:
    return str(getattr(cls, "__module__", "")).startswith("adls_lightning.")


def build(node: Any, key: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node, **kwargs)`` after :func:`check_targets`; ``key`` is the node's config key.

    Hydra's own execution whitelist is kept as a second guard for targets reached through interpolation. A target
    of an earlier release (a recorded config's ``callbacks.X``) is renamed in ``node`` first (:func:`upgrade_targets`).
    """
    upgrade_targets(node)
    check_targets(node, key)
    for where, target in iter_targets(node, key):
        check_resolved_target(where, target)
    # a key the callable does not take (one appended with +key=...) is one line here, not a TypeError inside Hydra
    for where, arguments in _target_nodes(node, key):
        target = arguments.get("_target_")
        if isinstance(target, str) and "${" not in target:
            check_argument_names(where, resolve_target(target), arguments)
    from adls_lightning.registry import import_config_plugins  # it imports this module

    # Hydra builds a node's children (a recipe naming a plugin's format) before the node that lists the plugin
    import_config_plugins(node, key)
    try:
        return instantiate(node, _execution_whitelist_=list(allowed_targets()), **kwargs)
    except ConfigError as err:
        raise _named_at(err, key) from None
    except InstantiationException as err:
        # Hydra wraps what the target raised; a ConfigError is the user's one line, so hand it on unwrapped.
        cause = err.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise _named_at(cause, key) from None
    except Exception as err:
        refusal = _library_refusal(err, key)
        if refusal is None:
            raise
        raise refusal from None


# Exceptions a library's constructor raises for a value it refuses: Lightning's (lightning.fabric.utilities.
# exceptions), matched by name so this module needs neither Lightning nor torch (the pre-flight runs without them).
LIBRARY_REFUSALS = ("MisconfigurationException",)


def _library_refusal(err: Exception, key: str) -> ConfigError | None:
    """A Lightning constructor's refusal of a configured value (``every_n_train_steps=-1``) as a one-line
    ConfigError naming the node's key, or None when it is anything else (a bug keeps its traceback). Hydra re-raises
    what the target raised with ``full_key: KEY`` appended to its message."""
    if not any(c.__name__ in LIBRARY_REFUSALS for c in type(err).__mro__):
        return None
    lines = str(err).splitlines()
    where = next((line.removeprefix("full_key: ") for line in lines if line.startswith("full_key: ")), key)
    message = " ".join(" ".join(line for line in lines if not line.startswith("full_key: ")).split())
    return ConfigError(f"{where}: {message}" if where else message)


def _named_at(err: ConfigError, key: str) -> ConfigError:
    """``err`` with the full config key of the nested node that raised it in front (``quant.config.default.
    weight: width=0: ...``). Hydra notes that node's key on the exception (``full_key: ...``): from the config's
    root when the node has one, else relative to the instantiated node. A message that already starts with
    ``key`` is left as it is."""
    notes = [
        n.removeprefix("full_key: ") for n in getattr(err, "__notes__", ()) if n.startswith("full_key: ")
    ]
    if not notes or not key or str(err).startswith(key):
        return err
    where = notes[-1] if notes[-1] == key or notes[-1].startswith(f"{key}.") else f"{key}.{notes[-1]}"
    return ConfigError(f"{where}: {err}")


def hydra_execution_whitelist() -> list[str]:
    """The allowed targets as Hydra's own execution whitelist (``@hydra.main(execution_whitelist=...)``).

    A second guard under the up-front check: Hydra then refuses, on every path it instantiates (its callbacks,
    its logging config), what the check would refuse.
    """
    return [*allowed_targets(), *HYDRA_PLUGIN_TARGETS, *LOGGING_CLASSES]
