"""Scale-out on real engines: Optuna's journal and PostgreSQL storages shared by several worker processes, a
killed worker's trial retried, Hydra's submitit launcher, bad storage input, and Lightning DDP on 2 CPU processes.

Searches use the toy Hydra app of ``tests/toy_sweeper.py`` (trials take milliseconds); PostgreSQL is a throwaway
server of the machine's binaries on 127.0.0.1 (``postgres`` fixture), removed after the session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from adls_lightning import gemm
from adls_lightning.errors import ConfigError
from adls_lightning.search.storage import mask_password, storage_spec, unmask_for_job
from tests.helpers import PG_PASSWORD, free_port, job_started, ok

# every test here starts training runs or processes (minutes in all): `make test-fast` skips them
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def _study(storage, name: str) -> optuna.Study:
    if isinstance(storage, Path):
        storage = JournalStorage(JournalFileBackend(str(storage)))
    return optuna.load_study(study_name=name, storage=storage)


def _storage_args(kind: str, tmp_path: Path, url: str | None) -> list[str]:
    if kind == "journal":
        return ["hydra.sweeper.storage={kind:journal}"]
    return ["hydra.sweeper.storage={kind:postgresql}"]  # the URL from ADLS_OPTUNA_STORAGE


def _where(kind: str, tmp_path: Path, url: str | None, name: str):
    return tmp_path / "sweep" / f"{name}.journal" if kind == "journal" else url


@pytest.fixture(params=["journal", pytest.param("postgresql", marks=pytest.mark.postgres)])
def shared(request, tmp_path, monkeypatch):
    """(kind, URL or None): a storage several workers share; the PostgreSQL URL is passed in the environment."""
    url = None
    if request.param == "postgresql":
        url = request.getfixturevalue("postgres")
        monkeypatch.setenv("ADLS_OPTUNA_STORAGE", url)
    return request.param, url


# -- storage specs and masking (library) ---------------------------------------------------------------------------


def test_password_is_masked_and_restored_from_the_environment(monkeypatch):
    url = "postgresql+psycopg://me:p@ss:w0rd@db.example:5432/optuna"
    assert mask_password(url) == "postgresql+psycopg://me:***@db.example:5432/optuna"
    assert mask_password("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    monkeypatch.setenv("ADLS_OPTUNA_STORAGE", url)
    assert unmask_for_job(mask_password(url)) == url
    monkeypatch.setenv("ADLS_OPTUNA_STORAGE", "postgresql+psycopg://other:x@db.example:5432/optuna")
    with pytest.raises(ConfigError, match="ADLS_OPTUNA_STORAGE does not hold this URL"):
        unmask_for_job(mask_password(url))


def test_storage_specs_of_each_kind(tmp_path, monkeypatch):
    monkeypatch.delenv("ADLS_OPTUNA_STORAGE", raising=False)
    assert storage_spec({"kind": "sqlite"}, tmp_path, "s") == f"sqlite:///{tmp_path.resolve()}/s.db"
    assert storage_spec({"kind": "journal"}, tmp_path / "sw", "s") == str(
        (tmp_path / "sw" / "s.journal").resolve()
    )
    monkeypatch.setenv("ADLS_OPTUNA_STORAGE", "postgresql+psycopg://u@h/d")
    assert storage_spec({"kind": "postgresql", "url": None}, tmp_path, "s") == "postgresql+psycopg://u@h/d"
    assert (
        storage_spec({"kind": "postgresql", "url": "postgresql://a@b/c"}, tmp_path, "s")
        == "postgresql://a@b/c"
    )
    with pytest.raises(
        ConfigError, match=r"search.storage.kind=mongo: unknown storage; valid: sqlite, journal"
    ):
        storage_spec({"kind": "mongo"}, tmp_path, "s")


# -- many workers, one study ---------------------------------------------------------------------------------------


def test_two_workers_run_exactly_n_trials(shared, toy, tmp_path):
    kind, url = shared
    name = f"toy-{kind}"
    args = [*_storage_args(kind, tmp_path, url), f"hydra.sweeper.study_name={name}", "hydra.sweeper.n_trials=8",
            "hydra/sweeper/sampler=random", "sleep=0.3", f"log_pid={tmp_path / 'pids'}"]  # fmt: skip
    workers = [toy(*args, wait=False) for _ in range(2)]
    outputs = [w.communicate(timeout=300)[0].decode() for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    trials = _study(_where(kind, tmp_path, url, name), name).trials
    assert len([t for t in trials if t.state in FINISHED]) == 8
    assert all(t.state in (*FINISHED, TrialState.WAITING) for t in trials)
    # every trial ran in one job exactly once, and both workers ran some
    pids = {p.name: p.read_text() for p in (tmp_path / "pids").iterdir()}
    assert sorted(int(n) for n in pids) == sorted(t.number for t in trials if t.state == TrialState.COMPLETE)
    assert len(set(pids.values())) == 2
    if url:
        assert PG_PASSWORD not in "".join(outputs)


def _wait_running(
    where, name: str, timeout: float = 120, started: Path | None = None
) -> optuna.trial.FrozenTrial:
    """The first RUNNING trial with sampled parameters. With ``started`` (the toy's ``log_pid`` folder), only once
    its job has started: the space samples x, then y for an odd x, and a trial read between the two lacks y."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            # RUNNING with its parameters sampled: the job is starting
            running = [t for t in _study(where, name).trials if t.state == TrialState.RUNNING and t.params]
            if running and (started is None or job_started(started)):
                return _study(where, name).trials[running[0].number]
        except Exception:  # the worker is still creating the study
            pass
        time.sleep(0.3)
    raise AssertionError("the worker never started a trial")


def test_killed_worker_rerun_at_once_completes_exactly_n_trials(shared, toy, tmp_path):
    """SIGKILL mid-trial, re-run at once (no grace period waited): the dead trial is retried once with its
    parameters and the study ends with exactly n_trials finished trials."""
    kind, url = shared
    name = f"toy-{kind}-killed"  # one PostgreSQL server serves the session: a study of its own
    args = [*_storage_args(kind, tmp_path, url), f"hydra.sweeper.study_name={name}", "hydra.sweeper.n_trials=3",
            "hydra/sweeper/sampler=random", "hydra.sweeper.grace_period=600"]  # fmt: skip
    worker = toy(*args, "sleep=60", f"log_pid={tmp_path / 'pids'}", wait=False)
    where = _where(kind, tmp_path, url, name)
    crashed = _wait_running(where, name, started=tmp_path / "pids")
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()

    proc = ok(toy(*args))
    assert "worker (pid" in proc.stdout + proc.stderr and "is gone" in proc.stdout + proc.stderr
    trials = _study(where, name).trials
    assert trials[crashed.number].state == TrialState.FAIL
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == crashed.number]
    assert retry.params == crashed.params and retry.state in FINISHED
    assert len([t for t in trials if t.state in FINISHED]) == 3
    assert len(trials) == 4  # 3 + the killed one: nothing lost, nothing run twice


