"""The Philox dropout (``torch.ops.adls.philox_dropout``, :mod:`adls_lightning.dropout`).

Expectations come from elsewhere: Random123's published Philox4x32-10 answers, the pure-PyTorch stream the C++
kernel must reproduce bit for bit (AVX2 and portable loops), binomial bounds on the keep rate, ``F.dropout``'s
edge cases, and Hugging Face's own SDPA attention.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from adls_lightning.dropout import (
    FAST_DROPOUT_SDPA,
    FastDropout,
    draw_seed,
    fast_dropout,
    native_dropout_loaded,
    philox4x32_10,
    philox_words,
    sdpa_fast_dropout_forward,
    use_fast_dropout,
)
from adls_lightning.gemm import native_bfloat16
from adls_lightning.models import build_from_config
from tests.helpers import run_train

ROOT = Path(__file__).resolve().parent.parent
needs_kernel = pytest.mark.skipif(not native_dropout_loaded(), reason="C++ extension not built")

# Random123's kat_vectors for Philox4x32-10: (counter, key, output).
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def _seed(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64)


def _expected(x: torch.Tensor, p: float, seed: int, offset: int) -> torch.Tensor:
    """The stream's definition, written out: keep where the word < round((1 - p) 2^32), scale by 1 / (1 - p)."""
    words = philox_words(x.numel(), seed, offset).view(x.shape)
    keep = words < round((1 - p) * 2**32)
    return x * (keep.to(x.dtype) / (1 - p))


@pytest.mark.parametrize(("counter", "key", "output"), PHILOX_KNOWN_ANSWERS)
def test_philox_reference_matches_random123_known_answers(counter, key, output):
    words = philox4x32_10(tuple(torch.tensor([c]) for c in counter), key)
    assert tuple(int(w) for w in words) == output


