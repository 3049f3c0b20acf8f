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
pruned weight whose score overtakes a kept one comes back. There is no score parameter and no optimizer: S is a float32
buffer beside the mask (:class:`MovementMask`); a backward hook on the masked weight adds each micro-batch's
``-W ⊙ ∂L/∂W'`` to a step buffer, which is clipped with the weights' gradients (:func:`clip_score_gradients`, as the
paper's code clips its score parameters) and learned from once per optimizer step.

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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

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
        self.register_buffer(
            "sample_halves", torch.zeros(2, len(sample), device=mask.device), persistent=False
        )
        self.register_buffer("sample_steps", torch.zeros((), dtype=torch.int64), persistent=False)
        # -∂L/∂S of this optimizer step, accumulated over its micro-batches and applied by learn()
        self.register_buffer("step_gradient", torch.zeros_like(scores), persistent=False)
        self._has_gradient = False  # a backward since the last learn()
        self._finished = False  # step_gradient already averaged over processes, unscaled and clipped

    def forward(self, weight: Tensor) -> Tensor:
        masked = super().forward(weight)
        if masked.requires_grad:  # a training forward: score the gradient it gets
            original = weight.detach()
            masked.register_hook(lambda grad: self._accumulate(grad, original))
        return masked

    @torch.no_grad()
    def _accumulate(self, grad: Tensor, weight: Tensor) -> None:
        # -∂L/∂S = -∂L/∂W' ⊙ W for every entry: straight-through, pruned ones are scored too
        self.step_gradient.addcmul_(grad.to(self.scores.dtype), weight.to(self.scores.dtype), value=-1.0)
        self._has_gradient = True

    @torch.no_grad()
    def finish_gradient(self, reduce: Callable[[Tensor], Tensor] | None = None, scale: float = 1.0) -> bool:
        """Makes this step's score gradient the one to learn from: averaged over the processes of a distributed fit
        (``reduce``; each accumulated its own batches) and multiplied by ``scale`` (a loss scaler's inverse scale).
        Once per step; returns whether there is a gradient (no backward since the last step: the fit's start, a
        resume). Clipping it with the weights' gradients is :func:`clip_score_gradients`."""
        if not self._has_gradient or self._finished:
            return self._has_gradient
        if reduce is not None:
            self.step_gradient.copy_(reduce(self.step_gradient))
        if scale != 1.0:
            self.step_gradient.mul_(scale)
        self._finished = True
        return True

    @torch.no_grad()
    def learn(self, reduce: Callable[[Tensor], Tensor] | None = None, lr_scale: float = 1.0) -> None:
        """Ends an optimizer step: learns from its score gradient (:meth:`finish_gradient`, if not already called),
        after which the scores are final for ranking. Summed scores need no learning rate (``lr_scale``)."""
        if not self.finish_gradient(reduce):
            return
        self._learn_from(self.step_gradient, lr_scale)
        # the consistency check follows the movement the scores learned from, this step's at the sampled entries
        self.sample_halves[int(self.sample_steps) % 2] += self.step_gradient.reshape(-1).index_select(
            0, self.sample
        )
        self.sample_steps += 1
        self.discard_gradient()

    def _learn_from(self, gradient: Tensor, lr_scale: float) -> None:
        self.scores.add_(gradient)  # what SGD on S learns, up to its learning rate

    def discard_gradient(self) -> None:
        """Forgets this step's score gradient (a step the optimizer skips teaches the scores nothing)."""
        self.step_gradient.zero_()
        self._has_gradient = self._finished = False

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
        for name in ("exp_avg", "exp_avg_sq"):
            self.register_buffer(name, torch.zeros_like(self.scores), persistent=False)
        self.register_buffer("step", torch.zeros((), dtype=torch.float64), persistent=False)

    def _learn_from(self, gradient: Tensor, lr_scale: float) -> None:
        beta1, beta2 = self.betas
        self.step += 1
        self.exp_avg.lerp_(gradient, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
        step = float(self.step)
        denominator = (self.exp_avg_sq / (1 - beta2**step)).sqrt_().add_(self.eps)
        self.scores.addcdiv_(self.exp_avg, denominator, value=lr_scale / (1 - beta1**step))

    def optimizer_state(self) -> dict[str, Tensor]:
        return {name: getattr(self, name).clone() for name in ("exp_avg", "exp_avg_sq", "step")}


@torch.no_grad()
def clip_score_gradients(
    learners: Sequence[MovementMask],
    clip_val: float | None = None,
    algorithm: str = "norm",
    parameter_norm: float | Tensor = 0.0,
) -> float:
    """Clips one optimizer step's score gradients (each :meth:`MovementMask.finish_gradient`-ed) as the trainer clips
    the weights' gradients, as if the scores were parameters of the same optimizer. Sanh et al.'s code does exactly
    that: the scores are parameters, and one ``clip_grad_norm_(model.parameters(), 1.0)`` scales every gradient,
    theirs included, before AdamW steps. It matters for Adam-learned scores: a fine-tune's gradient norm is well above
    the clipping threshold on most steps, so the weights learn from every step's direction with about equal weight,
    while unclipped scores would learn mostly from the steps with the largest gradients, and rank the weights by a
    movement that is not the weights' own (docs/pruning.md, "Clipped like the weights").

    ``algorithm="norm"`` multiplies every score gradient by ``min(1, clip_val / (total + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does, ``total`` being the 2-norm of the weights' gradients
    (``parameter_norm``) and the scores' together; ``"value"`` clamps each entry to ``±clip_val``; ``clip_val=None``
    or ``0`` leaves them. A step whose score gradient is not finite (a float16 loss scaler's overflow, after which the
    optimizer skips the step) is discarded. Returns the factor applied (1.0 when none, 0.0 when discarded)."""
    norms = [learner.step_gradient.norm() for learner in learners]
    if not norms:
        return 1.0
    scores_norm = torch.stack(norms).norm()
    if not bool(torch.isfinite(scores_norm)):
        for learner in learners:
            learner.discard_gradient()
        return 0.0
    if not clip_val:
        return 1.0
    if algorithm == "value":
        for learner in learners:
            learner.step_gradient.clamp_(-clip_val, clip_val)
        return 1.0
    total = torch.hypot(scores_norm, torch.as_tensor(parameter_norm, dtype=scores_norm.dtype))
    factor = min(1.0, clip_val / (float(total) + 1e-6))
    if factor < 1.0:
        for learner in learners:
            learner.step_gradient.mul_(factor)
    return factor


class ScheduleSettings(TypedDict, total=False):
    """``prune.schedule`` as a config gives it (read by :meth:`CubicSchedule.from_config`)."""

    initial_sparsity: float | None
    warmup: float | None
    cooldown: float | None


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
