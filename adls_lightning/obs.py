"""Optimal Brain Surgeon machinery shared by GPTQ (:mod:`adls_lightning.quant.gptq`) and SparseGPT
(:mod:`adls_lightning.prune.oneshot`): each layer's input statistics from calibration batches, the upper Cholesky
factor of the damped inverse Hessian, and the column sweep with lazy block updates that both papers use.

For a layer ``W`` (out × in) and calibration inputs ``X`` (n tokens × in), the layer's squared output error has the
Hessian ``H = 2 XᵀX / n``. Both methods replace the columns of ``W`` one at a time (GPTQ rounds a column, SparseGPT
zeroes some of its entries) and spread the change, divided by ``[H⁻¹]ᵢᵢ``, over the columns still to come along
row ``i`` of the upper Cholesky factor ``U`` of ``H⁻¹`` (``Uᵢᵢ² = [H_F⁻¹]ᵢᵢ`` for ``F`` the columns from ``i`` on,
so ``U`` gives every column's OBS denominator without downdating the inverse).

The statistics come from one pass of the calibration batches through the model as it is, not from re-running each
block on the already compressed ones as the papers do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from adls_lightning.calibration import watch_inputs


@dataclass
class LayerInputs:
    """What a layer received over the calibration batches: ``gram = XᵀX`` (in × in, float32, CPU) over ``tokens``
    input rows (every position of every sample)."""

    gram: Tensor
    tokens: int

    def hessian(self) -> Tensor:
        """``2 XᵀX / n``, the Hessian of the layer's mean squared output error."""
        return 2 * self.gram / max(self.tokens, 1)

    def feature_norms(self) -> Tensor:
        """``‖X_j‖₂`` of every input feature ``j`` over all calibration tokens (Wanda's activation norm)."""
        return self.gram.diagonal().clamp_min(0).sqrt()


def input_statistics(
    model: nn.Module,
    layers: Mapping[str, nn.Module],
    batches: Iterable[Any],
    forward: Callable[[Any], Any],
    count: int,
) -> tuple[dict[str, LayerInputs], int]:
    """:class:`LayerInputs` of each layer of ``layers`` over ``count`` calibration batches (model in eval mode), and
    the batches run. A layer that never ran has an empty ``0 × 0`` gram."""
    grams: dict[str, Tensor] = {}
    tokens = dict.fromkeys(layers, 0)

    def record(name: str, x: Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32).cpu()
        if name not in grams:
            grams[name] = torch.zeros(x.shape[1], x.shape[1])
        grams[name].addmm_(x.T, x)
        tokens[name] += x.shape[0]

    run = watch_inputs(model, layers, record, batches, forward, count)
    return {name: LayerInputs(grams.get(name, torch.zeros(0, 0)), tokens[name]) for name in layers}, run


def dead_inputs_removed(weight: Tensor, hessian: Tensor) -> tuple[Tensor, Tensor]:
    """Float32 copies of ``weight`` and ``hessian`` (on the weight's device) in which the inputs that never fire
    (``Hᵢᵢ = 0``) get zero weights and a unit diagonal, so the Hessian can be inverted; their columns then change
    nothing in the output."""
    w = weight.detach().to(torch.float32).clone()
    h = hessian.to(device=w.device, dtype=torch.float32).clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    return w, h


def inverse_cholesky(hessian: Tensor, damp: float) -> Tensor:
    """The upper Cholesky factor ``U`` of ``(H + λI)⁻¹`` with ``λ = damp · mean(diag H)`` (``hessian`` is not
    changed)."""
    h = hessian.clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


#: ``choose(block, u, i, start) -> column``: the new value of column ``i`` of ``block`` (columns ``start`` to
#: ``start + block.shape[1]`` of the weight, with every earlier change already spread over them; ``u`` is the block's
#: diagonal square of ``U``). It may read the block's later columns, e.g. to choose a mask for several at once.
ChooseColumn = Callable[[Tensor, Tensor, int, int], Tensor]


@torch.no_grad()
def obs_sweep(w: Tensor, upper: Tensor, block_size: int, choose: ChooseColumn) -> Tensor:
    """Replaces the columns of ``w`` (out × in, float32; changed in place) in order by ``choose``'s values and
    compensates each change on the columns still to come; returns the chosen weight.

    Within a block of ``block_size`` columns the compensation is applied column by column; the later blocks get
    the whole block's at once (the lazy batch update), which gives the same result with fewer passes over ``w``.
    """
    columns = w.shape[1]
    q = torch.zeros_like(w)
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        u = upper[start:end, start:end]
        for i in range(end - start):
            column = block[:, i]
            chosen = choose(block, u, i, start)
            q[:, start + i] = chosen
            error = (column - chosen) / u[i, i]
            block[:, i:] -= error[:, None] * u[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ upper[start:end, end:]
    return q
