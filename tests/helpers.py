"""Helpers for the tests: :func:`compose_config` (the project's configs composed in-process, as the entry points
compose them), :func:`requires` (skip unless the machine has a GPU / a PostgreSQL server); for the tests that run the entry points as subprocesses, kill-and-resume runs of ``train.py`` and
the one-line error check of bad input.

Two callbacks ride along in a ``train.py`` subprocess through ``ADLS_EXTRA_TARGETS``: :class:`RecordBatches`
writes a fingerprint of every training batch per global step, :class:`KillAtStep` ends the process at a given
step the way SIGKILL would (``os._exit``: no checkpoint, no clean-up, nothing flushed), so a kill lands at the
same step on every machine.

Everything else test modules share is here too, one section each (the tiny synthetic reviews, exports of a tiny
model, in-process runs and tool calls, search.py studies, the toy sweeper, hand-written shapes of the tiny model):
no test module imports another (``tests/test_hygiene.py``), and every module of ``tests/`` is imported as
``from tests.<module> import ...``.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import numpy as np
import optuna
import pandas as pd
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict
from torch import nn
from torch.overrides import TorchFunctionMode

from adls_lightning import gemm
from adls_lightning.build import build
from adls_lightning.lora import merge_lora

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
KILLED_EXIT = 17


def compose_config(config_name: str, overrides=(), *, return_hydra_config: bool = False) -> DictConfig:
    """``conf/<config_name>.yaml`` with ``overrides``, composed as the entry points compose it (no version_base:
    Hydra's current defaults, as ``adls_lightning.app.cli``)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR)):
        return compose(config_name, list(overrides), return_hydra_config=return_hydra_config)


#: What a test may need that a machine may lack: (is it here?, the skip reason). ``gpu`` and ``postgres`` are also
#: pytest markers (``-m "not gpu"``), which :func:`requires` adds.
REQUIREMENTS: dict[str, tuple[Callable[[], bool], str]] = {
    "gpu": (lambda: torch.cuda.is_available(), "needs a CUDA device"),
    "postgres": (
        lambda: shutil.which("initdb") is not None,
        "no PostgreSQL server binary (initdb) on this machine: apt-get install postgresql",
    ),
}


def requires(*needs: str) -> Callable:
    """Decorator: mark a test with each of ``needs`` and skip it unless the machine has them all."""
    missing = [REQUIREMENTS[need][1] for need in needs if not REQUIREMENTS[need][0]()]

    def decorate(test: Callable) -> Callable:
        for need in needs:
            test = getattr(pytest.mark, need)(test)
        return pytest.mark.skipif(bool(missing), reason="; ".join(missing))(test)

    return decorate


class RecordBatches(L.Callback):
    """Append ``{"step": global_step, "rows": [crc32 of each row's tokens]}`` per training batch to a file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rows = [zlib.crc32(row[row != 0].numpy().tobytes()) for row in batch["input_ids"]]
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": trainer.global_step, "rows": rows}) + "\n")


class KillAtStep(L.Callback):
    """``os._exit(KILLED_EXIT)`` when the given global step is about to run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os._exit(KILLED_EXIT)


def train_cmd(data_dir: Path, cache_dir: Path, out: Path, *extra: str) -> list[str]:
    """``train.py`` on the tiny random BERT and ``data_dir``, writing into ``out``; ``extra`` overrides last."""
    paths = [f"data.data_dir={data_dir}", f"paths.cache_dir={cache_dir}", f"hydra.run.dir={out}"]
    return [sys.executable, str(ROOT / "train.py"), *TINY_OVERRIDES, *paths, *extra]


def run_train(
    data_dir: Path,
    cache_dir: Path,
    out: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    ctrl_c: bool = False,
) -> subprocess.CompletedProcess:
    """Run :func:`train_cmd` to the end (this module's callbacks allowed as targets); output captured.

    ``ctrl_c``: start it with SIGINT's default action, as from a terminal (pytest-xdist's workers ignore SIGINT,
    and a child inherits that, so a Ctrl-C the test sends would otherwise be dropped)."""
    full_env = {
        **os.environ,
        "ADLS_EXTRA_TARGETS": f"{__name__}.*",
        "PYTHONPATH": str(ROOT),
        "WANDB_MODE": "offline",
        **(env or {}),
    }
    return subprocess.run(
        train_cmd(data_dir, cache_dir, out, *extra),
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if ctrl_c else None,
    )


def batches_file(out: Path) -> Path:
    """Where :func:`recording` makes a run in ``out`` write its batches (beside the run folder, not in it)."""
    return out.parent / f"{out.name}-batches.jsonl"


def recording(out: Path) -> list[str]:
    """Overrides adding :class:`RecordBatches` to a run in ``out``."""
    return [
        f"+callbacks.record._target_={__name__}.RecordBatches",
        f"+callbacks.record.path={batches_file(out)}",
    ]


def recorded_batches(out: Path) -> dict[int, list[int]]:
    """Step -> row fingerprints; a step trained twice (before the kill and again after) keeps its last record."""
    lines = batches_file(out).read_text().splitlines()
    return {rec["step"]: rec["rows"] for rec in map(json.loads, lines)}


def kill_and_resume(
    data_dir: Path,
    cache_dir: Path,
    base: Path,
    overrides: list[str],
    kill_at_step: int,
    *,
    uninterrupted: bool = True,
    on_killed: Callable[[Path], None] | None = None,
) -> dict[str, Path | str | int]:
    """Train ``overrides`` in ``base/killed``, killed before ``kill_at_step``, then resume it with ``ckpt_path=last``.

    With ``uninterrupted`` the same run trains whole in ``base/whole`` meanwhile (side by side with the run to be
    killed). Both record their batches (:func:`recorded_batches`). ``on_killed(folder)`` sees the killed run's
    folder before the resume.

    Returns:
        ``{"killed": folder, "whole": folder (with uninterrupted), "resumed_stderr": ..., "resumed_from_step":
        the global step of the last.ckpt the resume started from}``.
    """
    killed = base / "killed"
    kill = [f"+callbacks.kill._target_={__name__}.KillAtStep", f"+callbacks.kill.step={kill_at_step}"]
    runs = {"killed": (killed, [*overrides, *recording(killed), *kill])}
    if uninterrupted:
        runs["whole"] = (base / "whole", [*overrides, *recording(base / "whole")])
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {
            name: pool.submit(run_train, data_dir, cache_dir, out, *args)
            for name, (out, args) in runs.items()
        }
        results = {name: future.result() for name, future in futures.items()}
    if uninterrupted:
        assert results["whole"].returncode == 0, results["whole"].stderr[-3000:]
    assert results["killed"].returncode == KILLED_EXIT, results["killed"].stderr[-3000:]
    assert not (killed / "metrics.json").exists()
    last = killed / "checkpoints" / "last.ckpt"
    resumed_from = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    if on_killed is not None:
        on_killed(killed)
    resumed = run_train(data_dir, cache_dir, killed, *overrides, *recording(killed), "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out: dict[str, Path | str | int] = {
        "killed": killed,
        "resumed_stderr": resumed.stderr,
        "resumed_from_step": resumed_from,
    }
    if uninterrupted:
        out["whole"] = base / "whole"
    return out


def assert_one_line_error(
    proc: subprocess.CompletedProcess, starts: str = "error: ", contains: str = ""
) -> str:
    """Bad input's promise: exit code 2, stderr's last line ``error: ...`` (starting with ``starts``, holding
    ``contains``), no traceback anywhere. Returns that line."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and lines[-1].startswith(starts), proc.stderr[-3000:]
    assert contains in lines[-1], lines[-1]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


# -- the tiny synthetic IMDb and the tiny run's overrides (conftest.py's fixtures use them) ---------------------------


POSITIVE = ["great", "wonderful", "loved", "excellent", "superb", "brilliant"]


NEGATIVE = ["awful", "terrible", "hated", "boring", "worst", "dreadful"]


FILLER = ["the", "movie", "film", "plot", "actors", "scene", "story", "was", "and", "it", "a", "of"]


def make_reviews(n: int, seed: int) -> pd.DataFrame:
    """Synthetic reviews whose label is given by sentiment keywords in filler text (learnable by a tiny BERT)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = i % 2
        words = list(rng.choice(FILLER, rng.integers(5, 40)))
        for _ in range(rng.integers(1, 4)):
            words.insert(int(rng.integers(0, len(words))), str(rng.choice(POSITIVE if label else NEGATIVE)))
        rows.append((" ".join(words), label))
    return pd.DataFrame(rows, columns=["text", "label"])


TINY_OVERRIDES = [
    "model=tiny_random",
    "logger=none",
    "trainer=cpu",
    "data.max_length=64",
    "data.batch_size=8",
    "data.val_size=100",
    "callbacks.rich_progress_bar=null",
]


# -- exports of a tiny model (tests/test_export*.py, test_predict.py, test_families.py) -------------------------------


TINY = ["model=tiny_random"]


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def build_module(overrides: list[str]):
    GlobalHydra.instance().clear()
    try:
        return build(compose_config("train", overrides).model, "model", _convert_="partial")
    finally:
        GlobalHydra.instance().clear()


def trained_checkpoint(path: Path, overrides: list[str]) -> nn.Module:
    """A checkpoint of ``overrides``' model whose LoRA B matrices are non-zero (so the merge matters)."""
    torch.manual_seed(0)
    module = build_module(overrides)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.05)
    # the keys of a Lightning checkpoint that the export reads through the guarded reader (weights only)
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": L.__version__}, path)
    return module


