"""Calibration passes: a few training batches run through a model while forward pre-hooks watch layer inputs.

Shared by every method that learns from what layers receive: SmoothQuant's input ranges, the input statistics of
GPTQ, SparseGPT and Wanda (:mod:`adls_lightning.obs`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn


def watch_inputs(
    model: nn.Module,
    layers: Mapping[str, nn.Module],
    record: Callable[[str, Tensor], None],
    batches: Iterable[Any],
    forward: Callable[[Any], Any],
    count: int,
) -> int:
    """Runs up to ``count`` of ``batches`` through ``forward`` (``model`` in eval mode, no gradients), calling
    ``record(name, x)`` with the first positional input of each layer of ``layers`` (detached); returns the batches
    run. The model's training flag and the hooks are restored even when a batch fails."""

    def hook_for(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], Tensor):
                record(name, args[0].detach())

        return hook

    hooks = [layer.register_forward_pre_hook(hook_for(name)) for name, layer in layers.items()]
    try:
        with torch.no_grad():
            return run_batches(model, batches, forward, count)
    finally:
        for hook in hooks:
            hook.remove()


def run_batches(model: nn.Module, batches: Iterable[Any], forward: Callable[[Any], Any], count: int) -> int:
    """Runs up to ``count`` of ``batches`` through ``forward`` with ``model`` in eval mode; returns the batches run.
    The model's training flag is restored even when a batch fails."""
    was_training, run = model.training, 0
    model.eval()
    try:
        for batch in batches:
            if run >= count:
                break
            forward(batch)
            run += 1
    finally:
        model.train(was_training)
    return run
