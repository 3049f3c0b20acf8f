"""Registries: the one place a number format or a pruning method is looked up by the name a config uses.

A new entry is one decorated definition in one module::

    from adls_lightning.quant.quantizers import Quantizer, register_format

    @register_format
    class MyFormat(Quantizer):
        format_name = "my_format"
        ...

Configs name the entry (``name: my_format``). A module outside this package is imported by listing it under
``plugins`` (``quant.plugins=[mylab.formats]``); :func:`import_plugins` allows only modules that
``$ADLS_EXTRA_TARGETS`` allows as ``_target_`` (the same trust rule as :mod:`adls_lightning.build`). See
``docs/extending.md``.

The registries: number formats (``adls_lightning.quant.quantizers.QUANTIZERS``, ``register_format``), pruning
methods (``adls_lightning.prune.scores``: ``PRUNE_METHODS``, ``ONESHOT_METHODS``, ``LEARNED_METHODS``) and task
metrics (``adls_lightning.data.tasks.METRICS``, ``register_metric``; their modules listed in ``data.plugins``). The
quantization callback's methods (``adls_lightning.callbacks.quant_methods.QUANT_METHODS``) are one too, read by the
callback only: the library does not import callbacks.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from adls_lightning.errors import ConfigError
from adls_lightning.targets import EXTRA_TARGETS_ENV, target_allowed

T = TypeVar("T")


class NameTaken(ValueError):
    """:meth:`Registry.register` was given a name another entry has (the message says which entry)."""


class Registry(Mapping[str, T], Generic[T]):
    """Name -> entry, filled by :meth:`register`; reads like a dict (``name in REG``, ``REG[name]``, ``list(REG)``).

    Args:
        kind: what the entries are, for messages (``quantization format``).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name``; re-registering the same object (a re-imported module) is allowed.

        Raises:
            NameTaken: another entry already has the name.
        """
        existing = self._entries.get(name)
        if existing is not None and getattr(existing, "__qualname__", None) != getattr(
            entry, "__qualname__", 0
        ):
            raise NameTaken(
                f"{self.kind} {name!r} is already registered ({_describe(existing)}); register yours under "
                f"another name"
            )
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that register a throw-away entry)."""
        self._entries.pop(name, None)

    def lookup(self, name: str, key: str) -> T:
        """The entry for ``name``.

        Raises:
            ConfigError: ``KEY='x': unknown <kind> (valid: ...)``.
        """
        if name not in self._entries:
            raise ConfigError(f"{key}={name!r}: unknown {self.kind} (valid: {', '.join(self._entries)})")
        return self._entries[name]

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _describe(entry: object) -> str:
    """``module.qualname`` of a registered class or function (the built-in it would replace), else its repr."""
    if not callable(entry) or not hasattr(entry, "__qualname__"):
        entry = getattr(entry, "build", entry)  # a record holding its builder (a metric's MetricEntry)
    module, name = getattr(entry, "__module__", None), getattr(entry, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(entry)


def named_decorator(registry: Registry[T], name: str) -> Callable[[T], T]:
    """``@decorator`` registering the decorated object under ``name``."""

    def decorate(entry: T) -> T:
        return registry.register(name, entry)

    return decorate


def import_plugins(modules: Sequence[str] | None, key: str) -> None:
    """Import the modules a config lists so that their decorated formats / methods register themselves.

    Raises:
        ConfigError: a module outside the allowed packages, one that cannot be imported, one whose code raises
            while it is imported (``quant.plugins[0]=mylab.x: importing it raised NameError: ... (x.py:3)``), or
            one registering a name another entry already has.
    """
    if modules is None:
        return
    if isinstance(modules, str) or not isinstance(modules, Sequence):
        raise ConfigError(f"{key}={modules!r}: must be a list of module names")
    for index, module in enumerate(modules):
        if not isinstance(module, str) or not target_allowed(f"{module}.x"):
            raise ConfigError(
                f"{key}[{index}]={module}: not an allowed module (allow your own package with "
                f"{EXTRA_TARGETS_ENV}={module.split('.')[0] if isinstance(module, str) else 'pkg'}.*)"
            )
        try:
            importlib.import_module(module)
        except NameTaken as err:
            raise ConfigError(f"{key}[{index}]={module}: {err}") from None
        except ImportError as err:
            if err.name is not None and (module == err.name or module.startswith(f"{err.name}.")):
                raise ConfigError(f"{key}[{index}]={module}: cannot be imported ({err})") from None
            # the module was found, but an import inside it failed: that is its own error
            raise ConfigError(f"{key}[{index}]={module}: {_raised_while_importing(err)}") from None
        except Exception as err:  # the module's own code failed (a bug in a researcher's plugin): one line
            raise ConfigError(f"{key}[{index}]={module}: {_raised_while_importing(err)}") from None


def _raised_while_importing(err: BaseException) -> str:
    """``importing it raised NameError: name 'x' is not defined (formats.py:3)``: the error and the line of the
    plugin's (or its imports') code that raised it, not the import machinery's."""
    if isinstance(err, SyntaxError) and err.filename:
        where = f" ({Path(err.filename).name}:{err.lineno})"
        message = err.msg
    else:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<frozen")]
        where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
        message = str(err)
    return f"importing it raised {type(err).__name__}: {' '.join(message.split())}{where}"


#: Nodes built from these targets list their plugins under ``plugins`` (another library's ``plugins``, Lightning's
#: ``trainer.plugins``, is objects, not modules).
_PLUGIN_OWNERS = "adls_lightning."


def import_config_plugins(node: object, key: str = "") -> None:
    """Import, in config order, the modules that every project node at or below ``node`` (a resolved config, or one
    node of it named ``key``) lists under ``plugins`` (``data.plugins``, ``quant.plugins``), before any node is
    checked or built: a node naming a plugin's entry (``quant.config={_target_: ...QuantRecipe, default: {weight:
    {format: toy_step}}}``, ``prune.weight.method=toy_largest``) is checked, and built by Hydra, before the object
    that lists the plugin would import it.

    Raises:
        ConfigError: as :func:`import_plugins`.
    """
    if isinstance(node, Mapping):
        target = node.get("_target_")
        if isinstance(target, str) and target.startswith(_PLUGIN_OWNERS) and node.get("plugins") is not None:
            import_plugins(node["plugins"], f"{key}.plugins" if key else "plugins")
        for name, value in node.items():
            import_config_plugins(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, Sequence) and not isinstance(node, (str, bytes)):
        for index, value in enumerate(node):
            import_config_plugins(value, f"{key}[{index}]")
