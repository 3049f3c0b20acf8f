"""The commands: ``key=value`` command lines over the library's verbs, each parsed by :mod:`.options` (the one
option parser: ``--help`` is the tool's docstring, a refusal one ``error:`` line and exit code 2).

- :mod:`.graph`: ``python -m adls_lightning.graph`` (Lab 0: the FX graph, passes, report).
- :mod:`.sensitivity`: ``python -m adls_lightning.quant.sensitivity`` (per-layer quantization sensitivity).
- :mod:`.soup`: ``python -m adls_lightning.soup`` (the mean of runs' weights).
- :mod:`.report`, :mod:`.study_report`: ``python -m adls_lightning.reports.sweep`` / ``adls_lightning.reports.study``.
- :mod:`.results_table`: ``adls-table`` / ``python -m adls_lightning.reports.table``.
- :mod:`.export`: ``adls-export`` / ``python -m adls_lightning.export`` (a run's checkpoint to a folder; the verbs:
  :mod:`adls_lightning.export.from_checkpoint`).
- :mod:`.evaluate`: ``adls-evaluate`` / ``python -m adls_lightning.export.evaluate`` (exported folders scored).
- :mod:`.predict`: ``adls-predict`` / ``python -m adls_lightning.export.predict`` (labels of texts from a folder).
- :mod:`.budget`: ``adls-budget`` (per-layer formats under a latency or size budget; the verbs:
  :mod:`adls_lightning.search.budget_run`).

The documented ``python -m`` spellings stay: the library module's ``if __name__ == "__main__":`` block (or its
``__main__.py``) calls the tool. Tools sit above the library with the application (:mod:`adls_lightning.app`): the
library and the callbacks import no tool (``scripts/import_graph.py`` checks it).
"""
