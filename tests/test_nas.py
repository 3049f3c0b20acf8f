"""NAS-BERT builder: every searched knob changes the built model (MASE's num_layers/num_heads did not)."""

import pytest
import torch
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.nas import build_nas_bert, square_linear_names, square_linears
from tests.helpers import expected_param_count

VOCAB, POSITIONS, LABELS = 100, 64, 2


def build(**arch) -> nn.Module:
    torch.manual_seed(0)
    return build_nas_bert(
        vocab_size=VOCAB, max_position_embeddings=POSITIONS, attn_implementation="eager", **arch
    )


@pytest.mark.parametrize(
    ("layers", "heads", "hidden", "intermediate"),
    [(2, 2, 32, 64), (4, 2, 32, 64), (2, 8, 32, 64), (2, 2, 48, 64), (2, 2, 32, 96), (3, 4, 64, 128)],
)
def test_each_knob_sets_the_built_shapes(layers, heads, hidden, intermediate):
    model = build(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        hidden_size=hidden,
        intermediate_size=intermediate,
    )

    assert len(model.bert.encoder.layer) == layers
    assert sum(p.numel() for p in model.parameters()) == expected_param_count(layers, hidden, intermediate)
    for block in model.bert.encoder.layer:
        assert block.attention.self.query.weight.shape == (hidden, hidden)
        assert block.intermediate.dense.weight.shape == (intermediate, hidden)
        assert block.output.dense.weight.shape == (hidden, intermediate)
    # heads change no parameter count, so check them where they act: one attention map per head
    out = model(input_ids=torch.randint(0, VOCAB, (3, 5)), output_attentions=True)
    assert out.logits.shape == (3, LABELS)
    assert [tuple(a.shape) for a in out.attentions] == [(3, heads, 5, 5)] * layers


def test_square_linears_are_attention_projections_and_pooler():
    names = square_linear_names(
        num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64
    )
    per_layer = [
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
    ]
    expected = [f"bert.encoder.layer.{i}.{p}" for i in range(2) for p in per_layer] + ["bert.pooler.dense"]
    assert names == expected
    model = build(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64)
    assert square_linears(model) == expected


def test_feed_forward_is_square_when_intermediate_equals_hidden():
    names = square_linear_names(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=32
    )
    assert "bert.encoder.layer.0.intermediate.dense" in names
    assert "bert.encoder.layer.0.output.dense" in names
    assert len(names) == 6 + 1


def test_identity_layers_replace_modules_and_change_the_function():
    arch = dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64)
    chosen = ["bert.encoder.layer.0.attention.self.value", "bert.encoder.layer.1.attention.output.dense"]
    plain, pruned = build(**arch), build(**arch, identity_layers=chosen)

    for name in chosen:
        assert isinstance(pruned.get_submodule(name), nn.Identity)
    assert sum(p.numel() for p in pruned.parameters()) == expected_param_count(2, 32, 64, identities=2)
    ids = torch.randint(0, VOCAB, (2, 6))
    plain.eval(), pruned.eval()
    assert not torch.allclose(plain(input_ids=ids).logits, pruned(input_ids=ids).logits)


def test_invalid_architecture_is_a_config_error():
    with pytest.raises(ConfigError, match="not divisible|not a multiple"):
        build(num_hidden_layers=2, num_attention_heads=3, hidden_size=32, intermediate_size=64)
    with pytest.raises(ConfigError, match="not a multiple"):
        square_linear_names(num_hidden_layers=2, num_attention_heads=3, hidden_size=32, intermediate_size=64)


def test_identity_on_a_non_square_layer_is_rejected():
    with pytest.raises(ConfigError, match="identity_layers: 'bert.encoder.layer.0.intermediate.dense'"):
        build(
            num_hidden_layers=1,
            num_attention_heads=2,
            hidden_size=32,
            intermediate_size=64,
            identity_layers=["bert.encoder.layer.0.intermediate.dense"],
        )