def merged_model(ckpt: Path, overrides: list[str]) -> nn.Module:
    """The checkpoint's model rebuilt here, independently of the export command: load, merge LoRA."""
    module = build_module(overrides)
    module.load_state_dict(torch.load(ckpt, weights_only=False)["state_dict"])
    merge_lora(module)
    return module.model.eval()


def run_export(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m adls_lightning.export ARGS`` from the checkout, offline (``env``: instead of :data:`ENV`)."""
    command = [sys.executable, "-m", "adls_lightning.export", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env or ENV, cwd=ROOT, timeout=600)


# -- in-process training runs and tool calls --------------------------------------------------------------------------


# a short run of the tiny model (as tests/test_export_onnx.py); each case adds its compression
SHORT_RUN = [
    "data.train_size=48",
    "data.val_size=16",
    "data.test_size=40",
    "data.max_length=24",
    "trainer.max_epochs=1",
]


def call(entry, *args: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = entry(list(args))
    return code, stdout.getvalue(), stderr.getvalue()


def train_run(out: Path, overrides: list[str], tiny_imdb_dir: Path, cache_dir: Path) -> dict[str, float]:
    """``train.py`` with ``overrides`` on the tiny data, in this process, writing its run folder ``out``."""
    from adls_lightning.app.training import run

    base = [*TINY_OVERRIDES, f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}"]
    cfg = compose_config("train", [*base, f"hydra.run.dir={out}", *overrides], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(out)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    try:
        return run(cfg)
    finally:
        GlobalHydra.instance().clear()


# -- search.py studies on the tiny data (the `search` fixture is in conftest.py) --------------------------------------


TINY_NAS = [
    "hydra.sweeper.search_space.num_hidden_layers=[1,2]",
    "hydra.sweeper.search_space.num_attention_heads=[2,4]",
    "hydra.sweeper.search_space.hidden_size=[16,32]",
    "hydra.sweeper.search_space.intermediate_size=[32,64]",
]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def load_study(tmp_path: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'sweep' / name}.db")


def linear_layers(hidden: int, intermediate: int, layers: int) -> dict[str, int]:
    """Weight element counts of every linear layer of a BERT classifier, by name (hand-written)."""
    sizes = {}
    for i in range(layers):
        prefix = f"bert.encoder.layer.{i}."
        for name in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
        ):
            sizes[prefix + name] = hidden * hidden
        sizes[prefix + "intermediate.dense"] = hidden * intermediate
        sizes[prefix + "output.dense"] = intermediate * hidden
    sizes["bert.pooler.dense"] = hidden * hidden
    sizes["classifier"] = hidden * 2
    return sizes


# The 12 formats of `quant=` (the list, written out by hand: the registry must hold exactly these).
FORMATS = (
    "integer", "log", "block_fp", "block_log", "block_minifloat", "minifloat_ieee", "minifloat_denorm",
    "binary", "binary_scaling", "binary_residual", "ternary", "mxint8",
)  # fmt: skip


# The entry points' commands (``[script, *argv]``, the script ``search.py`` or ``train.py``), each in turn in one
# Python process as the script runs it: a process's start-up (Lightning's imports, ~15 CPU-s) costs several times a
# tiny run or study. A command that exits non-zero prints ``EXIT <script> <code>`` and the next one runs.
ENTRY_POINTS_APP = """
import json, sys
from pathlib import Path
from hydra.core.global_hydra import GlobalHydra
from adls_lightning.app import cli
conf, commands = Path(sys.argv[1]), json.loads(sys.argv[2])
for script, *argv in commands:
    sys.argv = [script, *argv]
    GlobalHydra.instance().clear()
    try:
        getattr(cli, script.removesuffix(".py"))(conf)
    except SystemExit as err:
        if err.code:
            print("EXIT", script, err.code, flush=True)
"""


def run_entry_points(commands: list[list[str]], timeout: float = 900) -> subprocess.CompletedProcess:
    """:data:`ENTRY_POINTS_APP` over ``commands`` in one process; asserts that every command exited 0."""
    # one thread: the runs are tiny, and OpenMP threads spin on a shared CPU
    env = {**os.environ, "PROJECT_ROOT": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", ENTRY_POINTS_APP, str(CONF_DIR), json.dumps(commands)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0 and "EXIT" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def run_studies(runs: list[list[str]], timeout: float = 900) -> None:
    """search.py once per override list, all in one Python process (:func:`run_entry_points`)."""
    run_entry_points([["search.py", *argv] for argv in runs], timeout)


def tiny_run(data_dir: Path, cache_dir: Path) -> list[str]:
    """Overrides of a seconds-long trial: tiny data, one epoch."""
    return [
        f"data.data_dir={data_dir}", f"paths.cache_dir={cache_dir}", "trainer=cpu", "trainer.max_epochs=1",
        "callbacks.rich_progress_bar=null", "data.max_length=16", "data.batch_size=16", "data.train_size=32",
        "data.val_size=32", "data.test_size=32",
    ]  # fmt: skip


# -- the toy sweeper app (the `toy` and `postgres` fixtures are in conftest.py) ---------------------------------------


def job_started(pids: Path) -> bool:
    """Whether a toy job run with ``log_pid=<pids>`` has started (its trial's parameters are then all sampled)."""
    return pids.is_dir() and any(pids.iterdir())


PG_PASSWORD = "s3cret-pw"


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- shapes of the tiny model, written out by hand --------------------------------------------------------------------


def expected_param_count(
    layers: int,
    hidden: int,
    intermediate: int,
    identities: int = 0,
    vocab: int = 100,
    positions: int = 64,
    labels: int = 2,
) -> int:
    """BERT classifier parameter count derived by hand from the architecture (independent of transformers)."""
    embeddings = (
        vocab + positions + 2
    ) * hidden + 2 * hidden  # word, position, token-type tables + LayerNorm
    attention = 4 * (hidden * hidden + hidden) + 2 * hidden  # q, k, v, output dense + LayerNorm
    feed_forward = (hidden * intermediate + intermediate) + (intermediate * hidden + hidden) + 2 * hidden
    pooler = hidden * hidden + hidden
    classifier = hidden * labels + labels
    removed = identities * (hidden * hidden + hidden)  # each identity drops one square weight + bias
    return embeddings + layers * (attention + feed_forward) + pooler + classifier - removed


# hidden 32, 2 layers: per layer q, k, v, attention.output (32x32), intermediate (64x32), output (32x64)
LAYER_NAMES = [
    f"bert.encoder.layer.{i}.{part}"
    for i in range(2)
    for part in (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    )
] + ["bert.pooler.dense", "classifier"]


# tiny_random: 2 layers x 6 linears + pooler + classifier
TINY_LINEARS = 14


class CountDropoutCalls(TorchFunctionMode):
    """Counts ``F.dropout`` calls while a model runs eagerly: an independent count of dropout sites."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.nn.functional.dropout
        return func(*args, **(kwargs or {}))


def layer_problem(out: int, features: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and correlated inputs (a few strong directions, as real activations have)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, features, generator=generator)
    mixing = torch.randn(features, features, generator=generator) * torch.linspace(2, 0.05, features)
    x = torch.randn(tokens, features, generator=generator) @ mixing
    return weight, x


# -- number formats ---------------------------------------------------------------------------------------------------

#: one valid parameter set per registered number format (block sizes divide the tiny models' 16-wide heads and rows)
FORMAT_PARAMS = {
    "integer": {"width": 8, "frac_width": 4},
    "minifloat_ieee": {"width": 8, "exponent_width": 4, "exponent_bias": 7},
    "minifloat_denorm": {"width": 8, "exponent_width": 4, "exponent_bias": 7},
    "log": {"width": 8},
    "block_fp": {"width": 7, "exponent_width": 8, "exponent_bias": 127, "block_size": 16},
    "block_minifloat": {"width": 8, "exponent_width": 4, "exponent_bias_width": 8, "block_size": 16},
    "block_log": {"width": 8, "exponent_bias_width": 4, "block_size": 16},
    "binary": {},
    "binary_scaling": {},
    "binary_residual": {"levels": 2},
    "ternary": {},
    "mxint8": {},
    "scaled_integer": {"width": 8},
}


class RecordTestLogits(L.Callback):
    """Records the logits the run's own model computes on each test batch (the model as the run evaluated it)."""

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []
        self.logits: list[torch.Tensor] = []

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}
        with torch.inference_mode():
            self.logits.append(pl_module.model(**inputs).logits.detach().clone())
        self.batches.append({k: v.detach().clone() for k, v in inputs.items()})


def recorded_run(
    out: Path, overrides: list[str], tiny_imdb_dir, cache_dir, monkeypatch
) -> tuple[dict, RecordTestLogits]:
    recorder = RecordTestLogits()
    from adls_lightning.app import training

    build = training.instantiate_callbacks
    monkeypatch.setattr(training, "instantiate_callbacks", lambda cfg: [*build(cfg), recorder])
    metrics = train_run(out, overrides, tiny_imdb_dir, cache_dir)
    monkeypatch.setattr(training, "instantiate_callbacks", build)
    return metrics, recorder


def cpuinfo_lines(vendor: str, family: int, model: int, name: str, mhz: int, flags: str) -> str:
    """The first processor's lines of a /proc/cpuinfo, as the library reads them."""
    fields = {"processor": 0, "vendor_id": vendor, "cpu family": family, "model": model, "model name": name}
    return "".join(f"{k}\t: {v}\n" for k, v in {**fields, "cpu MHz": f"{mhz}.000", "flags": flags}.items())


X86_BASE_FLAGS = "fpu sse sse2 pni ssse3 sse4_1 sse4_2 popcnt avx f16c fma avx2 bmi1 bmi2"
AVX512_FLAGS = "avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"
# Two virtual machines of this project that call themselves by one name (/proc/cpuinfo, 2026-11-28 and 2026-11-29):
# a Zen 4 guest with AVX-512 BF16 and a Zen 3 guest with AVX2 only; and an Intel Xeon with AMX.
ZEN4_CPUINFO = cpuinfo_lines("AuthenticAMD", 25, 17, "AMD EPYC", 2600, f"{X86_BASE_FLAGS} {AVX512_FLAGS}")
ZEN3_CPUINFO = cpuinfo_lines("AuthenticAMD", 25, 1, "AMD EPYC", 2450, X86_BASE_FLAGS)
AMX_CPUINFO = cpuinfo_lines(
    "GenuineIntel",
    6,
    143,
    "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
    2700,
    f"{X86_BASE_FLAGS} {AVX512_FLAGS} amx_bf16 amx_tile amx_int8",
)


def on_cpu(monkeypatch, tmp_path, text: str, name: str) -> None:
    """Make the library read ``text`` as this machine's /proc/cpuinfo."""
    path = tmp_path / f"cpuinfo-{name}"
    path.write_text(text)
    monkeypatch.setattr(gemm, "CPUINFO", path)


# adls-table's inputs and output: run folders as train.py leaves them, the table's rows
#: a run record's data node: IMDb from the hub (the task adls-table compares)
IMDB_RUN_DATA = {
    "_target_": "adls_lightning.data.IMDbDataModule",
    "hub_name": "stanfordnlp/imdb",
    "main_metric": "acc",
}


def write_run(folder: Path, overrides: list[str], metrics: dict, data: dict | None = None) -> Path:
    """A run folder as train.py leaves it: metrics.json and the .hydra record (config and overrides)."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": 1, "data": data or IMDB_RUN_DATA}))
    return folder


def table_rows(text: str) -> dict[str, list[str]]:
    """``{first cell: the other cells}`` of a markdown table's body."""
    lines = [line for line in text.splitlines() if line.startswith("|")][2:]
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines}


