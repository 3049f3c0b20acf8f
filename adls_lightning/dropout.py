"""Counter-based dropout for CPU training: ``torch.ops.adls.philox_dropout`` and the modules that use it.

On CPUs without MKL's vectorised generator (AMD, ARM), ATen draws a dropout mask serially (``bernoulli_``, ~7 ns
per element), which is a third of a MiniLM + LoRA training step (docs/compile.md). Here the mask is Philox4x32-10
of (seed, offset, element index): a pure function, computed in SIMD lanes and in parallel by the C++ kernel
(``csrc/dropout_cpu.cpp``, whose header comment defines the stream), and recomputed in the backward from
``(seed, offset)`` instead of being stored.

The seed is drawn from torch's default generator at each call (as ``F.dropout`` draws its mask from it), so
``seed_everything`` makes runs reproducible and a resumed run continues the generator as it does for torch's
dropout; ``offset`` selects an independent stream of the same seed.

* :func:`fast_dropout` -- ``F.dropout``'s semantics (keep ``1 - p``, scale ``1 / (1 - p)``, identity in eval and at
  ``p = 0``, ``x * 0`` at ``p = 1``).
* :class:`FastDropout` -- an ``nn.Dropout`` that uses it on CPU tensors (torch's own elsewhere: CUDA's dropout is
  already fused and vectorised).
* :func:`use_fast_dropout` -- swaps every ``nn.Dropout`` of a model (Hugging Face's hidden and head dropouts,
  PEFT's LoRA dropouts) and routes the attention-probability dropout through :data:`FAST_DROPOUT_SDPA`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger(__name__)

DROPOUT_OP = "adls::philox_dropout"

_lib = torch.library.Library("adls", "FRAGMENT")  # kept alive for the life of the process
_lib.define("philox_dropout(Tensor x, float p, Tensor seed, int offset) -> Tensor")

_MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_WEYL = (0x9E3779B9, 0xBB67AE85)
_ROUNDS = 10
_INSTANCES = 8  # Philox instances per 32-element block (see csrc/dropout_cpu.cpp)


def _check_args(x: torch.Tensor, p: float, seed: torch.Tensor, offset: int) -> None:
    torch._check(x.is_floating_point(), lambda: f"philox_dropout: x must be floating point, got {x.dtype}")
    torch._check(0.0 <= p <= 1.0, lambda: f"philox_dropout: p must be in [0, 1], got {p}")
    torch._check(
        seed.dtype == torch.int64 and seed.numel() == 1 and seed.device.type == "cpu",
        lambda: (
            f"philox_dropout: seed must be one int64 on the CPU, got {seed.dtype} {tuple(seed.shape)} "
            f"on {seed.device}"
        ),
    )
    torch._check(offset >= 0, lambda: f"philox_dropout: offset must be >= 0, got {offset}")


def _mulhilo(a: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    # (high, low) 32-bit halves of a * multiplier in int64 arithmetic: split the multiplier in 16-bit halves so
    # no partial product exceeds 2^48.
    low_product = a * (multiplier & 0xFFFF)
    high_product = a * (multiplier >> 16)
    low = (low_product + ((high_product & 0xFFFF) << 16)) & _MASK32
    high = (high_product + (low_product >> 16)) >> 16
    return high, low


def philox4x32_10(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], key: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 (Random123's rounds) of int64 tensors holding 32-bit counter words, one instance per element."""
    c0, c1, c2, c3 = counter
    key0, key1 = key
    for _ in range(_ROUNDS):
        high0, low0 = _mulhilo(c0, _MULTIPLIERS[0])
        high1, low1 = _mulhilo(c2, _MULTIPLIERS[1])
        c0, c1, c2, c3 = high1 ^ c1 ^ key0, low1, high0 ^ c3 ^ key1, low0
        key0, key1 = (key0 + _WEYL[0]) & _MASK32, (key1 + _WEYL[1]) & _MASK32
    return c0, c1, c2, c3


