"""Pruning methods that rank entries from the tensor alone: the registry (``prune.weight.method``,
``prune.activation.method``) and its ``l1`` and ``random`` scores."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from adls_lightning.registry import Registry, named_decorator

#: A pruning method: ``scores(tensor, generator) -> Tensor`` of the same shape; the lowest scores are pruned
#: (ties by position). ``generator`` is a seeded ``torch.Generator`` for methods that draw random numbers.
ScoreFn = Callable[[Tensor, torch.Generator], Tensor]
#: Method name (``prune.weight.method``) -> scoring function, filled by :func:`register_method`.
PRUNE_METHODS: Registry[ScoreFn] = Registry("pruning method")


def register_method(name: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator: make a scoring function available as ``method: <name>`` (``docs/extending.md``)."""
    return named_decorator(PRUNE_METHODS, name)


@register_method("l1")
def l1_scores(tensor: Tensor, generator: torch.Generator) -> Tensor:
    """Magnitude: the smallest ``|x|`` are pruned."""
    return tensor.detach().abs()


@register_method("random")
def random_scores(tensor: Tensor, generator: torch.Generator) -> Tensor:
    """Seeded uniform noise (drawn on the generator's device): a random ranking."""
    noise = torch.rand(tensor.shape, generator=generator, device=generator.device)
    return noise.to(tensor.device)


def rank_scores(tensor: Tensor, method: str, generator: torch.Generator) -> Tensor:
    """Ranking scores of ``tensor`` by the registered ``method`` (lowest pruned first)."""
    return PRUNE_METHODS[method](tensor, generator)
