"""NAS-BERT: a randomly initialised BERT classifier built from searched architecture parameters (Lab 2).

BERT only, as the labs' NAS-BERT: the knobs are ``BertConfig``'s and the identity swap knows BERT's square linears.
Random models of the other families (tests, smoke runs) come from :func:`adls_lightning.models.build_from_config`.

Every knob changes the model. MASE's Tutorial 5 set ``num_layers``/``num_heads`` on the ``BertConfig``, whose real
fields are ``num_hidden_layers``/``num_attention_heads``, so two of its four knobs were silently ignored; here the
four knobs are the ``BertConfig`` fields themselves (``tests/test_nas.py`` checks built models against them).

Like MASE, every square ``nn.Linear`` (``in_features == out_features``) may be replaced by an identity: the
attention query/key/value/output projections of each layer, the pooler, and the feed-forward pair when
``intermediate_size == hidden_size``. Which layers are square depends on the architecture, so the search space
asks :func:`square_linear_names` after the four knobs are chosen (define-by-run).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

from adls_lightning.errors import ConfigError
from adls_lightning.models import build_from_config


def square_linears(model: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` whose weight is square, in module order."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module.in_features == module.out_features
    ]


def square_linear_names(
    num_hidden_layers: int, num_attention_heads: int, hidden_size: int, intermediate_size: int
) -> list[str]:
    """The square linears of the architecture, found on a weightless (meta-device) model without allocating it.

    Raises:
        ConfigError: the architecture cannot be built (transformers' own check, e.g. heads not dividing hidden).
    """
    config = BertConfig(
        vocab_size=1,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
    )
    try:
        with torch.device("meta"):
            return square_linears(BertForSequenceClassification(config))
    except ValueError as err:
        raise ConfigError(f"model.backbone: {err}") from None


def build_nas_bert(
    name_or_path: str | None = None,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    hidden_size: int = 128,
    intermediate_size: int = 512,
    identity_layers: list[str] | tuple[str, ...] = (),
    num_labels: int = 2,
    **config_kwargs,
) -> BertForSequenceClassification:
    """A randomly initialised BERT classifier with the given architecture and some square linears made identities.

    Args:
        name_or_path: checkpoint whose tokenizer feeds the model (sets the vocabulary size; weights are not read).
        num_hidden_layers: transformer layers.
        num_attention_heads: heads per attention layer; must divide ``hidden_size``.
        hidden_size: width of the residual stream.
        intermediate_size: width of the feed-forward layer.
        identity_layers: module names (as in :func:`square_linear_names`) replaced by ``nn.Identity``.
        num_labels: classes of the classification head.
        **config_kwargs: further ``BertConfig`` fields (dropout, max_position_embeddings, ...).

    Raises:
        ConfigError: an impossible architecture, or an identity layer that is not a square linear of this model.
    """
    model = build_from_config(
        name_or_path=name_or_path,
        num_labels=num_labels,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        **config_kwargs,
    )
    square = square_linears(model)
    unknown = sorted(set(identity_layers) - set(square))
    if unknown:
        raise ConfigError(
            f"model.backbone.identity_layers: {unknown[0]!r} is not a square linear of this architecture "
            f"(valid: {square[0]!r} ... {square[-1]!r}, {len(square)} names from adls_lightning.nas.square_linear_names)"
        )
    for name in identity_layers:
        model.set_submodule(name, nn.Identity())
    return model
