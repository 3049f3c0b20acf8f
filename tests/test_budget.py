"""The budgeted solver (adls_lightning.search.budget): the dynamic programme against brute force, the groups that
share a choice, and a budget no assignment meets."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from adls_lightning.errors import ConfigError
from adls_lightning.search import budget
from adls_lightning.search.budget import Option, brute_force, solve
from adls_lightning.search.cost import CostTable, LayerShape


def random_problem(seed: int, layers: int = 6, integer_costs: bool = True) -> dict[str, list[Option]]:
    rng = random.Random(seed)
    groups = {}
    for i in range(layers):
        count = rng.randint(2, 4)
        groups[f"layer{i}"] = [
            Option(
                f"c{j}",
                float(rng.randint(1, 20)) if integer_costs else rng.uniform(0.5, 20.0),
                rng.uniform(0.0, 1.0) if j else 0.0,
            )
            for j in range(count)
        ]
    return groups


@pytest.mark.parametrize("seed", range(12))
def test_solver_matches_brute_force_on_six_layers(seed):
    groups = random_problem(seed)
    least = sum(min(o.cost for o in g) for g in groups.values())
    most = sum(max(o.cost for o in g) for g in groups.values())
    for budget_value in (least, (least + most) / 2, least + 3, most):
        expected = brute_force(groups, budget_value)
        # integer costs and a step of 1/8: the discretisation is exact, so the optimum must be found
        got = solve(groups, budget_value, resolution=int(budget_value * 8))
        assert got.cost <= budget_value
        assert got.loss == pytest.approx(expected.loss)
        assert got.cost == pytest.approx(
            sum(next(o.cost for o in groups[g] if o.choice == c) for g, c in got.choices.items())
        )


@pytest.mark.parametrize("seed", range(6))
def test_solver_with_real_valued_costs_is_feasible_and_near_optimal(seed):
    groups = random_problem(seed, integer_costs=False)
    least = sum(min(o.cost for o in g) for g in groups.values())
    most = sum(max(o.cost for o in g) for g in groups.values())
    budget_value = (least + most) / 2
    got = solve(groups, budget_value, resolution=4000)
    assert got.cost <= budget_value
    # rounding up by at most one step per layer: never worse than the optimum of a budget 6 steps smaller
    tighter = brute_force(groups, budget_value - 6 * budget_value / 4000)
    assert got.loss <= tighter.loss + 1e-9
    assert got.loss >= brute_force(groups, budget_value).loss - 1e-9


def test_budget_below_the_cheapest_assignment_is_refused():
    groups = random_problem(0)
    least = sum(min(o.cost for o in g) for g in groups.values())
    with pytest.raises(ConfigError, match="no assignment meets it"):
        solve(groups, least * 0.99)


def test_query_key_value_share_one_group_and_ffn_pairs_another():
    names = [
        "bert.encoder.layer.0.attention.self.query",
        "bert.encoder.layer.0.attention.self.key",
        "bert.encoder.layer.0.attention.self.value",
        "bert.encoder.layer.0.attention.output.dense",
        "bert.encoder.layer.0.intermediate.dense",
        "bert.encoder.layer.0.output.dense",
        "classifier",
    ]
    assert budget.layer_groups(names) == {
        "bert.encoder.layer.0.attention.self.qkv": names[:3],
        "bert.encoder.layer.0.attention.output.dense": [names[3]],
        "bert.encoder.layer.0.ffn": names[4:6],
        "classifier": ["classifier"],
    }


def toy_table() -> CostTable:
    layers = {
        "a.attention.self.query": LayerShape(64, 64),
        "a.attention.self.key": LayerShape(64, 64),
        "a.attention.self.value": LayerShape(64, 64),
        "a.intermediate.dense": LayerShape(64, 128, role="up"),
        "a.output.dense": LayerShape(128, 64, role="down"),
        "classifier": LayerShape(64, 2),
    }
    ms = {
        "64x64b": {"fp32": 1.0, "bf16": 0.7, "int8": 0.5, "mxint8": 1.2},
        "64x128bup": {"fp32": 2.0, "bf16": 1.4, "int8": 1.0, "mxint8": 2.4, "w75": 1.5, "w50": 1.0},
        "128x64bdown": {"fp32": 2.0, "bf16": 1.4, "int8": 1.0, "mxint8": 2.4, "w75": 1.5, "w50": 1.0},
        "64x2b": {"fp32": 0.1, "bf16": 0.1, "int8": 0.1, "mxint8": 0.1},
    }
    return CostTable(
        layers,
        ms,
        remainder_ms=3.0,
        fp32_ms=10.1,
        base_bytes=1000,
        batch=8,
        tokens=128,
        threads=1,
        machine="toy",
    )


def test_budget_assignment_respects_the_groups_and_the_ratio():
    table = toy_table()
    groups = budget.layer_groups(table.layers)
    losses = {
        g: {
            c: {"fp32": 0, "bf16": 0.01, "int8": 0.1, "mxint8": 0.05, "w75": 0.2, "w50": 0.5}[c]
            for c in budget.group_choices(table, layers)
        }
        for g, layers in groups.items()
    }
    assignment, solution = budget.budget_assignment(table, groups, losses, ratio=0.8)
    assert table.predict(assignment) <= 0.8 * table.fp32_predicted_ms + 1e-9
    qkv = {assignment[n] for n in groups["a.attention.self.qkv"]}
    assert len(qkv) == 1
    assert assignment["a.intermediate.dense"] == assignment["a.output.dense"]
    # the linear layers' budget: 0.8 x 10.1 ms - the 3.0 ms remainder
    expected = brute_force(budget.options(table, groups, losses), 0.8 * 10.1 - 3.0)
    assert solution.loss == pytest.approx(expected.loss)


def test_budget_ratio_no_assignment_meets_is_one_line_naming_the_least():
    table = toy_table()
    groups = budget.layer_groups(table.layers)
    losses = {g: dict.fromkeys(budget.group_choices(table, layers), 0.0) for g, layers in groups.items()}
    # cheapest: remainder 3 + qkv 1.5 + ffn (w50) 2.0 + classifier 0.1 = 6.6 of 10.1 -> 0.653
    with pytest.raises(ConfigError) as error:
        budget.budget_assignment(table, groups, losses, ratio=0.5)
    message = str(error.value)
    assert "\n" not in message and "latency=0.5" in message and "6.6 ms" in message and "0.66" in message


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory, tiny_imdb_dir, cache_dir):
    import torch

    from tests.helpers import SHORT_RUN, train_run

    out = tmp_path_factory.mktemp("budget_run")
    train_run(out, [*SHORT_RUN, "model=tiny_random", "model/lora=none"], tiny_imdb_dir, cache_dir)
    ckpt = next((out / "checkpoints").glob("best-*.ckpt"))
    assert torch.load(ckpt, weights_only=False)["state_dict"]
    return ckpt


def test_command_chooses_within_the_budget_and_writes_what_it_measured(float_ckpt, tmp_path):
    import json

    from adls_lightning.search.cost import CostTable, layer_bytes
    from adls_lightning.tools.budget import main
    from tests.helpers import call

    out = tmp_path / "b"
    # a size budget: on the tiny model at 2 x 16 tokens every layer's time is call overhead, so no latency budget
    # below fp32's is reachable there (that refusal is tested below); its 30522-word embedding is 98.7 % of its bytes
    code, stdout, stderr = call(
        main,
        f"ckpt={float_ckpt}",
        "bytes=0.995",
        "batch=2",
        "tokens=16",
        "rounds=3",
        "calibration=8",
        f"out={out}",
    )
    assert code == 0, stderr
    result = json.loads((out / "budget.json").read_text())
    table = result["cost_table"]
    assignment = result["assignment"]
    layers = {n: _shape_of(n, table["latency_ms"]) for n in assignment}
    rebuilt = CostTable(
        layers=layers,
        latency_ms=table["latency_ms"],
        remainder_ms=table["remainder_ms"],
        fp32_ms=table["fp32_ms"],
        base_bytes=0,
        batch=2,
        tokens=16,
        threads=1,
        machine=table["machine"],
    )
    # the prediction recomputed from the written table: the remainder plus each chosen layer's latency
    assert rebuilt.predict(assignment) == pytest.approx(result["predicted_ms"])
    # the bytes: the fp32 model's, less what each chosen layer saves, within the budget
    saved = sum(layer_bytes(layers[n], "fp32") - layer_bytes(layers[n], c) for n, c in assignment.items())
    assert result["model_bytes"] == result["fp32_model_bytes"] - saved <= 0.995 * result["fp32_model_bytes"]
    assert set(assignment.values()) != {"fp32"}
    for block in (0, 1):  # Q, K and V of one attention share their choice
        qkv = {
            assignment[f"bert.encoder.layer.{block}.attention.self.{p}"] for p in ("query", "key", "value")
        }
        assert len(qkv) == 1
    assert 0.0 <= result["test/acc"] <= 1.0 and result["measured_ms"] > 0
    assert f"{result['predicted_ms']:.2f} ms" in stdout and "wrote" in stdout
    # out= is an export folder: adls-evaluate scores it from the folder alone as the command scored it
    from adls_lightning.tools.evaluate import main as evaluate_main

    code, evaluated, stderr = call(evaluate_main, str(out))
    assert code == 0, stderr
    assert f"test/acc {result['test/acc']:.4f}" in evaluated, evaluated
    # and the same assignment given back (assignment=budget.json) exports the same model
    again = tmp_path / "again"
    code, stdout, stderr = call(
        main, f"ckpt={float_ckpt}", f"assignment={out / 'budget.json'}", "batch=2", "tokens=16", "rounds=3",
        f"out={again}",
    )  # fmt: skip
    assert code == 0, stderr
    repeated = json.loads((again / "budget.json").read_text())
    assert repeated["assignment"] == assignment and repeated["predicted_ms"] == pytest.approx(
        result["predicted_ms"]
    )
    assert repeated["test/acc"] == pytest.approx(result["test/acc"])
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def _shape_of(name: str, latency_ms: dict) -> LayerShape:
    from adls_lightning.search.cost import layer_role

    role = layer_role(name)
    width = {"up": ("32", "64"), "down": ("64", "32")}.get(
        role, ("32", "2" if name == "classifier" else "32")
    )
    key = f"{width[0]}x{width[1]}b{role}"
    assert key in latency_ms, (key, list(latency_ms))
    return LayerShape(int(width[0]), int(width[1]), True, role)


def test_command_refuses_a_budget_no_assignment_meets_in_one_line(float_ckpt, tmp_path):
    from adls_lightning.tools.budget import main
    from tests.helpers import call

    out = tmp_path / "b"
    code, stdout, stderr = call(
        main, f"ckpt={float_ckpt}", "latency=0.05", "batch=2", "tokens=16", f"out={out}"
    )
    assert code == 2
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith("error: latency=0.05: no assignment meets 0.05 of fp32's latency"), stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), "error: ckpt: required"),
        (
            ("ckpt=nowhere.ckpt", "latency=0.5"),
            "error: ckpt=nowhere.ckpt: no such checkpoint file (give a train.py checkpoint)",
        ),
        (("latency=-1",), "error: latency=-1: must be a ratio"),
        (("latency=0.5", "bytes=0.5"), "error: latency= or bytes=: give exactly one budget"),
        (("latency=0.5", "batch=0"), "error: batch=0: must be a positive integer"),
        (("latency=0.5", "out=OUT_FILE"), "error: out="),
        (("assignment=nowhere.json",), "error: assignment=nowhere.json: no such file; valid: deployed"),
        (("assignment=deployed", "latency=0.5"), "error: latency= or bytes=: give exactly one budget"),
    ],
)
def test_command_refuses_bad_options_in_one_line(float_ckpt, tmp_path, args, expected):
    from adls_lightning.tools.budget import main
    from tests.helpers import call

    (tmp_path / "a_file").write_text("kept")
    args = tuple(a.replace("OUT_FILE", str(tmp_path / "a_file")) for a in args)

    args = args if any(a.startswith("ckpt=") for a in args) or not args else (f"ckpt={float_ckpt}", *args)
    code, _, stderr = call(main, *args)
    assert code == 2 and stderr.strip().splitlines()[-1].startswith(expected), stderr


@pytest.mark.slow
def test_a_trials_export_command_exports_the_trial_as_it_deploys(search, tmp_path, cache_dir):
    """The Pareto page's command for a search trial (adls-budget assignment=deployed): the trial's own formats,
    each layer in its runtime: scaled_integer 8 -> int8, mxint8 -> mxint8, fp32 -> fp32."""
    import json

    from adls_lightning.export.mixed import MIXED_CONFIG_FILE
    from adls_lightning.reports.study import export_command
    from adls_lightning.tools.budget import main
    from tests.helpers import call, load_study, ok

    ok(
        search(
            "search=mixed_precision",
            "model=tiny_random",
            "search/objective=acc_latency",
            "hydra.sweeper.n_trials=1",
            "train=false",
            "quant.mode=ptq",
            "quant.calibration.batches=1",
            "hydra.sweeper.search_space.use=[fp32,scaled_integer,mxint8]",
            "hydra.sweeper.search_space.formats={fp32:{},scaled_integer:{params:{width:[8]}},mxint8:{}}",
            "search.name=deployed",
            "callbacks.cost_model.batch=2",
            "callbacks.cost_model.tokens=16",
        )
    )
    study = load_study(tmp_path, "deployed-acc_latency-tpe")
    trial = study.trials[0]
    command = export_command(Path(trial.user_attrs["output_dir"]))
    args = command.split()[1:]
    assert args[1:] == ["assignment=deployed", "batch=2", "tokens=16", "threads=1", args[-1]]
    code, stdout, stderr = call(main, *args, "rounds=2")
    assert code == 0, stderr
    out = Path(args[-1].removeprefix("out="))
    layers = json.loads((out / MIXED_CONFIG_FILE).read_text())["layers"]
    runtime = {"fp32": "fp32", "scaled_integer": "int8", "mxint8": "mxint8"}
    expected = {
        param.removesuffix("/format"): runtime[value]
        for param, value in trial.params.items()
        if param.endswith("/format")
    }
    assert {name: spec["choice"] for name, spec in layers.items()} == expected
    result = json.loads((out / "budget.json").read_text())
    # priced as the trial priced it (the same cost table, the same assignment)
    assert result["predicted_ms"] == pytest.approx(trial.values[1])
