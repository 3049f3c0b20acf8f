"""Compression settings of the wrong type: refused in the pre-flight with one line naming the full key and the valid
type, before anything is built or written (issue 56).

The case list is generated from the callbacks themselves: every argument of every callback a preset of
conf/quant, conf/prune, conf/compress and conf/compile builds, and every key of the sections those arguments
declare (``quant.gptq.batches``, ``prune.schedule.warmup``...), gets a value of a wrong type, checked in-process
through :func:`~adls_lightning.app.preflight.check_composed_config`; a few representative cases run the real
``train.py``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from adls_lightning.app.preflight import check_composed_config
from adls_lightning.build import resolve_target
from adls_lightning.errors import ConfigError
from adls_lightning.quant import LayerRecipe, make_quantizer
from adls_lightning.typed_settings import check_value, type_hints
from tests.helpers import assert_one_line_error, compose_config

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ("quant", "prune", "compress", "compile")
#: values of every YAML type; a case takes the first one its annotation refuses
CANDIDATES = ("not-a-value", 7, 1.5, True, [1], {"x": 1})


def presets() -> dict[str, str]:
    """One preset per callback class a compression group builds: ``{target: "group=preset"}``."""
    found: dict[str, str] = {}
    for group in GROUPS:
        for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
            if path.stem.startswith("_") or path.stem == "none":
                continue
            node = OmegaConf.select(compose_config("train", [f"{group}={path.stem}"]), group)
            if node is not None and "_target_" in node:
                found.setdefault(node._target_, f"{group}={path.stem}")
    return found


PRESETS = presets()


def wrong_value(annotation) -> object | None:
    for value in CANDIDATES:
        try:
            check_value("k", value, annotation)
        except ConfigError:
            return value
    return None  # Any: every type is valid


def _sections(annotation) -> list:
    """The TypedDict / dataclass schemas an argument's annotation names (its keys are settings too)."""
    members = typing.get_args(annotation) or (annotation,)
    return [m for m in members if typing.is_typeddict(m) or dataclasses.is_dataclass(m)]


def _fields(schema) -> dict:
    if typing.is_typeddict(schema):
        return typing.get_type_hints(schema)
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema) if f.init}


def cases() -> list[tuple[str, str, object]]:
    """``(preset, full key, wrong value)`` for every argument and every section key of every callback class."""
    out = []
    for target, preset in PRESETS.items():
        group = preset.split("=")[0]
        for name, annotation in type_hints(resolve_target(target)).items():
            if name == "return":
                continue
            value = wrong_value(annotation)
            if value is not None:
                out.append((preset, f"{group}.{name}", value))
            for schema in _sections(annotation):
                for field, field_type in _fields(schema).items():
                    value = wrong_value(field_type)
                    if value is not None:
                        out.append((preset, f"{group}.{name}.{field}", value))
    return out


CASES = cases()


def test_every_compression_callback_class_is_covered():
    targets = {t.rsplit(".", 1)[-1] for t in PRESETS}
    # the pruning presets name their mode's class (adls_lightning.callbacks.pruning): every mode is covered
    pruning_modes = {"OncePruning", "OneShotPruning", "ScheduledPruning", "StructuredPruning"}
    assert {"QuantizationCallback", "CompressionCallback", "CompileCallback", *pruning_modes} <= targets
    keys = {key for _, key, _ in CASES}
    for key in ("quant.gptq", "quant.gptq.batches", "quant.calibration.batches", "quant.smoothquant.alpha",
                "prune.weight.sparsity", "prune.schedule.warmup", "prune.sparsegpt.block_size",
                "prune.structured.heads", "compress.prune.seed", "compile.fullgraph", "compile.options"):  # fmt: skip
        assert key in keys, key


def _job(preset: str, key: str, value, tmp_path: Path):
    cfg = compose_config("train", [preset, f"hydra.run.dir={tmp_path / 'run'}"], return_hydra_config=True)
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


