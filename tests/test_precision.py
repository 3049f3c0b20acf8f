"""``trainer.precision=auto`` (adls_lightning.precision): every branch with mocked CPU flags and timings, the app's
resolution before the trainer is built, the one-line refusal; and every custom op under bf16 autocast against fp32."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from adls_lightning import precision
from adls_lightning.app.preflight import validate_trainer
from adls_lightning.errors import ConfigError
from adls_lightning.gemm import MEASUREMENTS, LinearShape, cpu_name
from tests.helpers import FORMAT_PARAMS, assert_one_line_error, compose_config, run_train, train_run

AVX2_FLAGS = "fpu sse sse2 avx avx2 fma"
AVX512_BF16_FLAGS = "fpu sse avx2 fma avx512f avx512_vnni avx512_bf16"
AMX_FLAGS = "fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"


def _linear_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def _never_measure(*_args):
    raise AssertionError("auto measured where it should not")


def _timings(fp32: float, bf16: float):
    """A measure_fn returning these seconds (and counting its calls)."""
    calls = []

    def measure_fn(shapes, rows):
        calls.append((shapes, rows))
        return {"fp32": fp32, "bf16": bf16}

    measure_fn.calls = calls
    return measure_fn


def _reference():
    return 100.0


# --- the decision ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["32-true", "bf16-mixed", "16-mixed"])
def test_explicit_precision_is_returned_unchanged_without_measuring(value):
    chosen = precision.choose(value, _linear_model(), 512, flags=AMX_FLAGS, measure_fn=_never_measure)
    assert chosen == value


def test_avx2_only_cpu_keeps_fp32_without_measuring(caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="adls_lightning.precision"):
        chosen = precision.choose(
            "auto", _linear_model(), 512, tmp_path, flags=AVX2_FLAGS, measure_fn=_never_measure
        )
    assert chosen == "32-true"
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trainer.precision=auto:")]
    assert line.startswith("trainer.precision=auto: 32-true") and cpu_name() in line
    assert not (tmp_path / precision.CACHE_FILE).exists()


def test_unreadable_flags_keep_fp32_without_measuring():
    assert precision.choose("auto", _linear_model(), 512, flags="", measure_fn=_never_measure) == "32-true"


@pytest.mark.parametrize("flags", [AVX512_BF16_FLAGS, AMX_FLAGS])
def test_bf16_cpu_measured_faster_takes_bf16_and_caches_it(flags, caplog, tmp_path):
    measure_fn = _timings(fp32=2.0, bf16=1.0)  # bf16 twice as fast
    model = _linear_model()
    with caplog.at_level(logging.INFO, logger="adls_lightning.precision"):
        chosen = precision.choose(
            "auto", model, 256, tmp_path, flags=flags, measure_fn=measure_fn, reference_fn=_reference
        )
    assert chosen == "bf16-mixed"
    # measured on the model's own shapes, at the run's rows, MEASUREMENTS times
    shapes, rows = measure_fn.calls[0]
    assert shapes == Counter({LinearShape(64, 128, True): 1, LinearShape(128, 64, True): 1})
    assert rows == 256 and len(measure_fn.calls) == MEASUREMENTS
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trainer.precision=auto:")]
    # both rates in GFLOP/s, computed here from the shapes: 3 GEMMs of 2*rows*in*out per trained layer
    flops = 2 * 256 * (64 * 128 + 128 * 64) * 3
    assert f"fp32 {flops / 2.0 / 1e9:.1f} GFLOP/s" in line and f"bf16 {flops / 1.0 / 1e9:.1f} GFLOP/s" in line
    assert "2.00x" in line and cpu_name() in line
    cached = json.loads((tmp_path / precision.CACHE_FILE).read_text())
    [(key, times)] = cached.items()
    assert key.startswith(cpu_name() + "|") and times == {"fp32": 2.0, "bf16": 1.0}
    # the next run on this CPU reads the cache and measures nothing
    assert (
        precision.choose("auto", model, 256, tmp_path, flags=flags, measure_fn=_never_measure) == "bf16-mixed"
    )


def test_bf16_within_the_margin_keeps_fp32(tmp_path):
    just_below = 1.0 / (precision.MARGIN - 0.05)  # bf16 faster, but by less than MARGIN
    chosen = precision.choose(
        "auto",
        _linear_model(),
        512,
        tmp_path,
        flags=AVX512_BF16_FLAGS,
        measure_fn=_timings(fp32=1.0, bf16=just_below),
        reference_fn=_reference,
    )
    assert chosen == "32-true"


def test_a_timing_under_load_keeps_fp32_and_caches_nothing(caplog, tmp_path):
    spreads = iter([{"fp32": 2.0, "bf16": 1.0}, {"fp32": 2.0, "bf16": 3.0}, {"fp32": 2.0, "bf16": 1.0}])
    with caplog.at_level(logging.INFO, logger="adls_lightning.precision"):
        chosen = precision.choose(
            "auto",
            _linear_model(),
            512,
            tmp_path,
            flags=AMX_FLAGS,
            measure_fn=lambda shapes, rows: next(spreads),
            reference_fn=_reference,
        )
    assert chosen == "32-true"
    assert not (tmp_path / precision.CACHE_FILE).exists()
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trainer.precision=auto:")]
    assert "cannot be trusted" in line and "spread 3.00x" in line


def test_a_gap_that_holds_across_every_repeat_is_trusted_despite_the_spread(tmp_path):
    # a loaded machine: fp32 repeats spread 1.5x, bf16's 1.4x, but bf16's slowest beats fp32's fastest by 2x
    runs = iter([{"fp32": 4.0, "bf16": 1.0}, {"fp32": 6.0, "bf16": 1.4}, {"fp32": 5.0, "bf16": 1.2}])
    chosen = precision.choose(
        "auto",
        _linear_model(),
        512,
        tmp_path,
        flags=AVX512_BF16_FLAGS,
        measure_fn=lambda shapes, rows: next(runs),
        reference_fn=_reference,
    )
    assert chosen == "bf16-mixed"
    [times] = json.loads((tmp_path / precision.CACHE_FILE).read_text()).values()
    assert times == {"fp32": 4.0, "bf16": 1.0}  # the best of each


def test_bad_value_is_one_line_listing_the_valid_values():
    with pytest.raises(ConfigError) as err:
        precision.choose("fp8", _linear_model(), 512)
    message = str(err.value)
    assert "\n" not in message and message.startswith("trainer.precision='fp8': must be one of auto, ")
    assert "32-true" in message and "bf16-mixed" in message


def test_measure_times_both_precisions_on_this_cpu():
    # the real timing (no mock): positive seconds for both, fp32 and bf16 computing the same products
    times = precision.measure(Counter({LinearShape(32, 64, True): 2}), 64, repeats=1)
    assert set(times) == {"fp32", "bf16"} and all(t > 0 for t in times.values())
    [forward, *_] = precision._bf16_calls(LinearShape(32, 48, False), 64)
    out = forward()
    assert out.dtype == torch.bfloat16 and out.shape == (64, 48)


# --- the app: resolved once, before the trainer is built ---------------------------------------------------------


def _trainer_of(compose_cfg, overrides):
    from adls_lightning.app.training import _checked_objects

    _datamodule, _model, _callbacks, _loggers, trainer, _ckpt = _checked_objects(compose_cfg(overrides))
    return trainer


def test_default_cpu_run_on_avx2_trains_in_fp32(compose_cfg, monkeypatch, caplog):
    monkeypatch.setattr(precision, "cpu_flags", lambda: AVX2_FLAGS)
    monkeypatch.setattr(precision, "measure", _never_measure)
    with caplog.at_level(logging.INFO, logger="adls_lightning.precision"):
        trainer = _trainer_of(compose_cfg, [])  # trainer=cpu's default: auto
    assert str(trainer.precision) == "32-true"
    assert any(r.getMessage().startswith("trainer.precision=auto: 32-true") for r in caplog.records)


def test_default_cpu_run_on_a_bf16_cpu_measured_faster_trains_in_bf16(compose_cfg, monkeypatch, tmp_path):
    monkeypatch.setattr(precision, "cpu_flags", lambda: AMX_FLAGS)
    monkeypatch.setattr(precision, "measure", _timings(fp32=3.0, bf16=1.0))
    monkeypatch.setattr(precision, "reference_gflops", _reference)
    trainer = _trainer_of(compose_cfg, [f"paths.cache_dir={tmp_path}"])
    assert str(trainer.precision) == "bf16-mixed"


@pytest.mark.parametrize("quant", ["int8_scaled", "mxint8_packed"])
def test_auto_keeps_a_quantizing_run_in_fp32_on_a_bf16_cpu(compose_cfg, monkeypatch, caplog, quant):
    """bf16 would round the fake-quantized values off the integer grid the run simulates (and exports): a run
    with quant= stays fp32 under auto, without measuring, and says why; an explicit bf16-mixed is honoured."""
    monkeypatch.setattr(precision, "cpu_flags", lambda: AMX_FLAGS)
    monkeypatch.setattr(precision, "measure", _never_measure)
    with caplog.at_level(logging.INFO, logger="adls_lightning.app.training"):
        assert str(_trainer_of(compose_cfg, [f"quant={quant}"]).precision) == "32-true"
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trainer.precision=auto:")]
    assert line.startswith("trainer.precision=auto: 32-true (the run quantizes"), line
    overrides = [f"quant={quant}", "trainer.precision=bf16-mixed"]
    assert str(_trainer_of(compose_cfg, overrides).precision) == "bf16-mixed"


def test_explicit_fp32_is_honoured_on_a_bf16_cpu(compose_cfg, monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: AMX_FLAGS)
    monkeypatch.setattr(precision, "measure", _never_measure)
    assert str(_trainer_of(compose_cfg, ["trainer.precision=32-true"]).precision) == "32-true"


def test_train_py_refuses_a_bad_precision_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "trainer=cpu", "trainer.precision=fp8", f"hydra.run.dir={tmp_path}/run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: trainer.precision='fp8': must be one of auto, ") and "bf16-mixed" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["16-mixed", "16"])
def test_train_py_refuses_fp16_autocast_on_a_cpu_in_one_line(tmp_path, tiny_imdb_dir, cache_dir, value):
    """Lightning would swap fp16 autocast for bf16-mixed on a CPU with a warning only: refused, naming what a CPU
    takes, before anything is written."""
    out = tmp_path / "run"
    proc = run_train(tiny_imdb_dir, cache_dir, out, f"trainer.precision={value}")  # trainer=cpu
    line = assert_one_line_error(
        proc, starts=f"error: trainer.precision={value}: fp16 autocast does not run on a CPU"
    )
    assert "bf16-mixed instead" in line and "give one of auto, 32-true, bf16-mixed" in line
    assert not out.exists()


def test_fp16_autocast_is_refused_where_the_run_lands_on_the_cpu_only():
    validate_trainer({"precision": "32-true", "accelerator": "cpu"})
    validate_trainer(
        {"precision": "16-true", "accelerator": "cpu"}
    )  # fp16 weights: what it says, on a CPU too
    with pytest.raises(
        ConfigError, match=r"^trainer.precision=16-mixed: fp16 autocast does not run on a CPU"
    ):
        validate_trainer({"precision": "16-mixed", "accelerator": "cpu"})
    # no accelerator given is Lightning's auto: the CPU where this machine has no GPU
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        with pytest.raises(ConfigError, match=r"^trainer.precision=16-mixed: fp16 autocast"):
            validate_trainer({"precision": "16-mixed"})
    else:
        validate_trainer({"precision": "16-mixed"})


@pytest.mark.parametrize("preset", ["gpu", "ddp"])
def test_the_gpu_presets_keep_their_precision(preset):
    assert compose_config("train", [f"trainer={preset}"]).trainer.precision == "bf16-mixed"


def test_a_run_records_the_precision_given_in_its_metrics(tmp_path, tiny_imdb_dir, cache_dir):
    """Not only auto's choice: a value given is recorded too, as Lightning names it (``bf16`` is bf16-mixed)."""
    out = tmp_path / "run"
    metrics = train_run(
        out, ["trainer.precision=bf16", "+trainer.limit_train_batches=2"], tiny_imdb_dir, cache_dir
    )
    assert metrics["trainer/precision"] == "bf16-mixed"
    assert json.loads((out / "metrics.json").read_text())["trainer/precision"] == "bf16-mixed"