def philox_words(numel: int, seed: int, offset: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 32-bit words (as int64) the kernel compares with the keep threshold, in element order."""
    blocks = -(-numel // (4 * _INSTANCES))
    instance = torch.arange(blocks * _INSTANCES, dtype=torch.int64, device=device)
    seed_bits = seed & (2**64 - 1)
    counter = (
        instance & _MASK32,
        instance >> 32,
        torch.full_like(instance, offset & _MASK32),
        torch.full_like(instance, offset >> 32),
    )
    words = philox4x32_10(counter, (seed_bits & _MASK32, seed_bits >> 32))
    # element 32 b + 8 w + k <- word w of instance 8 b + k
    return torch.stack([w.view(blocks, _INSTANCES) for w in words], dim=1).reshape(-1)[:numel]


def keep_threshold(p: float) -> int:
    """An element is kept when its word is below round((1 - p) * 2^32) (as the C++ kernel computes it)."""
    return min(max(round((1.0 - p) * 2.0**32), 0), _MASK32)


@torch.library.register_fake(DROPOUT_OP, lib=_lib)
def _dropout_fake(x: torch.Tensor, p: float, seed: torch.Tensor, offset: int) -> torch.Tensor:
    _check_args(x, p, seed, offset)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.impl(_lib, "philox_dropout", "CompositeExplicitAutograd")
def _dropout_reference(x: torch.Tensor, p: float, seed: torch.Tensor, offset: int) -> torch.Tensor:
    """The pure-PyTorch kernel (any device; slow): the stream the C++ kernel must reproduce."""
    _check_args(x, p, seed, offset)
    if p == 0.0:
        return x.clone(memory_format=torch.contiguous_format)
    if p == 1.0:
        return x.mul(0.0).contiguous()
    words = philox_words(x.numel(), int(seed.item()), offset, x.device).view(x.shape)
    keep = (words < keep_threshold(p)).to(x.dtype)
    return (x * (keep / (1.0 - p))).contiguous()


def _dropout_setup_context(ctx, inputs, output) -> None:
    _, p, seed, offset = inputs
    ctx.save_for_backward(seed)  # the mask is recomputed from (seed, offset), never stored
    ctx.p = p
    ctx.offset = offset


def _dropout_backward(ctx, grad_output: torch.Tensor):
    (seed,) = ctx.saved_tensors
    return torch.ops.adls.philox_dropout(grad_output, ctx.p, seed, ctx.offset), None, None, None


torch.library.register_autograd(DROPOUT_OP, _dropout_backward, setup_context=_dropout_setup_context, lib=_lib)

# Loads adls_lightning._C (unless disabled), whose CPU kernel then serves the op.
from adls_lightning.mxint8 import ops as _native_ops  # noqa: E402


def native_dropout_loaded() -> bool:
    """True when the C++ kernel serves ``torch.ops.adls.philox_dropout`` on CPU tensors."""
    return _native_ops._NATIVE is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        DROPOUT_OP, "CPU"
    )


def draw_seed() -> torch.Tensor:
    """A 63-bit seed from torch's default CPU generator (a tensor, so torch.compile traces it without a break)."""
    return torch.randint(2**63 - 1, (), dtype=torch.int64)


def fast_dropout(
    x: torch.Tensor, p: float = 0.5, training: bool = True, seed: torch.Tensor | None = None, offset: int = 0
) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with a Philox mask; ``seed`` (one int64) defaults to a fresh draw."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x.mul(0.0)
    return torch.ops.adls.philox_dropout(x, p, draw_seed() if seed is None else seed, offset)


class FastDropout(nn.Dropout):
    """``nn.Dropout`` with the Philox kernel on CPU tensors; torch's dropout on other devices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return super().forward(x)
        return fast_dropout(x, self.p, self.training)


#: Hugging Face attention implementation: SDPA, except that in training on CPU the attention probabilities are
#: dropped with :func:`fast_dropout` (SDPA with dropout runs its unfused math path on CPU anyway, drawing with
#: ``bernoulli_``); evaluation keeps SDPA's fused kernel.
FAST_DROPOUT_SDPA = "sdpa_fast_dropout"


def sdpa_fast_dropout_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's ``sdpa_attention_forward`` with the probabilities' dropout done by :func:`fast_dropout` on CPU."""
    if dropout == 0.0 or query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Scaling the queries (seq x head_dim) instead of the scores (seq x seq) saves a pass over the scores.
    scores = torch.matmul(query * scale, key.transpose(2, 3))
    q_length, kv_length = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and is_causal and q_length > 1:
        attention_mask = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device).tril()
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill_(attention_mask.logical_not(), torch.finfo(scores.dtype).min)
        else:
            scores = scores.add_(attention_mask)
    probabilities = fast_dropout(torch.softmax(scores, dim=-1), dropout, training=True)
    attn_output = torch.matmul(probabilities, value)
    return attn_output.transpose(1, 2).contiguous(), None


AttentionInterface.register(FAST_DROPOUT_SDPA, sdpa_fast_dropout_forward)
AttentionMaskInterface.register(FAST_DROPOUT_SDPA, sdpa_mask)


def use_fast_dropout(model: nn.Module) -> int:
    """Swap every ``nn.Dropout`` of ``model`` for :class:`FastDropout` and its SDPA attention for
    :data:`FAST_DROPOUT_SDPA`, in place; returns the dropouts swapped (0 when the C++ kernel is not built).

    Dropout modules hold no state, so checkpoints are unchanged. HF's ``eager`` attention keeps torch's dropout
    of the probabilities (it is Lab 4's naive reference).
    """
    if not native_dropout_loaded():
        log.warning("fast dropout: the C++ kernel is not built (adls_lightning._C); keeping torch's dropout")
        return 0
    swapped = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, FastDropout(child.p))
                swapped += 1
    hf_model = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf_model is not None and hf_model.config._attn_implementation == "sdpa":
        hf_model.set_attn_implementation(FAST_DROPOUT_SDPA)
    log.info("fast dropout: %d dropout modules use the Philox kernel on CPU", swapped)
    return swapped