def test_rerun_waits_for_a_live_workers_trial_and_says_so(toy, tmp_path):
    """The budget is used up by another (live) worker's running trial: the re-run waits for it, saying what it
    waits for, then exits with the study complete."""
    args = ["hydra.sweeper.n_trials=1", "hydra/sweeper/sampler=random", "hydra.sweeper.study_name=toy-wait"]
    release = tmp_path / "release"
    slow = toy(*args, "sleep=180", f"until={release}", wait=False)  # runs until released (at most 180 s)
    _wait_running(f"sqlite:///{tmp_path / 'sweep' / 'toy-wait.db'}", "toy-wait")
    rerun = toy(*args, wait=False)
    said = []
    for line in iter(rerun.stdout.readline, b""):  # ends at the re-run's exit, at the latest
        said.append(line.decode())
        if "waiting for running trial(s) 0" in said[-1]:
            break
    assert rerun.poll() is None, "".join(said)  # it waits while the other worker's trial runs ...
    release.touch()
    said.append(rerun.communicate(timeout=120)[0].decode())
    assert rerun.returncode == 0 and slow.wait(timeout=120) == 0, "".join(said)  # ... and ends after it
    assert "waiting for running trial(s) 0" in "".join(said)
    trials = _study(f"sqlite:///{tmp_path / 'sweep' / 'toy-wait.db'}", "toy-wait").trials
    assert [t.state for t in trials] == [TrialState.COMPLETE]


# -- launchers -----------------------------------------------------------------------------------------------------


def test_submitit_local_runs_each_trial_as_its_own_process(toy, tmp_path):
    proc = ok(
        toy(
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=5",
            "hydra.sweeper.n_trials=4",
            "hydra.sweeper.n_jobs=2",
            "hydra/sweeper/sampler=random",
            "hydra.sweeper.study_name=toy-submitit",
            f"log_pid={tmp_path / 'pids'}",
        )  # fmt: skip
    )
    trials = _study(f"sqlite:///{tmp_path / 'sweep' / 'toy-submitit.db'}", "toy-submitit").trials
    assert len(trials) == 4 and all(t.state in FINISHED for t in trials), proc.stdout
    ran = [t for t in trials if "x" in t.params and t.params["x"] != 7]
    pids = {(tmp_path / "pids" / str(t.number)).read_text() for t in ran}
    assert len(pids) == len(ran)  # one process per trial
    assert (tmp_path / "sweep" / ".submitit").is_dir()