@pytest.mark.parametrize(("preset", "key", "value"), CASES, ids=[f"{k}={v!r}" for _, k, v in CASES])
def test_a_wrong_type_is_one_line_naming_the_key(preset, key, value, tmp_path):
    with pytest.raises(ConfigError) as info:
        check_composed_config(_job(preset, key, value, tmp_path), multirun=False)
    message = str(info.value)
    assert message.startswith(f"{key}=") or f"; {key}=" in message, message
    assert "must be" in message and "\n" not in message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("preset", "key"),
    [("quant=w4_gptq", "quant.gptq"), ("quant=int8_scaled", "quant.smoothquant"),
     ("quant=int8_scaled", "quant.calibration"), ("prune=l1_0.5", "prune.activation"),
     ("compile=inductor", "compile.options")],
)  # fmt: skip
def test_false_turns_a_section_off_as_null(preset, key, tmp_path):
    from adls_lightning.build import build

    cfg = _job(preset, key, False, tmp_path)
    job = check_composed_config(cfg, multirun=False)
    callback = build(job[key.split(".")[0]], key.split(".")[0])
    off = {
        "quant.gptq": lambda c: c.gptq is None,
        "quant.smoothquant": lambda c: c.smoothquant_alpha is None,
        "quant.calibration": lambda c: c.calibration_batches == 0,
        "prune.activation": lambda c: c.pruner.activation is None,
        "compile.options": lambda c: c.options.options is None,
    }[key]
    assert off(callback)


def test_inductor_options_are_checked_against_torchs_declared_types():
    from adls_lightning.compile import CompileOptions

    with pytest.raises(ConfigError, match=r"^compile.options.joint_custom_pre_pass='f': must be .*callable"):
        CompileOptions(options={"joint_custom_pre_pass": "f"})
    with pytest.raises(ConfigError, match=r"^compile.options.fallback_random='yes': must be true or false"):
        CompileOptions(options={"fallback_random": "yes"})
    # a YAML integer for a float setting is taken, as the float torch checks for
    options = CompileOptions(options={"max_fusion_size": 64, "fallback_random": True})
    assert options.torch_kwargs()["options"]["fallback_random"] is True


def test_frac_width_above_width_is_refused_in_the_typed_forms_and_chops_reading_asks_for_it():
    message = "frac_width=9: must be an integer in [0, 8] (width=8"
    with pytest.raises(ConfigError, match=r"frac_width=9: must be an integer in \[0, 8\] \(width=8"):
        make_quantizer("integer", width=8, frac_width=9)
    with pytest.raises(ConfigError) as info:
        LayerRecipe(weight={"format": "integer", "params": {"width": 8, "frac_width": 9}})
    assert str(info.value).startswith("weight: " + message)
    assert make_quantizer("integer", width=8, frac_width=9, frac_above_width=True).frac_width == 9


# --------------------------------------------------------------------------------------------------
# The real train.py, side by side: one line, exit 2, no run folder
# --------------------------------------------------------------------------------------------------
SUBPROCESS = [
    (("quant=w4_gptq", "quant.gptq.batches=many"), "quant.gptq.batches='many': must be an integer"),
    (("quant=w4_gptq", "quant.gptq=3"), "quant.gptq=3: must be a mapping {batches, damp, act_order, block_size}"),
    (("prune=l1_0.5", "prune.weight.sparsity=half"), "prune.weight.sparsity='half': must be a number"),
    (("compile=inductor", "+compile.options.joint_custom_pre_pass=f"), "compile.options.joint_custom_pre_pass='f'"),
    (("quant=int8", "quant.config.default.weight.params.frac_width=9"),
     "quant.config.default.weight: frac_width=9: must be an integer in [0, 8]"),
    # found at setup, where the layers' shapes are known: before any training step or checkpoint
    (("quant=w4_gptq", "quant.config.default.weight.params.group_size=48"),
     "quant.config.default.weight.params.group_size=48 does not divide the dimension of size 32 in layer "
     "bert.encoder.layer.0.attention.self.query (in_features=32; valid: 1, 2, 4, 8, 16, 32)"),
]  # fmt: skip


@pytest.mark.slow
def test_train_py_refuses_in_one_line(tmp_path, tiny_imdb_dir, cache_dir):
    def run(index: int, args: tuple[str, ...]):
        out = tmp_path / f"run{index}"
        common = ["model=tiny_random", "logger=none", "trainer=cpu", "data.max_length=64", "data.batch_size=8",
                  "data.val_size=20", "callbacks.rich_progress_bar=null", f"data.data_dir={tiny_imdb_dir}",
                  f"paths.cache_dir={cache_dir}", f"hydra.run.dir={out}"]  # fmt: skip
        proc = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *common, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        return proc, out

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda item: run(*item), enumerate(args for args, _ in SUBPROCESS)))
    for (proc, out), (_, names) in zip(results, SUBPROCESS):
        assert_one_line_error(proc, contains=names)
        assert not any(out.rglob("*.ckpt")), "a checkpoint was written"
        assert not (out / "metrics.json").exists()
