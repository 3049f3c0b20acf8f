"""The measured cost model (adls_lightning.search.cost): its cache key follows the machine, its predictions add
the remainder to the chosen layers, and an assignment builds a model that runs each layer in its choice."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from adls_lightning import gemm
from adls_lightning.errors import ConfigError
from adls_lightning.search import cost


class Counting:
    """Fake timings that record what they were asked to measure."""

    def __init__(self):
        self.layer_calls, self.model_calls = [], 0

    def layers(self, shapes, batch, tokens, threads, rounds):
        shapes = list(shapes)
        self.layer_calls.append([s.key for s in shapes])
        return {
            s.key: {c: 0.001 * s.in_features * (i + 1) for i, c in enumerate(s.choices())} for s in shapes
        }

    def models(self, models, batch, tokens, threads, rounds):
        self.model_calls += 1
        return {name: 5.0 for name in models}


def test_cache_key_changes_with_the_cpu_model(tiny_bert, tmp_path, monkeypatch):
    model = tiny_bert()
    timing = Counting()
    kwargs = dict(cache_dir=tmp_path, measure_layers_fn=timing.layers, measure_models_fn=timing.models)

    def on_cpu(name: str, flags: str) -> None:
        path = tmp_path / f"cpuinfo-{name}-{len(flags)}"
        path.write_text(f"model name\t: {name}\nflags\t\t: {flags}\n")
        monkeypatch.setattr(gemm, "CPUINFO", path)

    on_cpu("Fake CPU A", "sse2 avx2")
    first = cost.cost_table(model, batch=2, tokens=8, **kwargs)
    assert len(timing.layer_calls) == 1 and timing.model_calls == 1
    again = cost.cost_table(model, batch=2, tokens=8, **kwargs)
    assert len(timing.layer_calls) == 1 and timing.model_calls == 1  # read from the cache
    assert again.latency_ms == first.latency_ms and set(again.sources.values()) == {"cached"}
    on_cpu("Fake CPU B", "sse2 avx2")
    cost.cost_table(model, batch=2, tokens=8, **kwargs)
    assert len(timing.layer_calls) == 2 and timing.model_calls == 2  # another CPU: measured anew
    on_cpu("Fake CPU A", "sse2 avx2 avx512f")
    cost.cost_table(model, batch=2, tokens=8, **kwargs)
    assert (
        len(timing.layer_calls) == 3 and timing.model_calls == 3
    )  # the same name, other flags: measured anew
    keys = json.loads((tmp_path / cost.CACHE_FILE).read_text())
    machines = {tuple(key.split("|")[:2]) for key in keys}  # (name, flags digest)
    assert sorted(name for name, _ in machines) == ["Fake CPU A", "Fake CPU A", "Fake CPU B"]
    # the threads and rows are in the key too
    assert cost.machine_key(1, 2, 8) != cost.machine_key(2, 2, 8) != cost.machine_key(1, 2, 16)
    # one thread reads the thread's CPU clock, more threads the wall clock: never the same entries
    assert cost.machine_key(1, 2, 8).endswith("clock=cpu")
    assert cost.machine_key(2, 2, 8).endswith("clock=wall")


def test_prediction_is_the_remainder_plus_the_chosen_layers(tiny_bert, tmp_path):
    model = tiny_bert()
    timing = Counting()
    table = cost.cost_table(
        model,
        batch=2,
        tokens=8,
        cache_dir=tmp_path,
        measure_layers_fn=timing.layers,
        measure_models_fn=timing.models,
    )
    linear_fp32 = sum(table.latency_ms[s.key]["fp32"] for s in table.layers.values())
    assert table.remainder_ms == pytest.approx(5.0 - linear_fp32)
    assert table.predict({}) == pytest.approx(5.0)
    name = "bert.encoder.layer.0.attention.self.query"
    shape = table.layers[name]
    delta = table.latency_ms[shape.key]["int8"] - table.latency_ms[shape.key]["fp32"]
    assert table.predict({name: "int8"}) == pytest.approx(5.0 + delta)
    with pytest.raises(ConfigError, match="not a choice of this layer"):
        table.predict({name: "w50"})  # widths only for feed-forward pairs
    # bytes: an int8 weight is a quarter of the fp32 one, plus the fp32 bias and one scale/zero point
    elements = shape.in_features * shape.out_features
    assert table.model_bytes({name: "int8"}) == table.model_bytes({}) - 4 * elements + elements + 8
    assert table.model_bytes({}) == sum(4 * p.numel() for p in model.parameters())


def test_assignment_runs_each_layer_in_its_runtime(tiny_bert):
    model = tiny_bert(intermediate_size=64)
    names = list(cost.linear_layers(model))
    up, down = "bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.0.output.dense"
    assignment = {names[0]: "bf16", names[1]: "int8", names[2]: "mxint8", up: "w50", down: "w50"}
    changed = cost.apply_assignment(model, assignment)
    assert isinstance(changed.get_submodule(names[0]), cost.Bf16Linear)
    assert type(changed.get_submodule(names[1])).__name__ == "Linear"  # torch.ao's dynamic int8 Linear
    assert "quantized" in type(changed.get_submodule(names[1])).__module__
    assert type(changed.get_submodule(names[2])).__name__ == "QLinearPacked"
    assert changed.get_submodule(up).out_features == 32 and changed.get_submodule(down).in_features == 32
    assert isinstance(model.get_submodule(names[0]), nn.Linear)  # the original is untouched
    # the structured width computed by hand: the 32 neurons with the largest up-projection norms
    x = torch.randn(3, 5, 32)
    full_up, full_down = model.get_submodule(up), model.get_submodule(down)
    keep = torch.topk(full_up.weight.pow(2).sum(1) + full_up.bias.pow(2), 32).indices
    hidden = torch.nn.functional.gelu(full_up(x))[..., keep]
    expected = hidden @ full_down.weight[:, keep].T + full_down.bias
    got = changed.get_submodule(down)(torch.nn.functional.gelu(changed.get_submodule(up)(x)))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="one choice of the pair"):
        cost.apply_assignment(model, {up: "w50", down: "fp32"})


def test_measured_table_on_the_tiny_model(tiny_bert, tmp_path):
    model = tiny_bert(intermediate_size=64)
    table = cost.cost_table(model, batch=1, tokens=8, threads=1, cache_dir=tmp_path, rounds=2)
    assert set(table.latency_ms) == {s.key for s in table.layers.values()}
    for key, per_choice in table.latency_ms.items():
        assert all(ms > 0 for ms in per_choice.values()), key
    assert table.fp32_ms > 0 and table.predict({}) == pytest.approx(table.fp32_ms)


@pytest.mark.slow
def test_acc_latency_objective_prices_each_trial_as_it_deploys(search, tmp_path, cache_dir):
    from tests.helpers import load_study, ok

    ok(
        search(
            "search=mixed_precision",
            "model=tiny_random",
            "search/objective=acc_latency",
            "hydra.sweeper.n_trials=2",
            "callbacks.cost_model.batch=2",
            "callbacks.cost_model.tokens=16",
        )
    )
    study = load_study(tmp_path, "mixed_precision-integer-acc_latency-tpe")
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    table = json.loads((cache_dir / cost.CACHE_FILE).read_text())
    layer_ms = {
        key.split("|layer|")[1]: ms for key, ms in table.items() if "|layer|" in key and "b2xt16" in key
    }
    fp32_ms = next(v["fp32_ms"] for key, v in table.items() if "|model|" in key and "b2xt16" in key)
    for t in study.trials:
        metrics = t.user_attrs["metrics"]
        assert t.values[1] == metrics["cost/latency_ms"]
        # the prediction recomputed from the cached table: each integer layer of <= 8 bits priced at int8
        shapes = {"query": "32x32b", "key": "32x32b", "value": "32x32b", "attention.output.dense": "32x32b",
                  "intermediate.dense": "32x64bup", "output.dense": "64x32bdown", "pooler.dense": "32x32b",
                  "classifier": "32x2b"}  # fmt: skip
        expected = fp32_ms
        for param, value in t.params.items():
            layer, _, what = param.partition("/")
            if what != "format" or value != "integer":
                continue
            shape = next(s for suffix, s in shapes.items() if layer.endswith(suffix))
            choice = "int8" if t.params[f"{layer}/integer.width"] <= 8 else None
            if choice is not None:
                expected += layer_ms[shape][choice] - layer_ms[shape]["fp32"]
        assert metrics["cost/latency_ms"] == pytest.approx(expected)