def table(*args: str) -> subprocess.CompletedProcess:
    """``adls-table`` (its module) run with ``args`` from the checkout."""
    return subprocess.run(
        [sys.executable, "-m", "adls_lightning.reports.table", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_sweep(root: Path) -> tuple[Path, dict]:
    """A multirun folder as train.py -m leaves it: 2 methods x 3 seeds, numbered job folders, random metrics; and
    the metrics by method."""
    rng = np.random.default_rng(0)
    values = {}
    for job, (method, seed) in enumerate((m, s) for m in ("l1_0.5", "wanda_0.5") for s in (1, 2, 3)):
        metrics = {
            "test/acc": float(rng.uniform(0.6, 0.9)),
            "test/f1": float(rng.uniform(0.6, 0.9)),
            "test/loss": 0.5,
            "val/acc": float(rng.uniform(0.6, 0.9)),
            "params/trainable": 1000,
            "params/total": 5000,
            "prune/weight_sparsity": 0.5,
        }
        values.setdefault(method, []).append(metrics)
        write_run(root / str(job), ["model=tiny_random", f"prune={method}", f"seed={seed}"], metrics)
    (root / "multirun.yaml").write_text("{}")
    return root, values


# -- docs/extending.md's toy plugin: a number format and a pruning method (tests/test_extending.py, test_plugin_errors.py)


TOY_PLUGIN_SOURCE = '''
"""A toy format: round to multiples of 2^-step_bits, stored in 4 bits; and a toy pruning method."""
import torch

from adls_lightning.prune import register_method
from adls_lightning.quant.quantizers import Quantizer, register_format


@register_format
class ToyStepQuantizer(Quantizer):
    format_name = "toy_step"
    search_space = {"params": {"step_bits": [1, 2]}}

    def __init__(self, step_bits: int = 2) -> None:
        super().__init__()
        self.step = 2.0 ** -step_bits

    def quantize(self, x, need_mask):
        return torch.round(x / self.step) * self.step, None

    def bits_per_element(self, last_dim):
        return 4.0


@register_method("toy_largest")
def largest_first(tensor, generator):
    return -tensor.detach().abs()
'''