def test_parallel_preset_runs_trials_in_joblib_processes(toy, tmp_path):
    sweeper = toy("hydra/launcher=parallel", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2",
                  "hydra/sweeper/sampler=random", "hydra.sweeper.study_name=toy-joblib", f"log_pid={tmp_path / 'pids'}",
                  wait=False)  # fmt: skip
    output = sweeper.communicate(timeout=600)[0].decode()
    assert sweeper.returncode == 0, output
    trials = _study(f"sqlite:///{tmp_path / 'sweep' / 'toy-joblib.db'}", "toy-joblib").trials
    assert len(trials) == 4 and all(t.state in FINISHED for t in trials)
    pids = {p.read_text() for p in (tmp_path / "pids").iterdir()}
    assert pids and str(sweeper.pid) not in pids  # the trials ran in joblib's worker processes


# -- bad input: one line, password masked, non-zero exit, no trial COMPLETE ----------------------------------------


def _one_line_failure(proc, message: str) -> str:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if message in line]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_unknown_storage_kind(toy, tmp_path):
    _one_line_failure(toy("hydra.sweeper.storage={kind:mongo}"), "search.storage.kind=mongo: unknown storage")
    assert not (tmp_path / "sweep").exists() or not list((tmp_path / "sweep").glob("*.db"))


def test_journal_path_in_a_missing_folder(toy, tmp_path):
    missing = tmp_path / "nope" / "s.journal"
    line = _one_line_failure(
        toy(f"hydra.sweeper.storage={{kind:journal,path:'{missing}'}}"), "search.storage.path="
    )
    assert "does not exist" in line
    assert not missing.parent.exists()


def test_unreachable_database(toy, tmp_path):
    url = f"postgresql+psycopg://adls:{PG_PASSWORD}@127.0.0.1:{free_port()}/postgres"
    proc = toy(f"hydra.sweeper.storage={{kind:postgresql,url:'{url}'}}")
    line = _one_line_failure(proc, "cannot be opened")
    assert "adls:***@127.0.0.1" in line
    assert PG_PASSWORD not in proc.stdout + proc.stderr


@pytest.mark.postgres
def test_wrong_password(postgres, toy, tmp_path):
    wrong = postgres.replace(PG_PASSWORD, "wrong-pw")
    proc = toy(
        f"hydra.sweeper.storage={{kind:postgresql,url:'{wrong}'}}", "hydra.sweeper.study_name=toy-wrong-pw"
    )
    line = _one_line_failure(proc, "cannot be opened")
    assert "password authentication failed" in line
    assert "wrong-pw" not in proc.stdout + proc.stderr
    assert "toy-wrong-pw" not in optuna.get_all_study_names(postgres)  # nothing recorded


# -- Lightning DDP under Hydra (2 CPU processes, gloo) -------------------------------------------------------------


class DumpMasks:
    """Test callback: each rank saves its pruning masks at the end of fitting (``masks_rank<R>.pt``)."""

    def __new__(cls, folder: str):
        import lightning as L
        import torch

        class _Dump(L.Callback):
            def on_train_end(self, trainer, pl_module):
                masks = {k: v for k, v in pl_module.state_dict().items() if k.endswith(".mask")}
                torch.save(masks, Path(folder) / f"masks_rank{trainer.global_rank}.pt")

        return _Dump()


class GemmProbe:
    """Test callback: each rank writes which GEMM backend its training steps run under (``gemm_rank<R>.txt``:
    ``onednn`` when the oneDNN routing mode is active in the thread that trains, else ``aten``)."""

    def __new__(cls, folder: str):
        import lightning as L
        from torch.overrides import _get_current_function_mode_stack

        from adls_lightning.gemm import OneDNNLinearMode

        class _Probe(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                routed = any(isinstance(m, OneDNNLinearMode) for m in _get_current_function_mode_stack())
                path = Path(folder) / f"gemm_rank{trainer.global_rank}.txt"
                path.write_text("onednn" if routed else "aten")

        return _Probe()


# enough training for the tiny model to learn (chance is 0.5); half of every linear layer's weights pruned after
# epoch 3, from the trained (DDP-synchronised) weights, then one epoch of fine-tuning
LEARN = ["model/lora=none", "model.optimizer.lr=1e-3", "trainer.max_epochs=4", "prune=l1_0.5",
         "prune.activation=null", "prune.at=3"]  # fmt: skip


def _train(run_dir: Path, data_dir: Path, cache_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    from tests.helpers import TINY_OVERRIDES

    tiny = [o for o in TINY_OVERRIDES if not o.startswith("trainer=")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)]),
           "ADLS_EXTRA_TARGETS": "test_scale_out.*", "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [sys.executable, str(ROOT / "train.py"), *tiny, f"data.data_dir={data_dir}", f"paths.cache_dir={cache_dir}",
           f"hydra.run.dir={run_dir}", "seed=3", "logger=csv", *overrides]  # fmt: skip
    return subprocess.run(cmd, env=env, cwd=run_dir.parent, capture_output=True, text=True, timeout=600)


