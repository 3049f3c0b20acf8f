"""A ``train.py`` run's folder, as the library reads and writes it.

- :mod:`.folder`: the checks that a folder can take a new run or a report, and the removal of the folder of a run
  refused inside the task (nothing of value in it).
- :mod:`.record`: the run's record, Hydra's ``.hydra/`` files and ``metrics.json``: written once the run's checks
  passed, read back for tables and figures over many runs.
- :mod:`.loading`: a run's model from one of its checkpoints (its recorded config composed again).

This package's ``__init__`` imports nothing: :mod:`.folder` and :mod:`.record` stay free of torch for the pre-flight
check, while :mod:`.loading` needs it.
"""
