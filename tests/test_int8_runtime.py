"""adls_lightning.int8_runtime: the fastest int8 runtime per CPU kind, measured once and cached (mocked timings and
CPU flags), and each runtime actually computing the fp32 model's labels on a tiny BERT."""

from __future__ import annotations

import logging

import pytest
import torch

from adls_lightning import int8_runtime

AVX512_FLAGS = "fpu avx2 avx512f avx512_vnni avx512_bf16"
AMX_FLAGS = "fpu avx2 avx512f avx512_vnni amx_bf16 amx_int8 amx_tile"


def _timings(**seconds):
    calls = []

    def measure_fn(model, batch, tokens):
        calls.append((batch, tokens))
        return dict(seconds)

    measure_fn.calls = calls
    return measure_fn


def test_measured_once_then_read_from_the_cache(tmp_path, caplog):
    measure_fn = _timings(**{"torch-dynamic": 0.03, "ort-dynamic": 0.02, "pt2e-x86-inductor": 0.01})
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.INFO, logger="adls_lightning.int8_runtime"):
        first = int8_runtime.best_int8_runtime(
            tmp_path, model, 8, 128, measure_fn=measure_fn, flags=AMX_FLAGS
        )
        again = int8_runtime.best_int8_runtime(
            tmp_path, model, 8, 128, measure_fn=measure_fn, flags=AMX_FLAGS
        )
    assert first == again == "pt2e-x86-inductor"
    assert measure_fn.calls == [(8, 128)]  # the second answer came from the cache
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("int8 runtime:")]
    assert lines[0].startswith("int8 runtime: pt2e-x86-inductor (measured") and "amx_int8" in lines[0]
    assert lines[1].startswith("int8 runtime: pt2e-x86-inductor (cached")


def test_another_cpu_kind_or_shape_is_measured_anew(tmp_path):
    fast_ort = _timings(**{"torch-dynamic": 0.03, "ort-dynamic": 0.01})
    fast_torch = _timings(**{"torch-dynamic": 0.01, "ort-dynamic": 0.03})
    model = torch.nn.Linear(2, 2)
    assert int8_runtime.best_int8_runtime(tmp_path, model, 8, 128, fast_ort, AVX512_FLAGS) == "ort-dynamic"
    # an AMX machine of the same name (other flags) and another batch are other keys: each measured
    assert int8_runtime.best_int8_runtime(tmp_path, model, 8, 128, fast_torch, AMX_FLAGS) == "torch-dynamic"
    assert (
        int8_runtime.best_int8_runtime(tmp_path, model, 1, 128, fast_torch, AVX512_FLAGS) == "torch-dynamic"
    )
    assert int8_runtime.best_int8_runtime(tmp_path, model, 8, 128, fast_torch, AVX512_FLAGS) == "ort-dynamic"


def test_no_cached_answer_and_no_model_is_none(tmp_path):
    assert int8_runtime.best_int8_runtime(tmp_path, None, 8, 128) is None


def test_recorded_answer_is_read_back(tmp_path):
    best = int8_runtime.record(tmp_path, 8, 128, {"torch-dynamic": 0.02, "ort-dynamic": 0.05, "other": 0.001})
    assert best == "torch-dynamic"  # names outside RUNTIMES are not recorded
    assert int8_runtime.best_int8_runtime(tmp_path, None, 8, 128) == "torch-dynamic"


def test_int8_flags_pick_the_matrix_flags():
    assert int8_runtime.int8_flags(AMX_FLAGS) == ["amx_int8", "avx512_vnni", "avx2"]
    assert int8_runtime.int8_flags("fpu sse2") == []


@pytest.mark.parametrize("runtime", ["torch-dynamic", "ort-dynamic", "pt2e-x86-inductor"])
def test_each_runtime_computes_the_fp32_models_logits(tiny_bert, runtime, tmp_path):
    if runtime == "pt2e-x86-inductor" and (why := int8_runtime.pt2e_unusable()) is not None:
        pytest.skip(why)
    model = tiny_bert(seed=0)
    inputs = int8_runtime.sample_batch(4, 16, model.config.vocab_size, seed=1)
    skipped: dict[str, str] = {}
    [run] = int8_runtime.build_runners(model, inputs, (runtime,), skipped, tmp_path).values()
    assert not skipped
    with torch.inference_mode():
        reference = model(**inputs).logits
    got = run(inputs["input_ids"], inputs["attention_mask"]).float()
    assert got.shape == reference.shape
    # int8 weights and inputs on a tiny random model: within a tenth of the logits' scale, not equal
    assert float((got - reference).norm() / reference.norm()) < 0.1
    times = int8_runtime.time_runners({runtime: run}, inputs, repeats=2)
    assert times[runtime] > 0
