"""The project's wheel (``pip wheel .``, the build ``pip install .`` runs) installed into a fresh virtual
environment, then the installed console commands ``adls-train`` and ``adls-search`` from a folder outside the
checkout: a tiny training and a 2-trial search through the packaged sweeper plugin, with the packaged configs.

The fresh environment gets the project's dependencies by pointing at this venv's site-packages with a ``.pth``
path line (pip is run with ``--no-deps``: nothing is downloaded). A path line does not process that folder's own
``.pth`` files, so the editable install of the checkout stays invisible: the test fails if the wheel lacks the
configs, the hydra plugin or the extension.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import optuna
import pytest

from tests.helpers import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the project installed from the checkout as a wheel; returns its ``bin`` folder."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    purelib = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (purelib / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # The wheel is built by this venv's Python, as `pip install .` here would: its compile command is then the
    # editable install's, whose objects setup.py keeps in build/ext-temp, so only the link runs again. The fresh
    # venv installs the wheel file itself.
    wheels = venv.parent / "wheels"
    pip = ["-m", "pip", "--disable-pip-version-check"]
    wheel_args = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)]
    build = subprocess.run(
        [sys.executable, *pip, *wheel_args],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("adls_lightning-*.whl")
    install = subprocess.run(
        [str(venv / "bin" / "python"), *pip, "install", "--no-deps", "-q", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return venv / "bin"


def _run(bin_dir: Path, command: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PROJECT_ROOT", "PYTHONPATH")}
    return subprocess.run(
        [str(bin_dir / command), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow
def test_installed_package_is_the_wheel_not_the_checkout(installed, tmp_path):
    code = "import adls_lightning, hydra_plugins.adls_optuna_sweeper as s; print(adls_lightning.__file__, s.__file__)"
    where = subprocess.run(
        [str(installed / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert str(ROOT) not in where and "site-packages" in where
    package = Path(where.split()[0]).parent
    assert list((package / "conf" / "quant").glob("int8.yaml"))
    assert list(package.glob("_C.*so")), "the wheel holds no compiled extension (adls_lightning._C)"


@pytest.mark.slow
def test_console_commands_train_and_search_from_another_folder(installed, tmp_path, tiny_imdb_dir, cache_dir):
    data = [f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}"]
    train = _run(
        installed, "adls-train", tmp_path, *TINY_OVERRIDES, *data, "trainer.max_epochs=1", "hydra.run.dir=run"
    )
    assert train.returncode == 0, train.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0.0 <= metrics["test/acc"] <= 1.0 and metrics["train/samples_seen"] > 0

    search = _run(
        installed,
        "adls-search",
        tmp_path,
        *data,
        "search=nas",
        "search.name=pkg",
        "hydra.sweeper.n_trials=2",
        "hydra.sweep.dir=sweep",
        "trainer=cpu",
        "trainer.max_epochs=1",
        "callbacks.rich_progress_bar=null",
        "data.max_length=32",
        "data.batch_size=16",
        "data.train_size=128",
        "data.val_size=64",
        "data.test_size=64",
        "hydra.sweeper.search_space.num_hidden_layers=[1]",
        "hydra.sweeper.search_space.num_attention_heads=[2]",
        "hydra.sweeper.search_space.hidden_size=[16]",
        "hydra.sweeper.search_space.intermediate_size=[32]",
    )
    assert search.returncode == 0, search.stderr[-3000:]
    dbs = list((tmp_path / "sweep").glob("*.db"))
    assert len(dbs) == 1, list((tmp_path / "sweep").iterdir())
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{dbs[0]}")
    assert len(study.trials) == 2
