"""What a sequence classifier is given of a batch: :func:`model_inputs` for every forward that is not a training
step (evaluation, calibration, a teacher's logits, the export's samples), so the names live in one place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: the inputs of a Hugging Face sequence classifier that a tokenized batch holds (token types: sentence pairs of
#: the families that use them); ``labels`` is not one: given it, the model would also compute a loss
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def model_inputs(batch: Mapping[str, Any], *, labels: bool = False) -> dict[str, Any]:
    """The :data:`MODEL_INPUTS` that ``batch`` holds (and its ``labels`` when ``labels``, for the model's loss)."""
    names = (*MODEL_INPUTS, "labels") if labels else MODEL_INPUTS
    return {key: batch[key] for key in names if key in batch}