@needs_kernel
@pytest.mark.parametrize("numel", [1, 31, 32, 33, 1000, 65 * 1024 + 7])
@pytest.mark.parametrize(("seed", "offset"), [(0, 0), (-5, 3), (2**40 + 11, 2**33 + 1)])
def test_kernel_reproduces_the_stream_bit_for_bit(numel, seed, offset):
    x = torch.randn(numel)
    for p in (0.1, 0.5):
        out = torch.ops.adls.philox_dropout(x, p, _seed(seed), offset)
        torch.testing.assert_close(out, _expected(x, p, seed, offset), rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_use_the_same_mask(dtype):
    x = torch.randn(4097, dtype=torch.float64).to(dtype)
    x[x == 0] = 1
    out = torch.ops.adls.philox_dropout(x, 0.3, _seed(9), 2)
    assert out.dtype == dtype
    keep = philox_words(x.numel(), 9, 2) < round(0.7 * 2**32)
    assert torch.equal(out != 0, keep)
    torch.testing.assert_close(out, (x.double() * keep / 0.7).to(dtype))


def _bfloat16_input(numel: int) -> torch.Tensor:
    """Normal values at several scales, with the edges a rounding kernel can get wrong at the front."""
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(torch.bfloat16)
    edges = [
        float("nan"),
        float("inf"),
        -float("inf"),
        0.0,
        -0.0,
        3.3e38,
        -3.3e38,
        1e-39,
        1.00390625,
        -1.01171875,
    ]
    x[: len(edges)] = torch.tensor(edges[:numel], dtype=torch.bfloat16)
    return x


@needs_kernel
@pytest.mark.parametrize("numel", [7, 32, 1000, 65 * 1024 + 7])
def test_bfloat16_output_is_the_float_product_rounded_once(numel):
    # Under CPU autocast (trainer.precision=bf16-mixed) the dropouts see bfloat16 activations: each output is
    # float(x) * 1/(1 - p) rounded once to bfloat16 (nearest even), as torch rounds a float tensor to bfloat16.
    x = _bfloat16_input(numel)
    for p in (0.1, 0.3):
        out = torch.ops.adls.philox_dropout(x, p, _seed(5), 1)
        assert out.dtype == torch.bfloat16
        expected = _expected(x.float(), p, 5, 1).to(torch.bfloat16)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@needs_kernel
def test_non_contiguous_input_is_masked_in_logical_order():
    x = torch.randn(64, 48).t()
    out = torch.ops.adls.philox_dropout(x, 0.25, _seed(4), 0)
    torch.testing.assert_close(out, _expected(x.contiguous(), 0.25, 4, 0), rtol=0, atol=0)


@needs_kernel
def test_portable_loops_match_the_avx2_kernel(tmp_path):
    # The CPU-kernel switch is read once per process: the portable loops run in a child, on the inputs saved here.
    inputs = {
        "float32": torch.randn(10007, generator=torch.Generator().manual_seed(0)),
        "bfloat16": _bfloat16_input(10007),
    }
    torch.save(inputs, tmp_path / "inputs.pt")
    code = (
        "import torch, adls_lightning.dropout\n"
        "inputs = torch.load('inputs.pt')\n"
        "out = {k: torch.ops.adls.philox_dropout(x, 0.2, torch.tensor(77), 5) for k, x in inputs.items()}\n"
        "torch.save(out, 'portable.pt')\n"
    )
    env = {**os.environ, "ADLS_MXINT8_PORTABLE_CPU": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)
    portable = torch.load(tmp_path / "portable.pt")
    x = inputs["float32"]
    assert torch.equal(portable["float32"], torch.ops.adls.philox_dropout(x, 0.2, _seed(77), 5))
    assert torch.equal(portable["float32"], _expected(x, 0.2, 77, 5))
    # bfloat16: the same bits, NaNs included (both narrow as c10::BFloat16's float constructor does)
    ours = torch.ops.adls.philox_dropout(inputs["bfloat16"], 0.2, _seed(77), 5)
    assert torch.equal(portable["bfloat16"].view(torch.int16), ours.view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_within_binomial_bounds(p):
    n = 1 << 20
    x = torch.ones(n)
    kept = []
    for seed in range(8):
        count = int((torch.ops.adls.philox_dropout(x, p, _seed(seed), 0) != 0).sum())
        kept.append(count)
        # 5 standard deviations of Binomial(n, 1 - p) for each seed ...
        assert abs(count - n * (1 - p)) < 5 * (n * p * (1 - p)) ** 0.5
    # ... and of the pooled count.
    total = 8 * n
    assert abs(sum(kept) - total * (1 - p)) < 5 * (total * p * (1 - p)) ** 0.5


def _both_kept_z(a: torch.Tensor, b: torch.Tensor, keep: float) -> float:
    # Independent masks keep a pair with probability keep^2: z-score of the observed pairs.
    n = a.numel()
    both = int((a & b).sum())
    q = keep * keep
    return (both - n * q) / (n * q * (1 - q)) ** 0.5


@needs_kernel
def test_masks_are_independent_across_calls_offsets_seeds_and_neighbours():
    n, p = 1 << 20, 0.5
    x = torch.ones(n)
    mask = torch.ops.adls.philox_dropout(x, p, _seed(1), 0) != 0
    others = {
        "next offset": torch.ops.adls.philox_dropout(x, p, _seed(1), 1) != 0,
        "seed one bit apart": torch.ops.adls.philox_dropout(x, p, _seed(3), 0) != 0,
        "fresh draw": fast_dropout(x, p) != 0,
    }
    for name, other in others.items():
        assert abs(_both_kept_z(mask, other, 1 - p)) < 5, name
    # Neighbours within a block (same instance, next word: lag 8; next instance: lag 1) and across blocks (lag 32).
    for lag in (1, 8, 32):
        assert abs(_both_kept_z(mask[:-lag], mask[lag:], 1 - p)) < 5, lag


@needs_kernel
def test_backward_regenerates_the_forward_mask():
    x = torch.randn(3, 1000, requires_grad=True)
    grad_output = torch.randn(3, 1000)
    saved = []
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fast_dropout(x, 0.4)
    y.backward(grad_output)
    kept = y.detach() != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(x.grad, grad_output * (kept.float() / 0.6), rtol=0, atol=0)
    # No mask is stored: the backward keeps only the one-element seed.
    assert [t.numel() for t in saved] == [1]


@needs_kernel
def test_same_seed_same_mask_other_seed_other_mask():
    x = torch.randn(5000)
    torch.manual_seed(123)
    first = fast_dropout(x, 0.3)
    torch.manual_seed(123)
    again = fast_dropout(x, 0.3)
    torch.manual_seed(124)
    other = fast_dropout(x, 0.3)
    assert torch.equal(first, again)
    assert not torch.equal(first != 0, other != 0)
    torch.manual_seed(123)
    assert torch.equal(first, _expected(x, 0.3, int(draw_seed()), 0))


def test_edge_cases_follow_f_dropout():
    x = torch.randn(100, requires_grad=True)
    assert fast_dropout(x, 0.5, training=False) is x
    assert fast_dropout(x, 0.0) is x
    zeros = fast_dropout(x, 1.0)
    assert torch.equal(zeros, F.dropout(x, 1.0))
    zeros.sum().backward()
    assert torch.equal(x.grad, torch.zeros(100))
    with pytest.raises(ValueError, match="between 0 and 1"):
        fast_dropout(x, 1.5)


@needs_kernel
def test_opcheck():
    x = torch.randn(4, 33, requires_grad=True)
    for p in (0.0, 0.3, 1.0):
        torch.library.opcheck(torch.ops.adls.philox_dropout.default, (x, p, _seed(11), 2))


@needs_kernel
def test_compiles_without_graph_break_and_draws_what_eager_draws():
    model = nn.Sequential(nn.Linear(8, 8), FastDropout(0.3), nn.Linear(8, 2))
    x = torch.randn(16, 8)
    torch.manual_seed(5)
    eager = model(x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break would raise
    torch.manual_seed(5)
    out = compiled(x)
    torch.testing.assert_close(out, eager)
    out.sum().backward()
    assert model[0].weight.grad is not None


def _tiny_lora_bert(attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    backbone = build_from_config(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        attn_implementation=attn,
    )  # fmt: skip
    config = LoraConfig(
        r=4, target_modules=["query", "value"], lora_dropout=0.1, modules_to_save=["classifier"]
    )
    return get_peft_model(backbone, config)


@needs_kernel
def test_use_fast_dropout_swaps_hf_and_lora_dropouts_and_routes_attention():
    model = _tiny_lora_bert()
    before = sum(type(m) is nn.Dropout for m in model.modules())
    assert use_fast_dropout(model) == before > 0
    assert not any(type(m) is nn.Dropout for m in model.modules())
    assert any(".lora_dropout." in name for name, m in model.named_modules() if isinstance(m, FastDropout))
    assert model.get_base_model().config._attn_implementation == FAST_DROPOUT_SDPA


@needs_kernel
def test_attention_dropout_matches_sdpa_with_the_same_mask():
    """In eval the fused SDPA serves; in training the probabilities get exactly fast_dropout's mask."""
    model = _tiny_lora_bert()
    reference = _tiny_lora_bert()
    use_fast_dropout(model)
    ids = torch.randint(0, 100, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[0, 12:] = 0
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=ids, attention_mask=mask).logits,
            reference(input_ids=ids, attention_mask=mask).logits,
        )
    # Training with only the attention dropout on: SDPA's math with the probabilities masked by the drawn seeds.
    attention = model.get_base_model().bert.encoder.layer[0].attention.self
    q, k, v = (torch.randn(3, 2, 20, 16) for _ in range(3))
    additive = torch.zeros(3, 1, 20, 20)
    additive[0, ..., 12:] = torch.finfo(torch.float32).min
    torch.manual_seed(7)
    attend = additive == 0
    out, _ = sdpa_fast_dropout_forward(attention, q, k, v, attend, dropout=0.2, scaling=0.25)
    torch.manual_seed(7)
    seed = int(draw_seed())
    probabilities = torch.softmax(q @ k.transpose(2, 3) * 0.25 + additive, dim=-1)
    expected = _expected(probabilities, 0.2, seed, 0) @ v
    torch.testing.assert_close(out, expected.transpose(1, 2))


class _RecordDropouts(TorchDispatchMode):
    """Every call of the Philox op: (input, p, seed, offset) and its output."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.adls.philox_dropout.default:
            self.calls.append((args, out))
        return out


@needs_kernel
def test_autocast_training_masks_bfloat16_activations_with_the_stream():
    # trainer.precision=bf16-mixed on CPU: the linears' outputs are bfloat16, so the hidden, attention and LoRA
    # dropouts run the bfloat16 kernel, forward and backward; the trainable weights and their gradients stay fp32.
    model = _tiny_lora_bert()
    use_fast_dropout(model)
    model.train()
    ids = torch.randint(0, 100, (4, 24))
    with _RecordDropouts() as record, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=torch.tensor([0, 1, 1, 0])).loss
        loss.backward()
    dtypes = [args[0].dtype for args, _ in record.calls]
    assert dtypes.count(torch.bfloat16) >= 4, (
        dtypes
    )  # 2 layers x (attention output, FFN output), and backward
    for (x, p, seed, offset), out in record.calls:
        expected = _expected(x.float(), p, int(seed), offset).to(x.dtype)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    trainable = [param for param in model.parameters() if param.requires_grad]
    assert all(param.dtype == torch.float32 and torch.isfinite(param.grad).all() for param in trainable)


def test_train_py_runs_in_bf16_autocast_on_cpu(tiny_imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    proc = run_train(tiny_imdb_dir, cache_dir, out, "trainer.precision=bf16-mixed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["test/acc"] <= 1 and math.isfinite(metrics["train/loss"])
    assert "precision: bf16-mixed" in (out / ".hydra" / "config.yaml").read_text()
    # one warning where the CPU has no bfloat16 arithmetic (autocast would emulate it), none where it has
    warned = "without bfloat16 arithmetic" in proc.stdout + proc.stderr
    assert warned == (native_bfloat16() is False)


@needs_kernel
@pytest.mark.parametrize("fast", [True, False])
def test_model_fast_dropout_switch(compose_cfg, fast):
    from transformers import PreTrainedModel

    from adls_lightning.build import build

    module = build(
        compose_cfg([f"model.fast_dropout={str(fast).lower()}"]).model, "model", _convert_="partial"
    )
    assert {type(m) for m in module.modules() if isinstance(m, nn.Dropout)} == {
        FastDropout if fast else nn.Dropout
    }
    hf_model = next(m for m in module.modules() if isinstance(m, PreTrainedModel))
    assert hf_model.config._attn_implementation == (FAST_DROPOUT_SDPA if fast else "sdpa")


def test_model_fast_dropout_must_be_a_bool(compose_cfg):
    from adls_lightning.build import build
    from adls_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="model.fast_dropout='yes please': must be true or false"):
        build(compose_cfg(["model.fast_dropout='yes please'"]).model, "model", _convert_="partial")
