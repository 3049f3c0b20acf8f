"""Movement pruning (Sanh et al. 2020, "Movement Pruning: Adaptive Sparsity by Fine-Tuning") and the cubic sparsity
schedule (Zhu & Gupta 2017) that pruning during training follows.

**Scores.** Magnitude pruning keeps the weights that are large; movement pruning keeps the weights that fine-tuning
moves away from zero. Each pruned layer accumulates the first-order movement score

    S = -Σ_t W_t ⊙ ∂L/∂W'_t

over every backward pass of the fit, where ``W' = M ⊙ W`` is the masked weight the layer computes with. This is the
paper's hard movement score under its straight-through estimator (``∂L/∂S = ∂L/∂W' ⊙ W``), summed: what SGD on S
would learn (the score learning rate only scales S and top-k ranks the same). The paper's code learns S with AdamW,
which normalises each entry's updates: ``method: movement_adam`` (:class:`AdamMovementMask`) learns them that way.
Pruned entries keep accumulating (straight-through, their gradient through the mask is ``∂L/∂W'``, not 0), so a
pruned weight whose score overtakes a kept one comes back. There is no score parameter and no optimizer: S is a float32 buffer beside the mask
(:class:`MovementMask`), added to by a backward hook on the masked weight.

**Masks.** After every optimizer step the masks keep the highest ``1 - s_t`` of each layer's scores (exactly
``round(s_t · n)`` zeros, ties by position, :func:`~adls_lightning.prune.masks.masks_from_scores`), with ``s_t``
the schedule's sparsity for the next step. Until the first backward every score is 0 and the layers stay dense.

**Consistency.** Movement ranks by where fine-tuning keeps moving a weight; when it moves it one way on some steps and
back on others, the ranking is noise. Each layer follows a fixed sample of its entries (4,096, or all of a smaller
layer) and sums their per-step movement ``-W ⊙ ∂L/∂W'`` over the even and, apart, over the odd optimizer steps:
:meth:`MovementMask.consistency`, the Spearman rank correlation of the two sums, is near 1 when the ranking is a
property of the weights and near 0 (or below: steps that undo each other) when it is noise. It is the same quantity
for both methods (Adam normalises the same per-step movement).

**Schedule** (:class:`CubicSchedule`, ``prune.schedule``): of a fit of ``T`` optimizer steps, the first
``t_w = round(warmup · T)`` steps train at the initial sparsity ``s_i``, the last ``t_c = round(cooldown · T)`` at
the final one ``s_f`` (``prune.weight.sparsity``), and in between

    s_t = s_f + (s_i - s_f) · (1 - (t - t_w) / (T - t_w - t_c))³

(Zhu & Gupta's cubic ramp, with Sanh et al.'s warm-up and cool-down). The mask computed after the last step has
``s_T = s_f``, so the trained model ends at the final sparsity even with ``cooldown = 0``. Any score method follows
the same schedule (``l1`` on it is Zhu & Gupta's gradual magnitude pruning); only learned methods need it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchmetrics.functional import spearman_corrcoef

from adls_lightning.errors import ConfigError, require_fraction
from adls_lightning.prune.masks import WeightMask, num_to_prune
from adls_lightning.prune.scores import LEARNED_METHODS
from adls_lightning.registry import named_decorator

#: ``prune.schedule``'s keys (the final sparsity is ``prune.weight.sparsity``).
SCHEDULE_KEYS = ("initial_sparsity", "warmup", "cooldown")
#: entries of each layer whose movement :meth:`MovementMask.consistency` follows (all of a smaller layer)
CONSISTENCY_SAMPLE = 4096
#: below this mean consistency a ranking is mostly noise (pure noise gives about 0 ± 0.02 on 4,096 entries;
#: docs/pruning.md: MiniLM's encoder layers measure about 0 on IMDb at a learning rate of 1e-4, its pooler 0.44)
NOISY_CONSISTENCY = 0.2


def register_learned(name: str) -> Callable[[type], type]:
    """Decorator: make a :class:`~adls_lightning.prune.masks.WeightMask` subclass that accumulates its own ranking
    scores in a ``scores`` buffer (the highest are kept) available as ``method: <name>``."""
    return named_decorator(LEARNED_METHODS, name)


@register_learned("movement")
class MovementMask(WeightMask):
    """A :class:`~adls_lightning.prune.masks.WeightMask` that also accumulates movement scores ``-W ⊙ ∂L/∂W'``.

    The ``scores`` buffer is not persistent: the model's ``state_dict`` keeps exactly the keys of any other pruned
    layer, so checkpoints, exports and evaluations load alike; the pruning callback saves the scores in its own
    state, which is what a resumed fit needs.
    """

    def __init__(self, mask: Tensor) -> None:
        super().__init__(mask)
        scores = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        self.register_buffer("scores", scores, persistent=False)
        # the consistency check's sample (fixed: the same entries every step and after a resume), the movement of
        # those entries in this optimizer step, and its sums over the even [0] and the odd [1] steps
        count = mask.numel()
        sample = torch.randperm(count, generator=torch.Generator().manual_seed(0))[:CONSISTENCY_SAMPLE]
        self.register_buffer("sample", sample.sort().values.to(mask.device), persistent=False)
        self.register_buffer("sample_step", torch.zeros(len(sample), device=mask.device), persistent=False)
        self.register_buffer(
            "sample_halves", torch.zeros(2, len(sample), device=mask.device), persistent=False
        )
        self.register_buffer("sample_steps", torch.zeros((), dtype=torch.int64), persistent=False)
        self._sampled = False

    def forward(self, weight: Tensor) -> Tensor:
        masked = super().forward(weight)
        if masked.requires_grad:  # a training forward: score the gradient it gets
            original = weight.detach()
            masked.register_hook(lambda grad: self._accumulate(grad, original))
        return masked

    @torch.no_grad()
    def _accumulate(self, grad: Tensor, weight: Tensor) -> None:
        # the gradient of the masked weight, for every entry: straight-through, pruned ones are scored too
        self.scores.addcmul_(grad.to(self.scores.dtype), weight.to(self.scores.dtype), value=-1.0)
        self._sample_movement(grad, weight)

    def _sample_movement(self, grad: Tensor, weight: Tensor) -> None:
        # index_select on the flat view: a third of the time of advanced indexing, once per micro-batch and layer
        grad, weight = (
            t.reshape(-1).index_select(0, self.sample).to(self.sample_step.dtype) for t in (grad, weight)
        )
        self.sample_step.addcmul_(grad, weight, value=-1.0)
        self._sampled = True

    @torch.no_grad()
    def learn(self, reduce: Callable[[Tensor], Tensor] | None = None, lr_scale: float = 1.0) -> None:
        """Ends an optimizer step: the scores are final for ranking. ``reduce`` averages them over the processes of a
        distributed fit (each accumulated its own batches); summed scores need no learning rate (``lr_scale``)."""
        if reduce is not None:
            self.scores.copy_(reduce(self.scores))
        self._end_sample_step(reduce)

    def _end_sample_step(self, reduce: Callable[[Tensor], Tensor] | None) -> None:
        if not self._sampled:  # no backward since the last step (the fit's start, a resume)
            return
        movement = reduce(self.sample_step) if reduce is not None else self.sample_step
        self.sample_halves[int(self.sample_steps) % 2] += movement
        self.sample_steps += 1
        self.sample_step.zero_()
        self._sampled = False

    def consistency(self) -> float | None:
        """How far the sampled entries' ranking by movement is a property of the weights rather than of the batches:
        the Spearman rank correlation of their movement summed over the even and over the odd optimizer steps (1: the
        same ranking from both; 0: independent, as noise gives; below 0: steps that undo each other). ``None``
        before two steps, or when a half has no spread."""
        if int(self.sample_steps) < 2 or bool((self.sample_halves.std(dim=1) == 0).any()):
            return None
        even, odd = self.sample_halves.double()
        return float(spearman_corrcoef(even, odd))

    def consistency_state(self) -> dict[str, Tensor]:
        """What :meth:`consistency` needs to continue after a resume."""
        return {"sample_halves": self.sample_halves.clone(), "sample_steps": self.sample_steps.clone()}

    def optimizer_state(self) -> dict[str, Tensor]:
        """What a resumed fit needs besides ``scores`` (nothing: the sum is its own state)."""
        return {}

    @torch.no_grad()
    def load_state(self, state: Mapping[str, Tensor]) -> None:
        """Copies saved buffers back by name: ``scores``, :meth:`optimizer_state`, :meth:`consistency_state`."""
        for name, value in state.items():
            buffer = getattr(self, name)
            buffer.copy_(value.to(device=buffer.device, dtype=buffer.dtype))


@register_learned("movement_adam")
class AdamMovementMask(MovementMask):
    """Movement scores learned as the paper's code learns them: ``S`` is descended with Adam on ``∂L/∂S = ∂L/∂W' ⊙ W``
    (straight-through, pruned entries included), once per optimizer step, at the training schedule's learning-rate
    multiplier (``lr_scale``; Sanh et al. put the scores in the same AdamW with the same linear schedule, without
    weight decay). Adam divides each entry's step by the root mean square of its own gradients, so a weight ranks by
    how consistently fine-tuning moves it away from zero, not by how large it is: summed scores (``movement``) scale
    with ``|W|``, so on a short fit the gradient noise of the largest weights decides their fate.

    The score learning rate itself (the paper's ``1e-2``) scales every score alike, so top-k ranks the same without
    it (the ``eps`` below is relative to the gradient, so it is not scaled away); ``betas`` and ``eps`` are the
    paper's AdamW settings.
    """

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __init__(self, mask: Tensor) -> None:
        super().__init__(mask)
        for name in ("step_gradient", "exp_avg", "exp_avg_sq"):
            self.register_buffer(name, torch.zeros_like(self.scores), persistent=False)
        self.register_buffer("step", torch.zeros((), dtype=torch.float64), persistent=False)

    @torch.no_grad()
    def _accumulate(self, grad: Tensor, weight: Tensor) -> None:
        # -∂L/∂S of this optimizer step (accumulated over its micro-batches), applied by learn()
        self.step_gradient.addcmul_(grad.to(self.scores.dtype), weight.to(self.scores.dtype), value=-1.0)
        self._sample_movement(grad, weight)

    @torch.no_grad()
    def learn(self, reduce: Callable[[Tensor], Tensor] | None = None, lr_scale: float = 1.0) -> None:
        if not self._sampled:  # no backward since the last step (the fit's start, a resume)
            return
        gradient = reduce(self.step_gradient) if reduce is not None else self.step_gradient
        beta1, beta2 = self.betas
        self.step += 1
        self.exp_avg.lerp_(gradient, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
        step = float(self.step)
        denominator = (self.exp_avg_sq / (1 - beta2**step)).sqrt_().add_(self.eps)
        self.scores.addcdiv_(self.exp_avg, denominator, value=lr_scale / (1 - beta1**step))
        self.step_gradient.zero_()
        self._end_sample_step(reduce)

    def optimizer_state(self) -> dict[str, Tensor]:
        return {name: getattr(self, name).clone() for name in ("exp_avg", "exp_avg_sq", "step")}


@dataclass(frozen=True)
class CubicSchedule:
    """The sparsity of each training step (see the module docstring for the formula).

    Args:
        final_sparsity: ``s_f``, reached after ``T - t_c`` steps (``prune.weight.sparsity``).
        initial_sparsity: ``s_i`` in ``[0, s_f]``, the sparsity of the warm-up steps.
        warmup: Fraction of the fit's steps at ``s_i``, in ``[0, 1)``.
        cooldown: Fraction of the fit's steps at ``s_f``, at its end, in ``[0, 1)``; ``warmup + cooldown < 1``.
        key: Config key prefix for error messages.

    Raises:
        ConfigError: On a value out of range.
    """

    final_sparsity: float
    initial_sparsity: float = 0.0
    warmup: float = 0.1
    cooldown: float = 0.1
    key: str = "prune.schedule"

    def __post_init__(self) -> None:
        for name in ("warmup", "cooldown"):
            require_fraction(f"{self.key}.{name}", getattr(self, name))
        if self.warmup + self.cooldown >= 1:
            raise ConfigError(
                f"{self.key}.warmup={self.warmup} + {self.key}.cooldown={self.cooldown}: must be below 1, leaving "
                "training steps for the sparsity to rise in"
            )
        require_fraction(f"{self.key}.initial_sparsity", self.initial_sparsity)
        if self.initial_sparsity > self.final_sparsity:
            raise ConfigError(
                f"{self.key}.initial_sparsity={self.initial_sparsity}: must be at most the final sparsity "
                f"{self.final_sparsity} (prune.weight.sparsity); the schedule only rises"
            )

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any] | None, final_sparsity: float, key: str = "prune.schedule"
    ) -> CubicSchedule:
        """The schedule of a ``{initial_sparsity, warmup, cooldown}`` mapping; ``None`` = the defaults.

        Raises:
            ConfigError: On an unknown key or a value out of range.
        """
        config = {k: v for k, v in (config or {}).items() if v is not None}
        unknown = sorted(set(config) - set(SCHEDULE_KEYS))
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}: unknown key; valid keys are {', '.join(SCHEDULE_KEYS)}")
        return cls(final_sparsity=final_sparsity, key=key, **config)

    def bounds(self, total_steps: int) -> tuple[int, int]:
        """``(t_w, T - t_c)``: the first step of the ramp and the first step at the final sparsity."""
        # num_to_prune is the exact round-half-up of fraction x count the masks' counts use
        return num_to_prune(total_steps, self.warmup), total_steps - num_to_prune(total_steps, self.cooldown)

    def sparsity(self, step: int, total_steps: int) -> float:
        """The sparsity of the masks step ``step`` (0-based; ``total_steps`` = after the last) trains with."""
        start, end = self.bounds(total_steps)
        if step >= end:
            return self.final_sparsity
        if step < start:
            return self.initial_sparsity
        remaining = 1 - (step - start) / (end - start)
        # s_f + (s_i - s_f) r³ written from s_i: exactly s_i at the ramp's first step (r = 1), never below it
        return self.initial_sparsity + (self.final_sparsity - self.initial_sparsity) * (1 - remaining**3)
