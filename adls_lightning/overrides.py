"""Hydra override tokens of a run's command line (``model=tiny_random``, ``+a.b=1``, ``~quant``): the key each sets,
and one list over another. Ground floor (no Hydra import): the tools and the run-loading verbs share it."""

from __future__ import annotations

from collections.abc import Sequence


def override_key(token: str) -> str:
    """The config key a Hydra override sets (``+a.b=1``, ``~a.b``, ``a/b=c`` → ``a.b``)."""
    return token.split("=", 1)[0].lstrip("+~").replace("/", ".")


def merge_overrides(base: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``base`` then ``extra``, where an override in ``extra`` replaces one of ``base`` that sets the same key
    (Hydra refuses a config group given twice)."""
    replaced = {override_key(token) for token in extra}
    return [token for token in base if override_key(token) not in replaced] + list(extra)
