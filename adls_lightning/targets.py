"""Which callables a config may name in ``_target_`` (the trust rule of :mod:`adls_lightning.build`, which builds
configs under it, and of :mod:`adls_lightning.registry`, which imports plugin modules under it): a leaf module, so
both can read it without importing each other."""

from __future__ import annotations

import fnmatch
import os

# Python packages whose callables a config may name in `_target_`: the project's and its libraries'.
ALLOWED_TARGETS = (
    "adls_lightning.*",
    "hydra_plugins.adls_optuna_sweeper.*",
    "hydra_plugins.hydra_optuna_sweeper.*",
    "lightning.*",
    "torch.optim.*",
    "transformers.*",
    "peft.*",
    "optuna.*",
)

# A researcher's own package (a search space, a format) is allowed from the environment, never from a config:
# a config that could widen the list could also run anything. Comma-separated patterns, e.g. "mylab.*".
EXTRA_TARGETS_ENV = "ADLS_EXTRA_TARGETS"


def allowed_targets() -> tuple[str, ...]:
    """:data:`ALLOWED_TARGETS` plus the patterns in ``$ADLS_EXTRA_TARGETS``."""
    extra = [p.strip() for p in os.environ.get(EXTRA_TARGETS_ENV, "").split(",") if p.strip()]
    return ALLOWED_TARGETS + tuple(extra)


def target_allowed(target: str) -> bool:
    """Whether a ``_target_`` string names a callable inside :func:`allowed_targets`."""
    return any(fnmatch.fnmatchcase(target, pattern) for pattern in allowed_targets())
