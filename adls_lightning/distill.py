"""Knowledge distillation (Hinton et al. 2015; DistilBERT, TinyBERT) from a frozen copy of a model: the loss of
compression-aware fine-tuning (``compress.distill``) with the model before compression as the teacher.

The loss of a batch, with task loss ``L_task``, student logits ``z_s``, teacher logits ``z_t``, temperature ``T`` and
weight ``w``:

    L = (1 - w) · L_task + w · T² · KL(softmax(z_t / T) ‖ softmax(z_s / T))

(the KL divergence averaged over the batch; ``T²`` keeps the soft targets' gradients on the task loss's scale as
``T`` grows, as in Hinton et al.). A regression head (one output) has no distribution to soften: its term is the mean
squared error between the two outputs, ``L = (1 - w) · L_task + w · MSE(z_s, z_t)``.

Cost: one forward of the teacher per training batch, in eval mode (no dropout), under ``torch.no_grad`` (no graph, no
gradient); no second optimizer, the teacher's parameters are in none. :class:`Distiller` is a plain object, not an
``nn.Module``: held by a module as an attribute, its teacher is not a submodule, so it is neither in the module's
``state_dict`` (checkpoints keep their keys) nor in its ``parameters()`` (the optimizer), nor switched back to train
mode by ``module.train()``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adls_lightning.data.inputs import model_inputs
from adls_lightning.errors import ConfigError


def check_distillation(temperature: Any, weight: Any, key: str = "compress") -> None:
    """``{key}.distill_temperature`` a positive finite number, ``{key}.distill_weight`` in [0, 1].

    Raises:
        ConfigError: naming the key.
    """
    valid_number = isinstance(temperature, int | float) and not isinstance(temperature, bool)
    if not valid_number or not math.isfinite(temperature) or temperature <= 0:
        raise ConfigError(
            f"{key}.distill_temperature={temperature!r}: must be a positive finite number, e.g. 2.0"
        )
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight <= 1:
        raise ConfigError(
            f"{key}.distill_weight={weight!r}: must be a number in [0, 1] (the distillation term's share of the loss)"
        )


def distillation_loss(
    student: Tensor, teacher: Tensor, task_loss: Tensor, temperature: float, weight: float
) -> tuple[Tensor, Tensor]:
    """``(loss, distillation term)`` of a batch (see the module docstring).

    Args:
        student: The student's logits, ``(batch, classes)``; ``(batch, 1)`` is a regression output.
        teacher: The teacher's logits, the same shape.
        task_loss: The student's loss on the labels.
        temperature: ``T`` of the softened distributions (not read for a regression output).
        weight: ``w``, the distillation term's share.
    """
    teacher = teacher.detach().to(student.dtype)
    if student.shape[-1] == 1:
        term = F.mse_loss(student, teacher)
    else:
        log_student = F.log_softmax(student / temperature, dim=-1)
        log_teacher = F.log_softmax(teacher / temperature, dim=-1)
        kl = F.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True)
        term = temperature**2 * kl
    return (1 - weight) * task_loss + weight * term, term


class Distiller:
    """A frozen copy of ``model`` (the teacher) and the distillation loss against it.

    Args:
        model: The model to copy (e.g. the Hugging Face model before compression, LoRA merged); called with the
            batch's inputs (:func:`~adls_lightning.data.inputs.model_inputs`), returning an output with ``.logits``.
        temperature: ``T``.
        weight: ``w``.
    """

    def __init__(self, model: nn.Module, temperature: float = 2.0, weight: float = 0.5) -> None:
        check_distillation(temperature, weight)
        self.temperature = float(temperature)
        self.weight = float(weight)
        self.teacher = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def teacher_logits(self, batch: Mapping[str, Any]) -> Tensor:
        """The teacher's logits for a batch (eval mode, no graph)."""
        return self.teacher(**model_inputs(batch)).logits

    def loss(
        self, batch: Mapping[str, Any], student_logits: Tensor, task_loss: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The training loss of a batch and its parts to log: ``{"task_loss", "distill_loss"}``."""
        loss, term = distillation_loss(
            student_logits, self.teacher_logits(batch), task_loss, self.temperature, self.weight
        )
        return loss, {"task_loss": task_loss.detach(), "distill_loss": term.detach()}


def student_model(module: nn.Module) -> nn.Module:
    """The model a LightningModule wraps (its ``model``, the Hugging Face model whose layer names configs use), or
    ``module`` itself: what a teacher is copied from."""
    inner = getattr(module, "model", None)
    return inner if isinstance(inner, nn.Module) else module


def attach_distiller(
    module: nn.Module,
    teacher: nn.Module,
    temperature: float,
    weight: float,
    state: Mapping[str, Any] | None = None,
    key: str = "compress",
) -> Distiller:
    """A :class:`Distiller` of a frozen copy of ``teacher`` (with the weights ``state`` saved, on resume), handed to
    ``module``'s training step through its ``distiller`` attribute: the one way every compression callback distills.

    Raises:
        ConfigError: ``module`` has no ``distiller`` to use (``{key}.distill=true``).
    """
    if not hasattr(module, "distiller"):
        raise ConfigError(
            f"{key}.distill=true: {type(module).__name__} has no `distiller` to use in its training step "
            "(adls_lightning.module.SequenceClassifier has)"
        )
    distiller = Distiller(teacher, temperature, weight)
    if state is not None:
        distiller.teacher.load_state_dict(state)
    module.distiller = distiller
    return distiller
