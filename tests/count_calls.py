"""Run an entry point (``train.py`` ...) as the user does, counting what it does once per run: a script, not a test
module. ``python tests/count_calls.py COUNTS.json WATCHED_FILE SCRIPT [overrides...]`` writes
``{"compose": n, "validate_run_config": n, "torch_load": n}``: Hydra compositions of a config (the pre-flight's or
Hydra's own; each goes through ``ConfigLoaderImpl._load_configuration``), calls of the run config's validator, and
``torch.load`` calls on ``WATCHED_FILE``. The functions are wrapped where they are defined, before the entry point
imports anything of the project, so every caller's call is counted.
"""

import atexit
import functools
import json
import os
import runpy
import sys
from pathlib import Path

counts_file, watched, script, *overrides = sys.argv[1:]
counts = {"compose": 0, "validate_run_config": 0, "torch_load": 0}


def counting(name, function, counted=lambda *args, **kwargs: True):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if counted(*args, **kwargs):
            counts[name] += 1
        return function(*args, **kwargs)

    return wrapper


def reads_watched(file, *args, **kwargs) -> bool:
    return isinstance(file, (str, os.PathLike)) and Path(file).resolve() == Path(watched).resolve()


import torch  # noqa: E402
from hydra._internal.config_loader_impl import ConfigLoaderImpl  # noqa: E402

import adls_lightning.app.preflight as preflight  # noqa: E402

ConfigLoaderImpl._load_configuration = counting("compose", ConfigLoaderImpl._load_configuration)
preflight.validate_run_config = counting("validate_run_config", preflight.validate_run_config)
torch.load = counting("torch_load", torch.load, reads_watched)
atexit.register(lambda: Path(counts_file).write_text(json.dumps(counts)))
sys.argv = [script, *overrides]
runpy.run_path(script, run_name="__main__")