# --- custom ops under bf16 autocast ------------------------------------------------------------------------------


def _relative_error(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    """||a - b|| / ||b||, ``b``'s norm taken as at least ``floor`` (a gradient that is zero in exact arithmetic,
    like a key bias's under softmax, is rounding noise in both runs: compared against the others' scale)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(floor))


# bf16 keeps 8 significant bits (relative rounding 2^-9); a few chained products and a quantizer's rounding
# decisions flipped by it stay within a few percent of the fp32 result, an op that breaks does not.
BF16_TOLERANCE = 0.04


def _forward_backward(build, x, autocast: bool, seed: int = 0):
    """Output and the gradients of the input and of every trained parameter, fp32 or under bf16 autocast."""
    torch.manual_seed(seed)
    module = build()
    torch.manual_seed(seed + 1)
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    out_f = out.float()
    (out_f * torch.linspace(-1, 1, out_f.numel()).view_as(out_f)).sum().backward()
    grads = {"input": x.grad}
    grads.update({n: p.grad for n, p in module.named_parameters() if p.requires_grad})
    return out, grads


def _check_close_to_fp32(build, x, expect_bf16_output: bool = True):
    ref_out, ref_grads = _forward_backward(build, x, autocast=False)
    out, grads = _forward_backward(build, x, autocast=True)
    if expect_bf16_output:
        assert out.dtype == torch.bfloat16  # the op ran in bf16 (autocast reached it), not silently in fp32
    assert torch.isfinite(out.float()).all()
    assert _relative_error(out, ref_out) < BF16_TOLERANCE
    assert grads.keys() == ref_grads.keys()
    floor = 0.01 * max(float(g.norm()) for g in ref_grads.values())
    for name, grad in grads.items():
        assert grad is not None and grad.dtype == ref_grads[name].dtype, (
            name
        )  # fp32 parameters get fp32 grads
        assert torch.isfinite(grad).all(), name
        assert _relative_error(grad, ref_grads[name], floor) < BF16_TOLERANCE, name


def test_fast_dropout_model_under_bf16_autocast(tiny_bert):
    from adls_lightning.dropout import native_dropout_loaded, use_fast_dropout

    if not native_dropout_loaded():
        pytest.skip("the C++ dropout kernel is not built")

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = tiny_bert(seed=0, hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2).train()
            assert use_fast_dropout(self.model) > 0
            # inputs_embeds: a float input whose gradient the check compares too
            self.model.bert.embeddings.word_embeddings.requires_grad_(False)

        def forward(self, embeds):
            return self.model(inputs_embeds=embeds).logits

    x = torch.randn(2, 16, 32)
    # the same seed draws the same Philox masks in both runs: only the arithmetic's precision differs
    _check_close_to_fp32(Classifier, x)


def test_mxint8_packed_linear_under_bf16_autocast():
    from adls_lightning.mxint8.qlinear import QLinearPacked

    def build():
        first = nn.Linear(64, 64)
        return nn.Sequential(first, QLinearPacked.from_linear(nn.Linear(64, 32)), nn.Linear(32, 8))

    # the packed layer sees the first linear's bf16 output: its dequantize-to-bf16 route
    _check_close_to_fp32(build, torch.randn(4, 8, 64))


def test_mxint8_packed_linear_on_an_fp32_input_under_autocast():
    from adls_lightning.mxint8.qlinear import QLinearPacked

    def build():
        return nn.Sequential(QLinearPacked.from_linear(nn.Linear(64, 32)), nn.Linear(32, 8))

    # fp32 input (a layer norm's output under autocast): the fused fp32 kernel, then bf16 downstream
    _check_close_to_fp32(build, torch.randn(3, 64))


# formats whose output is a coarse sign/level function of the input: a bf16-rounded input flips a few levels, so
# their whole-layer error against fp32 is larger than a fine grid's (still far from a broken op's)
COARSE = {"binary", "binary_scaling", "binary_residual", "ternary", "log", "block_log"}


def test_every_quantization_format_is_checked_under_autocast():
    from adls_lightning.quant import QUANTIZERS

    assert set(QUANTIZERS) == set(FORMAT_PARAMS)


@pytest.mark.parametrize("name", sorted(FORMAT_PARAMS))
def test_quantized_linear_under_bf16_autocast(name):
    from adls_lightning.quant import make_quantizer
    from adls_lightning.quant.linear import QuantLinear

    def build():
        first = nn.Linear(64, 64)
        weight_q = make_quantizer(name, **FORMAT_PARAMS[name])
        input_q = make_quantizer(name, **FORMAT_PARAMS[name])
        for q, shape in ((weight_q, (32, 64)), (input_q, None)):
            q.bind(shape)
        return nn.Sequential(first, QuantLinear(nn.Linear(64, 32), input_q, weight_q), nn.Linear(32, 8))

    x = torch.randn(4, 8, 64)
    ref_out, ref_grads = _forward_backward(build, x, autocast=False)
    out, grads = _forward_backward(build, x, autocast=True)
    # coarse formats: the inputs that bf16 rounding moves across a sign or level change the STE's masks too
    tolerance = 0.35 if name in COARSE else BF16_TOLERANCE
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert _relative_error(out, ref_out) < tolerance
    floor = 0.01 * max(float(g.norm()) for g in ref_grads.values())
    for key, grad in grads.items():
        assert grad is not None and torch.isfinite(grad).all(), key
        assert grad.dtype == ref_grads[key].dtype, key
        assert _relative_error(grad, ref_grads[key], floor) < tolerance, key


@pytest.mark.parametrize("mask_class", ["WeightMask", "MovementMask"])
def test_pruning_masks_under_bf16_autocast(mask_class):
    from adls_lightning.prune import masks, movement

    cls = getattr(masks, mask_class, None) or getattr(movement, mask_class)
    mask = torch.rand(32, 64, generator=torch.Generator().manual_seed(3)) > 0.5

    def build():
        pruned = nn.Linear(64, 32)
        parametrize.register_parametrization(pruned, "weight", cls(mask))
        return nn.Sequential(nn.Linear(64, 64), pruned, nn.Linear(32, 8))

    x = torch.randn(4, 8, 64)
    _check_close_to_fp32(build, x)
    # the pruned entries get no gradient under autocast either, and the masked weight the GEMM used is exact zeros
    _out, grads = _forward_backward(build, x, autocast=True)
    original = grads["1.parametrizations.weight.original"]
    assert torch.all(original[~mask] == 0) and torch.any(original[mask] != 0)


def test_movement_scores_accumulate_in_fp32_under_autocast():
    from adls_lightning.prune.movement import MovementMask

    mask = torch.ones(16, 32, dtype=torch.bool)
    scores = {}
    for autocast in (False, True):
        torch.manual_seed(0)
        layer = nn.Linear(32, 16)
        parametrize.register_parametrization(layer, "weight", MovementMask(mask))
        x = torch.randn(8, 32)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x)
        F.mse_loss(out.float(), torch.zeros(8, 16)).backward()
        parametrization = layer.parametrizations.weight[0]
        assert parametrization.step_gradient.dtype == torch.float32
        scores[autocast] = parametrization.step_gradient.clone()
    assert torch.isfinite(scores[True]).all()
    assert _relative_error(scores[True], scores[False]) < BF16_TOLERANCE


@pytest.mark.parametrize("name", sorted(FORMAT_PARAMS))
def test_quantizer_of_a_bf16_tensor_is_its_fp32_value_quantized(name):
    # the precise property behind the layer test: a bf16 activation is quantized as its (exact) fp32 value, and
    # the result comes back in bf16 rounded once; the straight-through gradient passes the same elements
    from adls_lightning.quant import make_quantizer

    x = (torch.randn(6, 64, generator=torch.Generator().manual_seed(5)) * 2).bfloat16()
    quantized = {}
    grads = {}
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        q = make_quantizer(name, **FORMAT_PARAMS[name])
        q.bind(None)
        leaf = x.to(dtype).detach().clone().requires_grad_(True)
        out = q(leaf)
        out.float().sum().backward()
        quantized[dtype], grads[dtype] = out.detach(), leaf.grad
    assert quantized[torch.bfloat16].dtype == torch.bfloat16
    assert grads[torch.bfloat16].dtype == torch.bfloat16
    torch.testing.assert_close(
        quantized[torch.bfloat16], quantized[torch.float32].to(torch.bfloat16), rtol=2**-8, atol=0
    )
    torch.testing.assert_close(grads[torch.bfloat16].float(), grads[torch.float32], rtol=0, atol=0)
