"""Reports of finished runs and studies, as library verbs (the commands that call them are in
:mod:`adls_lightning.tools`).

- :mod:`.page`: one self-contained HTML page of figures and sortable tables (every report below is written with it).
- :mod:`.sweep`: the page of a Hydra multirun of ``train.py`` (``python -m adls_lightning.reports.sweep``).
- :mod:`.study`: the page of an Optuna study (``python -m adls_lightning.reports.study``).
- :mod:`.table`: one results table for any runs, mean ± std over seeds (``adls-table``).

A graph's per-node report (Lab 0) is a graph pass and stays with the graph: :mod:`adls_lightning.graph.node_report`.
"""
