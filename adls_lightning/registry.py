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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from adls_lightning.build import EXTRA_TARGETS_ENV, target_allowed
from adls_lightning.errors import ConfigError

T = TypeVar("T")


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
            ValueError: another entry already has the name.
        """
        existing = self._entries.get(name)
        if existing is not None and getattr(existing, "__qualname__", None) != getattr(
            entry, "__qualname__", 0
        ):
            raise ValueError(f"{self.kind} {name!r} is already registered ({existing!r})")
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


def named_decorator(registry: Registry[T], name: str) -> Callable[[T], T]:
    """``@decorator`` registering the decorated object under ``name``."""

    def decorate(entry: T) -> T:
        return registry.register(name, entry)

    return decorate


def import_plugins(modules: Sequence[str] | None, key: str) -> None:
    """Import the modules a config lists so that their decorated formats / methods register themselves.

    Raises:
        ConfigError: a module outside the allowed packages, or one that cannot be imported.
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
        except ImportError as err:
            raise ConfigError(f"{key}[{index}]={module}: cannot be imported ({err})") from None
