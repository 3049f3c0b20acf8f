"""The budgeted solver: the best per-layer assignment of runtime choices under a latency or size budget.

Each *group* of layers takes one choice together (:func:`layer_groups`: the query, key and value of one attention
-- one input, three products, which an export fuses or quantizes alike -- and the two layers of a feed-forward
pair, whose structured width is one neuron set; every other layer alone). A group's option has a cost (the sum of
its layers' latencies, or bytes, from the :class:`~adls_lightning.search.cost.CostTable`) and a loss (its
sensitivity: how much the model's output moves when only that group takes the choice, :func:`sensitivities`).
Losses are taken as additive over groups, as AutoQuantize and HAWQ take them.

Minimising the summed loss with the summed cost within the budget is a multiple-choice knapsack. :func:`solve`
solves it by dynamic programming over the cost discretised into ``resolution`` steps of ``budget / resolution``:
each option's cost is rounded *up* to whole steps, so every answer meets the true budget, and the answer is the
exact optimum of the discretised problem (the true optimum can only be missed by an assignment within
``groups x step`` of the budget). Why not an ILP: the problem has one constraint and a few dozen groups of at most
six options, so the DP is exact, has no solver dependency and runs in milliseconds (``groups x options x
resolution``); an ILP solver would add a dependency for the same answer.

Library code: no Lightning imports.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.search.cost import (
    WIDTHS,
    CostTable,
    apply_assignment,
    ffn_pairs,
    layer_bytes,
)

#: a block's attention projections that share a choice
_QKV = re.compile(r"^(.*attention\.self\.)(query|key|value)$")
RESOLUTION = 2000


@dataclass(frozen=True)
class Option:
    """One choice of a group: its cost (ms or bytes, the group's layers summed) and its loss (sensitivity)."""

    choice: str
    cost: float
    loss: float


@dataclass(frozen=True)
class Solution:
    choices: dict[str, str]  # group -> choice
    cost: float
    loss: float


def layer_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Layers that must share a choice, by group name, in model order: ``<block>.attention.self.qkv`` for the query,
    key and value of one attention, ``<block>.ffn`` for a feed-forward pair, each other layer its own group."""
    names = list(names)
    pairs = {up: prefix + "ffn" for prefix, (up, down) in ffn_pairs(names).items()}
    pairs.update({down: prefix + "ffn" for prefix, (up, down) in ffn_pairs(names).items()})
    groups: dict[str, list[str]] = {}
    for name in names:
        match = _QKV.match(name)
        group = match.group(1) + "qkv" if match else pairs.get(name, name)
        groups.setdefault(group, []).append(name)
    return groups


def group_choices(table: CostTable, layers: Sequence[str]) -> tuple[str, ...]:
    """The choices every layer of a group has (structured widths only for a whole feed-forward pair)."""
    common = [c for c in table.choices(layers[0]) if all(c in table.choices(n) for n in layers)]
    if len(layers) != 2 or not all(table.layers[n].role for n in layers):
        common = [c for c in common if c not in WIDTHS]
    return tuple(common)


def solve(groups: Mapping[str, Sequence[Option]], budget: float, resolution: int = RESOLUTION) -> Solution:
    """The options (one per group) of least summed loss whose summed cost is within ``budget``: a multiple-choice
    knapsack by dynamic programming over the cost in ``resolution`` steps (costs rounded up; see the module).

    Raises:
        ConfigError: no assignment meets the budget, naming the least cost any assignment has.
    """
    names = list(groups)
    least = sum(min(o.cost for o in groups[g]) for g in names)
    if not budget > 0 or least > budget:
        raise ConfigError(
            f"budget {budget:.4g}: no assignment meets it; the cheapest costs {least:.4g} "
            "(give a larger budget)"
        )
    step = budget / resolution
    size = resolution + 1
    best = np.full(size, np.inf)  # best[c]: least loss of the groups so far at discretised cost exactly c
    best[0] = 0.0
    picks = np.zeros((len(names), size), dtype=np.int16)
    for gi, name in enumerate(names):
        new = np.full(size, np.inf)
        for oi, option in enumerate(groups[name]):
            units = math.ceil(option.cost / step - 1e-9) if option.cost > 0 else 0
            if units >= size:
                continue
            shifted = np.full(size, np.inf)
            shifted[units:] = best[: size - units] + option.loss
            better = shifted < new
            new[better] = shifted[better]
            picks[gi][better] = oi
        best = new
    if not np.isfinite(best).any():  # the rounding up took the last feasible assignments
        raise ConfigError(
            f"budget {budget:.4g}: no assignment meets it at this resolution; the cheapest costs {least:.4g} "
            "(give a larger budget)"
        )
    end = int(np.argmin(best))
    chosen: dict[str, str] = {}
    cost = loss = 0.0
    for gi in range(len(names) - 1, -1, -1):
        option = groups[names[gi]][picks[gi][end]]
        chosen[names[gi]] = option.choice
        cost += option.cost
        loss += option.loss
        end -= math.ceil(option.cost / step - 1e-9) if option.cost > 0 else 0
    return Solution({n: chosen[n] for n in names}, cost, loss)


def brute_force(groups: Mapping[str, Sequence[Option]], budget: float) -> Solution | None:
    """Every combination tried: the reference :func:`solve` is tested against (tiny problems only)."""
    names = list(groups)
    best = None
    for combo in itertools.product(*(groups[n] for n in names)):
        cost = sum(o.cost for o in combo)
        loss = sum(o.loss for o in combo)
        if cost <= budget and (best is None or loss < best.loss):
            best = Solution({n: o.choice for n, o in zip(names, combo, strict=True)}, cost, loss)
    return best


def kl_to_reference(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean KL(softmax(reference) || softmax(logits)) over rows; squared error for one output (a regression)."""
    if reference.shape[-1] == 1:
        return float((reference - logits).pow(2).mean())
    p = torch.log_softmax(reference.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@torch.inference_mode()
def sensitivities(
    model: nn.Module,
    table: CostTable,
    groups: Mapping[str, Sequence[str]],
    batches: Sequence[Mapping[str, torch.Tensor]],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Each group's loss per choice: the mean KL divergence of the model's output distribution from the fp32
    model's on ``batches`` when only that group takes the choice (the same proxy for precision and width; 0 for
    fp32). One forward per group and choice, through the choice's real runtime module."""
    reference = [model(**batch).logits for batch in batches]
    scores: dict[str, dict[str, float]] = {}
    total = sum(len(group_choices(table, layers)) - 1 for layers in groups.values())
    done = 0
    for group, layers in groups.items():
        scores[group] = {"fp32": 0.0}
        for choice in group_choices(table, layers):
            if choice == "fp32":
                continue
            changed = apply_assignment(model, dict.fromkeys(layers, choice))
            kl = [kl_to_reference(r, changed(**b).logits) for r, b in zip(reference, batches, strict=True)]
            scores[group][choice] = max(0.0, sum(kl) / len(kl))
            done += 1
            if progress is not None:
                progress(done, total)
    return scores


def options(
    table: CostTable,
    groups: Mapping[str, Sequence[str]],
    losses: Mapping[str, Mapping[str, float]],
    metric: str = "latency",
) -> dict[str, list[Option]]:
    """Each group's options priced by ``metric`` (``latency``: ms, ``bytes``: weight bytes)."""
    priced: dict[str, list[Option]] = {}
    for group, layers in groups.items():
        priced[group] = []
        for choice in group_choices(table, layers):
            if metric == "latency":
                cost = sum(table.layer_ms(n, choice) for n in layers)
            else:
                cost = float(sum(layer_bytes(table.layers[n], choice) for n in layers))
            priced[group].append(Option(choice, cost, float(losses[group][choice])))
    return priced


def assignment_of(groups: Mapping[str, Sequence[str]], chosen: Mapping[str, str]) -> dict[str, str]:
    """Per layer: its group's choice."""
    return {layer: chosen[group] for group, layers in groups.items() for layer in layers}


def budget_assignment(
    table: CostTable,
    groups: Mapping[str, Sequence[str]],
    losses: Mapping[str, Mapping[str, float]],
    ratio: float,
    metric: str = "latency",
    resolution: int = RESOLUTION,
) -> tuple[dict[str, str], Solution]:
    """The per-layer assignment of least loss whose predicted latency (or model bytes) is at most ``ratio`` x the
    fp32 model's: the budget left for the linear layers is ``ratio x fp32 - remainder`` (latency) or ``ratio x
    fp32 bytes - the other parameters' bytes``.

    Raises:
        ConfigError: no assignment meets it (one line: the budget asked and the least any assignment reaches).
    """
    if metric == "latency":
        fixed, whole = table.remainder_ms, table.fp32_predicted_ms
        unit = "ms"
    elif metric == "bytes":
        fixed, whole = float(table.base_bytes), float(table.model_bytes({}))
        unit = "bytes"
    else:
        raise ConfigError(f"metric={metric!r}: must be latency or bytes")
    priced = options(table, groups, losses, metric)
    budget = ratio * whole - fixed
    least = fixed + sum(min(o.cost for o in group) for group in priced.values())
    if budget <= 0 or least > ratio * whole:
        raise ConfigError(
            f"{metric}={ratio:g}: no assignment meets {ratio:g} of fp32's {metric} ({ratio * whole:.4g} {unit}); "
            f"the cheapest predicted is {least:.4g} {unit} = {least / whole:.3f} of fp32's (give {metric}= at least "
            f"{math.ceil(least / whole * 100) / 100:g})"
        )
    solution = solve(priced, budget, resolution)
    return assignment_of(groups, solution.choices), solution


__all__ = [
    "Option",
    "Solution",
    "brute_force",
    "budget_assignment",
    "group_choices",
    "layer_groups",
    "options",
    "sensitivities",
    "solve",
]
