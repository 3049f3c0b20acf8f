"""Bad input, as a clumsy or a hostile user hands it to ``train.py`` and ``search.py``: every case must end with
exit code 2, one ``error:`` line naming the key or file as stderr's last line, no traceback, an earlier run's folder
unchanged file by file (sha256), and -- for a ``_target_`` that would create a file if it ran -- no such file.

Every case is a real subprocess of the entry point (the bad values several to one command line, whose one line
names each); they run side by side from one module fixture, most failing in the pre-flight check before any model is
built. Corrupt files (data, checkpoints) are made on the fly.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from adls_lightning.build import iter_targets
from tests.helpers import assert_one_line_error, compose_config, make_reviews

# every test here starts training runs or processes (minutes in all): `make test-fast` skips them
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    names: str  # what stderr's last line must contain (the key, or the file)
    script: str = "train.py"
    hostile: bool = False  # a target that would create {pwned} if it ran
    # cases of one group run as one command line (their keys differ): the pre-flight names every bad value of a
    # command line in its one line, so each case's own message (``names``: key=value and the start of the
    # refusal) is found in the group's line, from one process instead of one each (~1 CPU-s per process)
    group: str = ""


def _open(key: str) -> str:
    """An override putting ``builtins.open({pwned}, 'w')`` at ``key`` (a node replaced whole)."""
    return f"+{key}={{_target_: builtins.open, file: '{{pwned}}', mode: w}}"


def _replace(key: str) -> tuple[str, str]:
    return f"~{key}", _open(key)


TRAIN_TARGETS = {  # a hostile _target_ per config group / node a run builds
    "data": _replace("data"),
    "model": _replace("model"),
    "model.backbone": _replace("model.backbone"),
    "model.optimizer": _replace("model.optimizer"),
    "model.scheduler": _replace("model.scheduler"),
    "callbacks.evil": (_open("callbacks.evil"),),
    "callbacks.best_checkpoint": _replace("callbacks.best_checkpoint"),
    "logger.evil": (_open("logger.evil"),),
    "trainer": _replace("trainer"),
    "quant": _replace("quant"),
    "prune": _replace("prune"),
    "compress": _replace("compress"),
    "compile": _replace("compile"),
    "paths.evil": (_open("paths.evil"),),
    "hydra.callbacks.evil": (_open("hydra.callbacks.evil"),),
    "hydra.launcher": _replace("hydra.launcher"),
    # logging builds a handler from its ``class`` (or ``()``, which the override grammar cannot spell): the guard
    # names the key with ``.class``, which a parse error echoing the override would not
    "hydra.job_logging.handlers.evil.class": (
        "+hydra.job_logging.handlers.evil={class: builtins.open, file: '{pwned}', mode: w}",
    ),
    "callbacks.nested.dirpath": (
        "+callbacks.nested={_target_: lightning.pytorch.callbacks.ModelCheckpoint, "
        "dirpath: {_target_: builtins.open, file: '{pwned}', mode: w}}",
    ),
}
SEARCH_TARGETS = {  # ... and per sweeper part
    "hydra.sweeper.sampler": _replace("hydra.sweeper.sampler"),
    "hydra.sweeper.search_space": _replace("hydra.sweeper.search_space"),
    "hydra.sweeper.storage": (_open("hydra.sweeper.storage"),),
    "hydra.sweeper": ("hydra.sweeper._target_=builtins.open",),
    "search.pruner": _replace("search.pruner"),
    "search.objective.evil": (_open("search.objective.evil"),),
    "callbacks.optuna_pruning": _replace("callbacks.optuna_pruning"),
    "data": _replace("data"),
    "hydra.callbacks.evil": (_open("hydra.callbacks.evil"),),
}

CASES = [
    *[Case(f"train-target-{k}", v, k, hostile=True) for k, v in TRAIN_TARGETS.items()],
    *[Case(f"search-target-{k}", v, k, script="search.py", hostile=True) for k, v in SEARCH_TARGETS.items()],
    Case(
        "target-through-env-interpolation",
        ("+callbacks.evil._target_=${oc.env:EVIL_TARGET}",),
        "callbacks.evil",
    ),
    # values that used to pass validation and fail deep, checked together (``group``: four command lines)
    Case("lr-nan", ("model.optimizer.lr=nan",), "model.optimizer.lr=nan: must be", group="values-1"),
    Case(
        "lr-negative", ("model.optimizer.lr=-1e-3",), "model.optimizer.lr=-0.001: must be", group="values-2"
    ),
    Case("lr-text", ("model.optimizer.lr=fast",), "model.optimizer.lr='fast': must be", group="values-3"),
    Case("lr-inf", ("model.optimizer.lr=inf",), "model.optimizer.lr=inf: must be", group="values-4"),
    Case("merged-lr-nan", ("model.merged_lr=nan",), "model.merged_lr=nan: must be", group="values-1"),
    Case(
        "merged-lr-negative", ("model.merged_lr=-2e-5",), "model.merged_lr=-2e-05: must be", group="values-2"
    ),
    Case("merged-lr-text", ("model.merged_lr=slow",), "model.merged_lr='slow': must be", group="values-3"),
    Case("merged-lr-zero", ("model.merged_lr=0",), "model.merged_lr=0: must be", group="values-4"),
    Case(
        "merge-lora-text",
        ("model.merge_lora_before_compress=yes",),
        "model.merge_lora_before_compress='yes': must be true or false",
        group="values-1",
    ),
    Case(
        "merge-lora-int",
        ("model.merge_lora_before_compress=1",),
        "model.merge_lora_before_compress=1: must be true or false",
        group="values-2",
    ),
    Case(
        "freeze-embeddings-text",
        ("model.freeze_embeddings=maybe",),
        "model.freeze_embeddings='maybe': must be true or false",
        group="values-1",
    ),
    Case(
        "freeze-embeddings-null",
        ("model.freeze_embeddings=null",),
        "model.freeze_embeddings=None: must be true or false",
        group="values-2",
    ),
    Case("seed-float", ("seed=1.5",), "seed=1.5: must be an integer", group="values-1"),
    Case("seed-text", ("seed=abc",), "seed='abc': must be an integer", group="values-2"),
    Case("seed-negative", ("seed=-3",), "seed=-3: must be an integer", group="values-3"),
    Case("precision-17", ("trainer.precision=17",), "trainer.precision=17: must be one of", group="values-1"),
    Case(
        "precision-fp8",
        ("trainer.precision=fp8",),
        "trainer.precision='fp8': must be one of",
        group="values-2",
    ),
    # Lightning would train it in bf16-mixed, saying so in a warning only
    Case(
        "precision-fp16-autocast-on-cpu",
        ("trainer.precision=16-mixed",),
        "trainer.precision=16-mixed: fp16 autocast does not run on a CPU",
        group="values-3",
    ),
    Case(
        "eval-precision-fp16",
        ("model.eval_precision=fp16",),
        "model.eval_precision='fp16': must be one of",
        group="values-1",
    ),
    Case(
        "regression-bias-median",
        ("model.regression_bias_init=median",),
        "model.regression_bias_init='median': must be one of",
        group="values-1",
    ),
    # (not beside a bad trainer.precision: the accelerator is checked once the precision passed)
    Case(
        "accelerator-unknown",
        ("trainer.accelerator=quantum",),
        "trainer.accelerator='quantum': must be one of",
        group="values-4",
    ),
    Case("max-epochs-zero", ("trainer.max_epochs=0",), "trainer.max_epochs=0: must be", group="values-1"),
    Case("lora-r-zero", ("model.lora.r=0",), "model.lora.r=0: must be", group="values-1"),
    Case(
        "lora-dropout",
        ("model.lora.lora_dropout=1.5",),
        "model.lora.lora_dropout=1.5: must be",
        group="values-2",
    ),
    Case("warmup-ratio", ("model.warmup_ratio=2",), "model.warmup_ratio=2: must be", group="values-2"),
    Case("gemm-backend", ("runtime.gemm=mkl",), "runtime.gemm='mkl': must be one of", group="values-1"),
    Case("typo-key", ("data.batchsize=3",), "data.batchsize"),
    Case("unknown-preset", ("quant=int7",), "quant"),
    Case("missing-ckpt", ("ckpt_path=/no/such.ckpt",), "ckpt_path"),
    Case(
        "missing-init-ckpt",
        ("init_ckpt=/no/such.ckpt",),
        "init_ckpt=/no/such.ckpt: no such checkpoint file",
        group="values-1",
    ),
    Case(
        "init-head-unknown",
        ("init_head=encoder",),
        "init_head='encoder': must be one of checkpoint, new",
        group="values-1",
    ),
    # (not beside init_ckpt=, which it asks for)
    Case(
        "init-head-without-ckpt",
        ("init_head=new",),
        "init_head=new: replaces the head of an init_ckpt model",
        group="values-2",
    ),
    Case("earlier-run", (), "hydra.run.dir"),
    Case("run-dir-is-file", ("hydra.run.dir={file}",), "hydra.run.dir"),
    Case("run-dir-under-file", ("hydra.run.dir={file}/sub",), "hydra.run.dir"),
    # root may "write" under /proc by os.access, but no folder can be made there
    Case(
        "run-dir-under-proc",
        ("hydra.run.dir=/proc/adls-run/sub",),
        "hydra.run.dir=/proc/adls-run/sub: cannot create folders in /proc",
    ),
    # an allowed package's attribute that is a foreign object: adls_lightning.files.atomic imports os (a module
    # that imports no Lightning: resolving the target imports it, and Lightning would cost this process ~12 CPU-s)
    Case(
        "target-through-package-attribute",
        (
            "overwrite=true",
            "+callbacks.evil._target_=adls_lightning.files.atomic.os.system",
            "+callbacks.evil._args_=['touch {pwned}']",
        ),
        "callbacks.evil._target_=adls_lightning.files.atomic.os.system: is posix.system, defined outside",
        hostile=True,
    ),
    # several problems, and the folder holds a run: all of them in the one line
    Case("earlier-run-and-values", ("seed=-3", "trainer.max_epochs=0", "model.lora.r=0"), "hydra.run.dir="),
    Case("search-lr-nan", ("model.optimizer.lr=nan",), "model.optimizer.lr", script="search.py"),
    Case("search-seed-text", ("seed=abc",), "seed", script="search.py"),
    Case("search-merged-lr-nan", ("model.merged_lr=nan",), "model.merged_lr", script="search.py"),
    Case("search-typo", ("hydra.sweeper.ntrials=3",), "hydra.sweeper.ntrials", script="search.py"),
    Case(
        "search-preset-typo",
        ("search=hparamz",),
        "search=hparamz: no such preset; valid: hparams, ",
        script="search.py",
    ),
    Case(
        "search-sized-preset-typo",
        ("search/preset=cpux",),  # after the cases' own search/preset=cpu: the last one counts
        "search/preset=cpux: no such preset; valid: cpu, cpu_minilm, gpu (did you mean cpu?)",
        script="search.py",
    ),
    # options added with issues 58-59: light checkpoints, the metrics, the precision (a study's best-k, a sweeper
    # setting: tests/test_search_sweeper.py)
    Case(
        "search-space-negative",
        ("search.nas.num_hidden_layers=[-2,4]",),
        "num_hidden_layers",
        script="search.py",
    ),
    Case("search-sweep-dir-is-file", ("hydra.sweep.dir={file}",), "hydra.sweep.dir", script="search.py"),
    # found while building the run (overwrite=true gets past the earlier-run check; the folder must survive)
    Case("data-batch-size-zero", ("overwrite=true", "data.batch_size=0"), "data.batch_size"),
    # a value only the library's constructor checks (Lightning's MisconfigurationException), refused in one line
    Case(
        "checkpoint-every-negative",
        ("overwrite=true", "callbacks.last_checkpoint.every_n_train_steps=-1"),
        "callbacks.last_checkpoint: Invalid value for every_n_train_steps=-1",
    ),
    Case("data-val-size-negative", ("overwrite=true", "data.val_size=-1"), "data.val_size"),
    Case("data-truncation-side", ("overwrite=true", "data.truncation_side=middle"), "data.truncation_side"),
    Case("data-dir-missing", ("overwrite=true", "data.data_dir=/no/such/dir"), "data.data_dir"),
    # no folder: the hub, which cannot give this data set (unreachable offline, unknown online)
    Case(
        "data-hub-unavailable",
        (
            "overwrite=true",
            "data=folder",
            "data.data_dir=null",
            "data.hub_name=adls-lightning-tests/no-such-data",
        ),
        "data.data_dir: none given or found, so the data come from the Hugging Face hub's adls-lightning-tests/no-such-data",
    ),
    Case("data-train-size-text", ("overwrite=true", "data.train_size=many"), "data.train_size"),
    Case("data-train-size-zero", ("overwrite=true", "data.train_size=0"), "data.train_size=0"),
    Case("data-val-size-all-rows", ("overwrite=true", "data.val_size=400"), "data.val_size=400"),
    Case("data-max-length-negative", ("overwrite=true", "data.max_length=-5"), "data.max_length=-5"),
    # refused once the run imported Lightning, as a case here would be, and asserted elsewhere on the same path: a
    # tokenizer that cannot load (tests/test_training.py::test_hub_model_offline_is_one_line, train.py), data.max_length
    # beyond the model's positions (tests/test_bad_input_early.py, the run's own check, in-process)
    Case("ckpt-last-nothing", ("ckpt_path=last",), "ckpt_path=last"),
    *[
        Case(f"data-{kind}", ("overwrite=true", f"data.data_dir={{bad_data}}/{kind}"), names)
        for kind, names in {
            "random-parquet": "random-parquet/train.parquet",
            "truncated-parquet-half": "truncated-parquet-half/train.parquet",
            "truncated-parquet-tail": "truncated-parquet-tail/train.parquet",
            "csv-cut-in-quote": "csv-cut-in-quote/train.csv",
            "null-text": "null-text/train.parquet",
            "bad-label": "bad-label/train.parquet",
            "wrong-columns": "wrong-columns/train.parquet",
            "empty-file": "empty-file/train.csv",
            "two-train-files": "two-train-files: 2 'train' file found",  # the folder named, with the count
            "jsonl-garbage": "jsonl-garbage/train.jsonl",
        }.items()
    ],
    *[
        Case(f"{key}-{name}", ("overwrite=true", f"{key}={{ckpts}}/{name}.ckpt"), f"{name}.ckpt")
        for key in ("ckpt_path", "init_ckpt")
        for name in ("garbage", "empty", "trunc-10", "trunc-50", "trunc-99", "plain-tensor", "other-arch")
    ],
    # a lab config file given where a quantization / pruning config goes (the labs' TOML, pasted as a file). A
    # missing or unreadable quant.config file is refused by the same reader (adls_lightning.lab_config) as the
    # missing compress.quant file here: tests/test_mase_configs.py::test_bad_lab_file_is_one_line checks both
    # messages on the quantization callback in-process
    *[
        Case(case_id, ("overwrite=true", preset, override), names)
        for case_id, (preset, override, names) in {
            "quant-config-unknown-format": ("quant=int8", "quant.config={labs}/posit.toml", "posit"),
            "prune-config-quant-file": (
                "prune=l1_0.5",
                "prune.config={labs}/posit.toml",
                "prune.config.default: unknown key",
            ),
            "compress-quant-missing-file": (
                "compress=int8_l1_0.5",
                "compress.quant=no/such.toml",
                "no/such.toml",
            ),
        }.items()
    ],
    Case(
        "ckpt-pickle-exploit",
        ("overwrite=true", "ckpt_path={ckpts}/exploit.ckpt"),
        "exploit.ckpt",
        hostile=True,
    ),
]
if not torch.cuda.is_available():
    CASES.append(Case("accelerator-gpu-absent", ("trainer.accelerator=gpu",), "trainer.accelerator"))


def _command_lines(cases: list[Case]) -> dict[str, Case]:
    """One command line per case, or per ``group`` (its cases' overrides together): ``{id: case to run}``."""
    runs: dict[str, Case] = {}
    for case in cases:
        if not case.group:
            runs[case.id] = case
            continue
        joined = runs.get(case.group, Case(case.group, (), "", script=case.script))
        keys = {arg.split("=")[0] for arg in joined.args}
        assert case.script == joined.script and not keys & {a.split("=")[0] for a in case.args}, case.id
        runs[case.group] = Case(case.group, (*joined.args, *case.args), "", script=case.script)
    return runs


def _tree_hash(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def _lightning_checkpoint(hidden: int) -> dict:
    return {
        "state_dict": {
            "model.base_model.model.bert.embeddings.position_embeddings.weight": torch.randn(512, hidden),
            "model.base_model.model.classifier.modules_to_save.default.weight": torch.randn(2, hidden),
        },
        "pytorch-lightning_version": "2.6.6",
        "epoch": 0,
        "global_step": 1,
    }


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _make_ckpts(folder: Path, pwned_dir: Path) -> None:
    folder.mkdir()
    good = folder / "good.ckpt"
    torch.save(_lightning_checkpoint(32), good)
    data = good.read_bytes()
    (folder / "garbage.ckpt").write_bytes(os.urandom(4096))
    (folder / "empty.ckpt").write_bytes(b"")
    for percent in (10, 50, 99):
        (folder / f"trunc-{percent}.ckpt").write_bytes(data[: len(data) * percent // 100])
    torch.save(torch.ones(3), folder / "plain-tensor.ckpt")
    torch.save(_lightning_checkpoint(64), folder / "other-arch.ckpt")
    torch.save(
        {"state_dict": _Exploit(str(pwned_dir / "ckpt-pickle-exploit")), "pytorch-lightning_version": "x"},
        folder / "exploit.ckpt",
    )


def _make_bad_data(folder: Path, good: Path) -> None:
    train = (good / "train.parquet").read_bytes()

    def kind(name: str) -> Path:
        d = folder / name
        d.mkdir(parents=True)
        shutil.copy(good / "test.parquet", d)
        return d

    (kind("random-parquet") / "train.parquet").write_bytes(os.urandom(8000))
    (kind("truncated-parquet-half") / "train.parquet").write_bytes(train[: len(train) // 2])
    (kind("truncated-parquet-tail") / "train.parquet").write_bytes(train[:-3])
    reviews = make_reviews(60, seed=3)
    reviews.loc[9, "text"] = 'she said "stop, please" twice'
    text = reviews.to_csv(index=False)
    (kind("csv-cut-in-quote") / "train.csv").write_text(text[: text.index('"stop') + 4])
    nulls = make_reviews(60, seed=3)
    nulls.loc[7, "text"] = None
    nulls.to_parquet(kind("null-text") / "train.parquet")
    labels = make_reviews(60, seed=3)
    labels.loc[4, "label"] = 2
    labels.to_parquet(kind("bad-label") / "train.parquet")
    make_reviews(60, seed=3).rename(columns={"text": "review"}).to_parquet(
        kind("wrong-columns") / "train.parquet"
    )
    (kind("empty-file") / "train.csv").write_text("")
    two = kind("two-train-files")
    shutil.copy(good / "train.parquet", two)
    make_reviews(60, seed=3).to_csv(two / "train.csv", index=False)
    (kind("jsonl-garbage") / "train.jsonl").write_text('{"text": "fine", "label": 1}\n{"text": "cut\n')


def _make_earlier_run(folder: Path) -> None:
    (folder / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (folder / ".hydra" / name).write_text(f"# the earlier run's {name}\nseed: 7\n")
    (folder / "metrics.json").write_text('{"val/acc": 0.875}\n')
    (folder / "train.log").write_text("earlier run's log\n")
    (folder / "checkpoints").mkdir()
    torch.save(_lightning_checkpoint(32), folder / "checkpoints" / "best-epoch00-step1.ckpt")
    (folder / "csv").mkdir()
    (folder / "csv" / "metrics.csv").write_text("epoch,step,val/acc\n0,1,0.875\n")


def _run(case: Case, base: Path, data_dir: Path, cache_dir: Path) -> dict:
    work = base / case.id
    earlier = work / "earlier-run"
    _make_earlier_run(earlier)
    a_file = work / "a-file"
    a_file.write_text("not a folder\n")
    pwned = base / "pwned" / case.id
    paths = {
        "pwned": pwned,
        "file": a_file,
        "bad_data": base / "bad_data",
        "ckpts": base / "ckpts",
        "labs": base / "labs",
    }
    common = [
        "model=tiny_random",
        "logger=none",
        "trainer=cpu",
        "data.max_length=64",
        "data.batch_size=8",
        "data.val_size=20",
        "callbacks.rich_progress_bar=null",
        f"data.data_dir={data_dir}",
        f"paths.cache_dir={cache_dir}",
        f"hydra.run.dir={earlier}",
    ]
    if case.script == "search.py":
        common += ["search/preset=cpu", f"hydra.sweep.dir={earlier}", "hydra.sweeper.n_trials=1"]
    if case.id.endswith("target-data"):  # the data node is replaced whole: its usual keys would not compose
        common = [arg for arg in common if not arg.startswith("data.")]
    args = [_fill(arg, paths) for arg in [*common, *case.args]]
    before = _tree_hash(earlier)
    env = {**os.environ, "WANDB_MODE": "offline", "EVIL_TARGET": "builtins.open", "HYDRA_FULL_ERROR": "0"}
    env.pop("ADLS_EXTRA_TARGETS", None)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(ROOT / case.script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return {
        "proc": done,
        "unchanged": before == _tree_hash(earlier),
        "pwned": pwned.exists(),
        "seconds": time.perf_counter() - start,
    }


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _fill(arg: str, paths: dict[str, Path]) -> str:
    for key, value in paths.items():
        arg = arg.replace("{" + key + "}", str(value))
    return arg


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, tiny_imdb_dir, cache_dir) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("bad_input")
    (base / "pwned").mkdir()
    _make_bad_data(base / "bad_data", tiny_imdb_dir)
    _make_ckpts(base / "ckpts", base / "pwned")
    (base / "labs").mkdir()
    (base / "labs" / "posit.toml").write_text('[default]\nname = "posit"\n')
    start, cpu_start = time.perf_counter(), _children_cpu()
    runs = _command_lines(CASES)
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {
            run_id: pool.submit(_run, case, base, tiny_imdb_dir, cache_dir) for run_id, case in runs.items()
        }
        by_run = {run_id: future.result() for run_id, future in futures.items()}
    total, cpu = time.perf_counter() - start, _children_cpu() - cpu_start
    slowest = max(by_run.items(), key=lambda item: item[1]["seconds"])
    # CPU seconds do not depend on what else the machine runs: cpu / cores is the wall time on an idle machine.
    print(
        f"\n{len(CASES)} bad-input cases in {len(runs)} processes, {total:.0f} s wall ({WORKERS} at a time), "
        f"{cpu:.0f} CPU-s in the processes ({os.cpu_count()} cores); slowest {slowest[0]} "
        f"{slowest[1]['seconds']:.0f} s"
    )
    return {case.id: by_run[case.group or case.id] for case in CASES}


def test_every_node_a_run_builds_from_is_probed_with_a_hostile_target():
    """Each top-level node of a run's config that holds a ``_target_`` (with every compression group set) has a
    case that puts ``builtins.open`` there, so a new group cannot slip past the guarded builder untested."""
    groups = ["quant=int8", "prune=l1_0.5", "compress=l1_0.5", "compile=inductor", "logger=csv"]
    cfg = compose_config("train", groups, return_hydra_config=True)
    built = {where.split(".")[0].split("[")[0] for where, _ in iter_targets(cfg, "")}
    probed = {case.names.split(".")[0] for case in CASES if case.hostile}
    assert built <= probed, f"no hostile-target case for {sorted(built - probed)}"
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_one_line(outcomes, case):
    result = outcomes[case.id]
    assert_one_line_error(result["proc"], contains=case.names)
    assert result["unchanged"], "the earlier run's folder changed"
    if case.hostile:
        assert not result["pwned"], "a refused target ran"


def test_the_precisions_checked_without_lightning_are_lightnings():
    """The pre-flight check reads ``trainer.precision``'s values from its own list, without importing Lightning:
    the list must be exactly what the installed Lightning accepts (a new Lightning that adds or drops one fails
    here, not in users' runs)."""
    import typing

    from lightning.fabric.connector import _PRECISION_INPUT

    from adls_lightning.app.preflight import LIGHTNING_PRECISIONS

    accepted = [value for group in typing.get_args(_PRECISION_INPUT) for value in typing.get_args(group)]
    assert list(LIGHTNING_PRECISIONS) == accepted


@pytest.mark.parametrize(
    ("script", "env", "names"),
    [
        ("lab1_figures.sh", {"WIDTHS": "4 7"}, "WIDTHS: no preset quant=int7 (valid: 4 8 12 16 20 24 28 32)"),
        # a preset that is not a width (int8_scaled calibrates its scale) is refused too
        (
            "lab1_figures.sh",
            {"WIDTHS": "8_scaled"},
            "WIDTHS: no preset quant=int8_scaled (valid: 4 8 12 16 20",
        ),
        ("lab1_figures.sh", {"SPARSITIES": "0.35"}, "SPARSITIES: no presets prune=l1_0.35"),
        ("lab1_figures.sh", {"WIDTHS": " "}, "WIDTHS and SPARSITIES must not be empty"),
        ("search_figures.sh", {"LAB3_TRIALS": "many"}, "LAB3_TRIALS=many: must be a positive integer"),
        ("search_figures.sh", {"SAMPLER_TRIALS": "0"}, "SAMPLER_TRIALS=0: must be a positive integer"),
        ("search_figures.sh", {"FP_CKPT": "/no/such.ckpt"}, "FP_CKPT=/no/such.ckpt: no such checkpoint file"),
    ],
)
def test_figure_scripts_refuse_bad_settings_before_running_anything(tmp_path, script, env, names):
    """The figure scripts' environment settings are checked before the first run: nothing is run or written."""
    ran = tmp_path / "ran"
    fake_python = tmp_path / "python"
    # answers the scripts' interpreter probe (`$PY -c ""`, scripts/checks.sh); anything else is a run
    fake_python.write_text(f'#!/bin/sh\n[ "$1" = "-c" ] && exit 0\ntouch {ran}\n')
    fake_python.chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / script)],
        env={**os.environ, **env, "PY": str(fake_python), "OUT": str(out), "SEARCH_DIR": str(out)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert_one_line_error(proc, contains=names)
    assert not ran.exists() and not out.exists()


def test_a_refused_run_names_every_problem_of_its_command_line(outcomes):
    line = assert_one_line_error(outcomes["earlier-run-and-values"]["proc"])
    for problem in ("seed=-3", "trainer.max_epochs=0", "model.lora.r=0", "holds an earlier run"):
        assert problem in line, line


def test_a_read_only_file_system_is_refused_in_one_line(tmp_path, monkeypatch):
    """No read-only mount to use here (a test may not mount one): the folder's creation fails as on one."""
    import errno
    import tempfile

    from adls_lightning.errors import ConfigError
    from adls_lightning.runs.folder import check_output_dir

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(ConfigError) as refused:
        check_output_dir(tmp_path / "run", {})
    assert str(refused.value) == (
        f"hydra.run.dir={tmp_path / 'run'}: cannot create folders in {tmp_path} (Read-only file system); give a "
        "folder you can write to"
    )
    assert list(tmp_path.iterdir()) == []
