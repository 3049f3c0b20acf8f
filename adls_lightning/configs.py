"""Where the project's configs are, and what a config group offers: a leaf module (pathlib only), so that any part of
the library, the error messages included, can name a group's presets without importing the package."""

from __future__ import annotations

from pathlib import Path

#: The project's configs, packaged with the library (in a checkout, a link to its ``conf/``): the entry points'
#: defaults, and what the tools compose a run's config from.
CONF_DIR = Path(__file__).resolve().parent / "conf"


def group_presets(group: str) -> list[str]:
    """The presets of config group ``group`` (``conf/<group>/*.yaml`` but the empty ``none`` and the shared bodies
    ``_*``), or none when it is no group."""
    return sorted(
        p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_") and p.stem != "none"
    )
