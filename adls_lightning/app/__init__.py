"""The application: what turns a command line into a run. Everything else in ``adls_lightning`` is a library.

- :mod:`~adls_lightning.app.cli`: the entry points (``train.py`` / ``search.py``, ``adls-train`` / ``adls-search``).
- :mod:`~adls_lightning.app.preflight`: the composed config checked before Hydra runs or writes anything.
- :mod:`~adls_lightning.app.training`: the training task (objects from the config, Lightning's Trainer, metrics).
- :mod:`~adls_lightning.app.objective`: the search task (one trial and what it returns to the sweeper).

Imports go one way: entry points -> ``adls_lightning.app`` -> ``callbacks`` -> the library -> ``errors``. The
library outside this package imports neither Hydra's runtime (``hydra.main``, ``HydraConfig``) nor Lightning's
``Trainer``; ``tests/test_architecture.py`` checks that and that the import graph has no circle. The Hydra imports
it keeps, each with its reason:

- ``build.py``: ``hydra.utils.instantiate``, the one guarded builder (Hydra's config instantiation, not its runtime).
- ``runs/loading.py``: loading a run's model composes its recorded config with Hydra's compose API.

The commands (``adls-table``, ``adls-export``, ``adls-evaluate``, ``adls-predict``, ``adls-budget``,
``python -m adls_lightning.graph``, ``soup``, ``quant.sensitivity``, the reports) are :mod:`adls_lightning.tools`,
beside this package: entry points over the library, which imports neither.
"""
