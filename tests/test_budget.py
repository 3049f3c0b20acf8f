"""The budgeted solver (adls_lightning.search.budget): the dynamic programme against brute force, the groups that
share a choice, and a budget no assignment meets."""

from __future__ import annotations

import random

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
