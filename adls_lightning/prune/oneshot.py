"""One-shot pruning from calibration data: Wanda (Sun et al. 2023) and SparseGPT (Frantar & Alistarh 2023).

Both read what each pruned layer receives over a few training batches (:func:`adls_lightning.obs.input_statistics`,
``prune.calibration.batches``) and prune without retraining:

* **Wanda** scores ``|W_ij| · ‖X_j‖₂``, with ``‖X_j‖₂`` the L2 norm of input feature ``j`` over all calibration
  tokens, and prunes each output row separately (the paper's per-output comparison group): every row loses
  exactly ``num_to_prune(in_features, sparsity)`` weights, so a layer's count can differ from
  ``round(sparsity · numel)`` by the rounding of its rows. The kept weights are unchanged.
* **SparseGPT** solves the layer-wise reconstruction ``min ‖WX - ŴX‖²`` as GPTQ does (:mod:`adls_lightning.obs`:
  the Hessian ``H = 2XᵀX/n`` damped by ``damp · mean(diag H)``, the upper Cholesky factor ``U`` of its inverse,
  columns in blocks of ``block_size`` with lazy updates). At the start of each block the mask is chosen over the
  whole block by the OBS saliency ``w² / Uⱼⱼ²`` (the reference implementation's adaptive mask selection): exactly
  ``num_to_prune`` of the layer's entries up to the block's end, less those already pruned, so the layer gets
  exactly ``round(sparsity · numel)`` zeros. Each zeroed weight's error is then compensated on the kept weights of
  its row in the columns still to come, so the kept weights change: they are the new weights of the layer.

With an ``N:M`` pattern both keep the ``N`` highest-scoring of every ``M`` consecutive inputs of a row; SparseGPT
chooses each group when the sweep reaches its first column (the paper's semi-structured variant), so ``M`` must
divide ``block_size``. Ties are broken by position (the lower index is pruned first) as everywhere in this package.

The statistics come from one pass of the calibration batches through the model as it is (before any layer is
pruned), not layer by layer through the already pruned ones as both papers' code does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from adls_lightning.errors import ConfigError, require_positive_int
from adls_lightning.obs import LayerInputs, dead_inputs_removed, inverse_cholesky, obs_sweep
from adls_lightning.prune.masks import MaskSpec, num_to_prune, pattern_pruned, smallest_k
from adls_lightning.prune.scores import ONESHOT_METHODS
from adls_lightning.registry import named_decorator


@dataclass(frozen=True)
class SparseGPTConfig:
    """``prune.sparsegpt``: ``damp`` (fraction of the mean Hessian diagonal added) and ``block_size`` (columns per
    lazy update and per mask choice), the reference implementation's defaults."""

    damp: float = 0.01
    block_size: int = 128

    def __post_init__(self) -> None:
        require_positive_int("prune.sparsegpt.block_size", self.block_size)
        if isinstance(self.damp, bool) or not isinstance(self.damp, int | float) or not 0 < self.damp < 1:
            raise ConfigError(f"prune.sparsegpt.damp={self.damp!r}: must be a number in (0, 1), e.g. 0.01")


#: A one-shot method: ``solve(weight, inputs, spec, config) -> (keep mask, new weight or None)``; ``weight`` is the
#: layer's (out × in), ``inputs`` what it received over the calibration batches. ``None``: the kept weights stay.
OneShotFn = Callable[[Tensor, LayerInputs, MaskSpec, SparseGPTConfig], tuple[Tensor, Tensor | None]]


def register_oneshot(name: str) -> Callable[[OneShotFn], OneShotFn]:
    """Decorator: make a one-shot solver available as ``prune.weight.method=<name>`` (weights only)."""
    return named_decorator(ONESHOT_METHODS, name)


def check_block_size(spec: MaskSpec | None, config: SparseGPTConfig) -> None:
    """SparseGPT chooses ``N:M`` groups inside its blocks: ``M`` must divide ``block_size``.

    Raises:
        ConfigError: naming ``prune.sparsegpt.block_size``.
    """
    if (
        spec is not None
        and spec.method == "sparsegpt"
        and spec.nm is not None
        and config.block_size % spec.nm[1]
    ):
        raise ConfigError(
            f"prune.sparsegpt.block_size={config.block_size}: must be a multiple of M={spec.nm[1]} of "
            f"{spec.key}.pattern={spec.pattern!r} (groups are chosen inside a block)"
        )


@register_oneshot("wanda")
def wanda(
    weight: Tensor, inputs: LayerInputs, spec: MaskSpec, config: SparseGPTConfig
) -> tuple[Tensor, None]:
    """Keep-mask of ``|W| · ‖X_j‖`` per output row (or per ``N:M`` group); the weights are not changed."""
    w = weight.detach()
    scores = w.abs().to(torch.float32) * inputs.feature_norms().to(w.device)[None, :]
    if spec.nm is not None:
        return ~pattern_pruned(scores, *spec.nm), None
    return ~smallest_k(scores, num_to_prune(scores.shape[1], spec.sparsity)), None


@register_oneshot("sparsegpt")
@torch.no_grad()
def sparsegpt(
    weight: Tensor, inputs: LayerInputs, spec: MaskSpec, config: SparseGPTConfig
) -> tuple[Tensor, Tensor]:
    """SparseGPT's keep-mask and compensated weights for ``weight`` (out × in)."""
    w, h = dead_inputs_removed(weight, inputs.hessian())
    upper = inverse_cholesky(h, config.damp)
    out = w.shape[0]
    pruned = torch.zeros_like(w, dtype=torch.bool)

    def masked(block: Tensor, u: Tensor, i: int, start: int) -> Tensor:
        end = start + block.shape[1]
        if spec.nm is None and i == 0:
            saliency = block.square() / u.diagonal().square()[None, :]
            # the layer's exact count up to this block's end, less what earlier blocks pruned
            k = num_to_prune(out * end, spec.sparsity) - num_to_prune(out * start, spec.sparsity)
            pruned[:, start:end] = smallest_k(saliency.reshape(1, -1), k).view_as(block)
        elif spec.nm is not None and i % spec.nm[1] == 0:
            n, m = spec.nm
            saliency = block[:, i : i + m].square() / u.diagonal()[i : i + m].square()[None, :]
            pruned[:, start + i : start + i + m] = pattern_pruned(saliency, n, m)
        return block[:, i].masked_fill(pruned[:, start + i], 0.0)

    solved = obs_sweep(w, upper, config.block_size, masked)
    return ~pruned, solved.to(weight.dtype)


def solve(
    weight: Tensor, inputs: LayerInputs, spec: MaskSpec, config: SparseGPTConfig
) -> tuple[Tensor, Tensor | None]:
    """The registered one-shot ``spec.method`` on one layer."""
    return ONESHOT_METHODS[spec.method](weight, inputs, spec, config)
