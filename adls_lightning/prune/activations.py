"""Activation pruning: a forward pre-hook that prunes each sample of a layer's input, recomputed on every forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from adls_lightning.prune.masks import MaskSpec, num_to_prune, smallest_k
from adls_lightning.prune.scores import rank_scores


class ActivationSparsifier:
    """Forward pre-hook that prunes a layer's input per sample and counts zeros of what it passes on.

    Each sample (first dimension; a 1-D input is one sample) gets exactly ``num_to_prune(sample numel)`` zeros,
    chosen by ``|x|`` (``l1``) or by seeded noise (``random``), ties by position. Only the first positional
    argument is pruned. Zero counting is off until :meth:`start_count`, so its cost is paid only in the pass
    being measured.

    Args:
        spec: Sparsity and method, or ``None`` to only count zeros.
        seed: Seed of the per-device generators used by ``random``.
    """

    def __init__(self, spec: MaskSpec | None, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        self.counting = False
        self.zeros: Tensor | None = None
        self.numel = 0
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def prune(self, x: Tensor) -> Tensor:
        """Returns ``x`` with its per-sample lowest-ranked entries set to zero."""
        if self.spec is None or self.spec.sparsity == 0:
            return x
        rows = x.reshape(1, -1) if x.dim() < 2 else x.reshape(x.shape[0], -1)
        generator = self._generator(x.device)
        pruned = smallest_k(
            rank_scores(rows, self.spec.method, generator), num_to_prune(rows.shape[1], self.spec.sparsity)
        )
        pruned = pruned.view_as(x)
        if x.device.type == "cpu" and bool(torch.isfinite(x).all()):
            # same values (a pruned negative becomes -0.0) and gradient as masked_fill, several times faster on
            # CPU; with inf or NaN in x the product would give NaN where masked_fill gives 0
            return x * (~pruned).to(x.dtype)
        return x.masked_fill(pruned, 0)

    def start_count(self) -> None:
        """Resets the zero counters and starts counting."""
        self.counting, self.zeros, self.numel = True, None, 0

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], Tensor):
            return None
        x = self.prune(args[0])
        if self.counting:
            zeros = (x == 0).sum()
            self.zeros = zeros if self.zeros is None else self.zeros + zeros
            self.numel += x.numel()
        return (x, *args[1:])