def test_ddp_cpu_one_record_the_accuracy_of_one_process_with_twice_the_batch_and_each_ranks_gemm(
    tmp_path, tiny_imdb_dir, cache_dir
):
    """Lightning DDP (2 CPU processes) under Hydra: one run folder and record, the test accuracy of one process
    with twice the batch, the same pruning masks on both ranks -- and ``runtime.gemm`` reaching each rank
    (Lightning starts them as new processes of the same command): with oneDNN forced both ranks train under its
    routing mode, while the one-process run, forced to aten, does not. One DDP run serves every claim (each costs a
    minute on 2 cores)."""
    runs = tmp_path / "runs"
    runs.mkdir()
    routed = gemm.onednn_available()  # this torch build has oneDNN (the x86 wheels do)
    probes = {}
    for name in ("ddp", "single"):
        probes[name] = tmp_path / f"gemm_{name}"
        probes[name].mkdir()
    probe = "+callbacks.gemm_probe={{_target_:test_scale_out.GemmProbe,folder:'{}'}}"
    ddp_gemm = ["runtime.gemm=onednn"] if routed else []
    ddp = ok(_train(runs / "ddp", tiny_imdb_dir, cache_dir, "trainer=ddp_cpu", "data.batch_size=4", *LEARN,
                    f"+callbacks.dump_masks={{_target_:test_scale_out.DumpMasks,folder:'{tmp_path}'}}",
                    probe.format(probes["ddp"]), *ddp_gemm))  # fmt: skip
    ok(_train(runs / "single", tiny_imdb_dir, cache_dir, "trainer=cpu", "data.batch_size=8", *LEARN,
              probe.format(probes["single"]), "runtime.gemm=aten"))  # fmt: skip
    ranks = [(probes["ddp"] / f"gemm_rank{rank}.txt").read_text() for rank in (0, 1)]
    assert ranks == (["onednn", "onednn"] if routed else ["aten", "aten"])
    assert sorted(p.name for p in probes["single"].iterdir()) == ["gemm_rank0.txt"]
    assert (probes["single"] / "gemm_rank0.txt").read_text() == "aten"
    # no extra Hydra run folders, one metrics.json, one CSV logger run (rank zero's)
    assert sorted(p.name for p in runs.iterdir()) == ["ddp", "single"]
    assert [p.relative_to(runs / "ddp") for p in (runs / "ddp").rglob("metrics.json")] == [
        Path("metrics.json")
    ]
    assert len(list((runs / "ddp").rglob("metrics.csv"))) == 1
    assert ddp.stdout.count("Run summary") == 1, ddp.stdout
    m_ddp = json.loads((runs / "ddp" / "metrics.json").read_text())
    m_one = json.loads((runs / "single" / "metrics.json").read_text())
    # both learned (chance is 0.5), from the same samples per optimizer step (2 x 4 vs 8) composed differently
    # (the distributed sampler deals each rank every other sample) and, with oneDNN, in another fp32 summation
    # order: test accuracy within 5 points of the 200 reviews, counted once (torchmetrics syncs both ranks' halves)
    assert m_one["test/acc"] >= 0.7, m_one
    assert abs(m_ddp["test/acc"] - m_one["test/acc"]) <= 0.05, (m_ddp["test/acc"], m_one["test/acc"])
    # reports are the model's, not summed over ranks: the same sparsity as one process
    sparsity = [k for k in m_one if k.startswith("prune/") and "sparsity" in k]
    assert sparsity and all(abs(m_ddp[k] - m_one[k]) < 1e-6 for k in sparsity)
    import torch

    rank0, rank1 = (torch.load(tmp_path / f"masks_rank{r}.pt") for r in (0, 1))
    assert rank0 and rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)


# -- console commands (pip install . installs adls-train / adls-search; here called as the entry points do) --------


@pytest.mark.parametrize(("command", "config_key"), [("train", "trainer"), ("search", "search")])
def test_console_commands_compose_the_packaged_configs_from_another_folder(tmp_path, command, config_key):
    code = f"import sys; sys.argv[0] = 'adls-{command}'; from adls_lightning.app.cli import {command}; {command}()"
    args = ["--cfg", "job", "--resolve"] if command == "train" else ["--cfg", "job", "search/storage=journal"]
    env = {k: v for k, v in os.environ.items() if k != "PROJECT_ROOT"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{config_key}:" in proc.stdout
    if command == "train":  # outputs go below the folder the command runs in
        assert f"log_dir: {tmp_path}/outputs" in proc.stdout
    else:
        assert "kind: journal" in proc.stdout
