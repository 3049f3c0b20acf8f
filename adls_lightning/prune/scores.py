"""Pruning methods by name (``prune.weight.method``, ``prune.activation.method``): the methods that rank entries from
the tensor alone (:data:`PRUNE_METHODS`: ``l1``, ``random``), the one-shot weight methods that also need
calibration data (:data:`ONESHOT_METHODS`: ``wanda``, ``sparsegpt``, registered in :mod:`adls_lightning.prune.oneshot`)
and the weight methods whose scores are learned while training (:data:`LEARNED_METHODS`: ``movement``, registered in
:mod:`adls_lightning.prune.movement`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from adls_lightning.registry import Registry, named_decorator

#: A pruning method: ``scores(tensor, generator) -> Tensor`` of the same shape; the lowest scores are pruned
#: (ties by position). ``generator`` is a seeded ``torch.Generator`` for methods that draw random numbers.
ScoreFn = Callable[[Tensor, torch.Generator], Tensor]
#: Method name (``prune.weight.method``) -> scoring function, filled by :func:`register_method`.
PRUNE_METHODS: Registry[ScoreFn] = Registry("pruning method")


#: Method name -> one-shot solver ``(weight, inputs, spec, config) -> (keep mask, new weight or None)`` (its signature
#: is :data:`adls_lightning.prune.oneshot.OneShotFn`), filled by :func:`adls_lightning.prune.oneshot.register_oneshot`.
#: Weights only: they rank each layer with its calibration inputs.
ONESHOT_METHODS: Registry[Callable[..., Any]] = Registry("one-shot pruning method")


#: Method name -> the weight-mask parametrization (a :class:`~adls_lightning.prune.masks.WeightMask` subclass) that
#: accumulates the method's scores from the training gradients, filled by
#: :func:`adls_lightning.prune.movement.register_learned`. Weights only; pruned on ``prune.schedule``.
LEARNED_METHODS: Registry[type] = Registry("learned pruning method")


def weight_methods() -> list[str]:
    """Every name ``prune.weight.method`` accepts: the scores, the one-shot methods, then the learned ones."""
    return [*PRUNE_METHODS, *ONESHOT_METHODS, *LEARNED_METHODS]


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
