"""A budget run, from a checkpoint to a measured export: the verbs behind ``adls-budget``
(:mod:`adls_lightning.tools.budget`, which parses the command line into :class:`BudgetSettings`, calls
:func:`run_budget` and prints the result it returns).

The steps, each a function: :func:`load_budget_model` (the fp32 model to convert, and the assignment given, if
any), :func:`run_data` (the run's validation and test splits), the cost table (:func:`adls_lightning.search.cost.
cost_table`), :func:`choose_assignment` (the given one checked, or the least-sensitive one within the budget:
:mod:`adls_lightning.search.budget`), :func:`export_and_measure` (the mixed export written, reloaded from the
folder alone, evaluated and timed beside the fp32 model), :func:`budget_result` (what ``budget.json`` holds).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adls_lightning.data.inputs import model_inputs
from adls_lightning.errors import ConfigError

DEPLOYED = "deployed"
RESULT_FILE = "budget.json"


@dataclass(frozen=True)
class BudgetSettings:
    """A budget run's settings (``adls-budget``'s options, checked)."""

    ckpt: Path
    #: the folder of the export and of :data:`RESULT_FILE`
    out: Path
    #: ``latency`` or ``bytes`` (a budget, :attr:`ratio` of the fp32 model's), or ``assignment``
    metric: str
    ratio: float = math.nan
    #: :data:`DEPLOYED` or a JSON file of ``{layer: choice}`` (None: chosen under the budget)
    assignment: str | None = None
    batch: int = 8
    threads: int = 1
    tokens: int = 128
    #: validation rows the sensitivities are measured on
    calibration: int = 32
    rounds: int = 7
    #: the calling tool's own keys, named when an override sets a key the run's config lacks
    tool_keys: tuple[str, ...] = ()


@dataclass
class BudgetModel:
    """The checkpoint's model as the budget converts it, and the assignment given with it."""

    loaded: Any  # adls_lightning.runs.loading.LoadedRun
    #: the fp32 model whose layers take the chosen formats
    model: Any
    #: ``{layer: choice}`` given (``assignment=``), None when the budget chooses
    given: dict[str, str] | None
    #: layers of a deployed assignment whose format has no runtime here (exported as fp32)
    unpriced: int = 0


@dataclass
class Measured:
    """The export reloaded from its folder, scored and timed beside the fp32 model."""

    fp32_metric: float
    chosen_metric: float
    #: median ms per batch: ``{"fp32": ..., "chosen": ...}``
    ms: dict[str, float]


def read_assignment(path: Path) -> dict[str, str]:
    """``{layer: choice}`` from a JSON file: a ``budget.json`` (its ``assignment``) or the mapping itself."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(
            f"assignment={path}: not a JSON file ({str(error).splitlines()[0][:200]})"
        ) from None
    if isinstance(data, dict) and isinstance(data.get("assignment"), dict):
        data = data["assignment"]
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ConfigError(f"assignment={path}: expected a JSON object of layer: choice (or a budget.json)")
    return dict(data)


def deployed_assignment(model) -> tuple[dict[str, str], int]:
    """Each linear layer's runtime choice as its (fake-quantized) format deploys, and how many have none (fp32)."""
    from adls_lightning.search import cost

    assignment, unpriced = {}, 0
    for name in cost.linear_layers(model):
        choice = cost.deployed_choice(model.get_submodule(name))
        unpriced += choice is None
        assignment[name] = choice or "fp32"
    return assignment, unpriced


def load_budget_model(settings: BudgetSettings, overrides: list[str]) -> BudgetModel:
    """The checkpoint's fp32 model (a deployed assignment: the weights under its fake quantization) and the
    assignment given. Raises ConfigError for a compressed run's checkpoint without ``assignment=deployed``."""
    from adls_lightning.runs.loading import load_checkpoint_model
    from adls_lightning.search import cost

    deployed = settings.assignment == DEPLOYED
    loaded = load_checkpoint_model(
        settings.ckpt, overrides, keep_quantized=deployed, options=list(settings.tool_keys)
    )
    if deployed:
        given, unpriced = deployed_assignment(loaded.model)
        return BudgetModel(loaded, cost.fp32_model(loaded.model).float().eval(), given, unpriced)
    if loaded.recipe.baked.get("quantized_layers") or loaded.recipe.baked.get("pruned_layers"):
        raise ConfigError(
            f"ckpt={settings.ckpt}: its run was compressed (quantized or pruned); adls-budget starts from a "
            f"full-precision checkpoint (or give assignment={DEPLOYED} to export its own formats)"
        )
    given = read_assignment(Path(settings.assignment)) if settings.assignment is not None else None
    return BudgetModel(loaded, loaded.model.float().eval(), given)


def run_data(cfg):
    """The run's data module, set up for its validation (calibration) and test (evaluation) splits."""
    from adls_lightning.build import build

    data = build(cfg.data, "data")
    data.setup("fit")
    data.setup("test")
    return data


def calibration_batches(data, rows: int) -> list[dict]:
    """Validation batches holding at least ``rows`` rows (the model's inputs only)."""
    batches, seen = [], 0
    for batch in data.val_dataloader():
        batches.append(model_inputs(batch))
        seen += int(batch["input_ids"].shape[0])
        if seen >= rows:
            break
    return batches


def choose_assignment(
    settings: BudgetSettings,
    budget_model: BudgetModel,
    table,
    groups: Mapping[str, list[str]],
    data,
    progress: Callable[[int, int], None] | None = None,
):
    """``({layer: choice}, solution)``: the given assignment checked against the table (solution None), or the
    one of least summed sensitivity within the budget. A budget no assignment meets is refused before the
    sensitivities are computed (scores do not matter to whether one exists)."""
    from adls_lightning.search import budget

    given = budget_model.given
    if given is not None:
        try:
            table.check(given)
        except ConfigError as error:
            raise ConfigError(f"assignment={settings.assignment}: {error}") from None
        return {name: given.get(name, "fp32") for name in table.layers}, None
    unscored = {g: dict.fromkeys(budget.group_choices(table, names), 0.0) for g, names in groups.items()}
    budget.budget_assignment(table, groups, unscored, settings.ratio, metric=settings.metric)
    calibration = calibration_batches(data, settings.calibration)
    losses = budget.sensitivities(budget_model.model, table, groups, calibration, progress)
    return budget.budget_assignment(table, groups, losses, settings.ratio, metric=settings.metric)


def evaluate_model(model, data) -> float:
    """The run's main metric of ``model`` on the test split."""
    import torch

    from adls_lightning.data.tasks import build_metric

    task = data.task
    metric = build_metric(task.main_metric, task.num_labels)
    with torch.inference_mode():
        for batch in data.test_dataloader():
            logits = model(**model_inputs(batch)).logits
            predicted = logits.squeeze(-1) if task.is_regression else logits.argmax(-1)
            metric.update(predicted, batch["labels"])
    return float(metric.compute())


def export_and_measure(
    settings: BudgetSettings, budget_model: BudgetModel, assignment: dict[str, str], data
) -> Measured:
    """The mixed export written to ``settings.out``; what is evaluated and timed is the model rebuilt from the
    folder alone, beside the fp32 model."""
    from adls_lightning.export.mixed import load_mixed
    from adls_lightning.export.mixed_save import save_mixed
    from adls_lightning.search import cost

    loaded = budget_model.loaded
    save_mixed(
        budget_model.model,
        assignment,
        settings.out,
        inputs=loaded.inputs,
        tokenizer=loaded.tokenizer,
        run_overrides=loaded.recipe.run_overrides,
        note=f"adls-budget ckpt={settings.ckpt}",
    )
    chosen = load_mixed(settings.out)
    fp32_metric = evaluate_model(budget_model.model, data)
    chosen_metric = evaluate_model(chosen, data)
    ms = cost.measure_models(
        {"fp32": budget_model.model, "chosen": chosen},
        settings.batch,
        settings.tokens,
        settings.threads,
        settings.rounds,
    )
    return Measured(fp32_metric, chosen_metric, ms)


def budget_result(
    settings: BudgetSettings,
    table,
    groups: Mapping[str, list[str]],
    assignment: dict[str, str],
    solution,
    unpriced: int,
    measured: Measured,
    main_metric: str,
) -> dict[str, Any]:
    """What :data:`RESULT_FILE` holds: the assignment, the predicted and measured latency, the metric."""
    from adls_lightning.search import cost

    predicted = table.predict(assignment)
    chosen_groups = (
        solution.choices
        if solution is not None
        else {g: "/".join(sorted({assignment[n] for n in names})) for g, names in groups.items()}
    )
    ms = measured.ms
    return {
        "ckpt": str(settings.ckpt),
        "budget": (
            {"metric": settings.metric, "ratio": settings.ratio}
            if solution is not None
            else {"assignment": str(settings.assignment)}
        ),
        "machine": table.machine,
        "batch": settings.batch,
        "tokens": settings.tokens,
        "threads": settings.threads,
        "groups": chosen_groups,
        "assignment": assignment,
        "sensitivity_sum": solution.loss if solution is not None else None,
        "unpriced_layers": unpriced,
        "predicted_ms": predicted,
        "predicted_x_fp32": table.fp32_predicted_ms / predicted,
        "measured_ms": ms["chosen"],
        "measured_fp32_ms": ms["fp32"],
        "measured_x_fp32": ms["fp32"] / ms["chosen"],
        "prediction_error_pct": 100 * (predicted - ms["chosen"]) / ms["chosen"],
        "model_bytes": table.model_bytes(assignment),
        "fp32_model_bytes": table.model_bytes({}),
        "bitops": table.bitops(assignment),
        "metric": main_metric,
        f"test/{main_metric}": measured.chosen_metric,
        f"fp32_test/{main_metric}": measured.fp32_metric,
        "export": str(settings.out),
        "runtime": "PyTorch eager (int8: torch's dynamic int8 linear; mxint8: QLinearPacked), reloaded from the export",
        "cost_table": cost.table_json(table),
    }


def run_budget(
    settings: BudgetSettings, overrides: list[str], report: Callable[[str], None] = print
) -> dict[str, Any]:
    """Load, price, choose, export, reload, evaluate, measure; :data:`RESULT_FILE` written in ``settings.out``
    and returned. ``report``: where the progress lines go (the cost table, the sensitivities scored)."""
    from adls_lightning.search import budget, cost

    budget_model = load_budget_model(settings, overrides)
    data = run_data(budget_model.loaded.config)
    cfg = budget_model.loaded.config

    def progress(done: int, total: int) -> None:
        if done == total or done % 20 == 0:
            report(f"sensitivity: {done}/{total} group choices scored")

    with cost.torch_threads(settings.threads):
        table = cost.cost_table(
            budget_model.model,
            settings.batch,
            settings.tokens,
            settings.threads,
            cfg.paths.cache_dir,
            rounds=settings.rounds,
        )
        report(cost.describe(table))
        groups = budget.layer_groups(table.layers)
        assignment, solution = choose_assignment(settings, budget_model, table, groups, data, progress)
        measured = export_and_measure(settings, budget_model, assignment, data)
    result = budget_result(
        settings, table, groups, assignment, solution, budget_model.unpriced, measured, data.task.main_metric
    )
    (settings.out / RESULT_FILE).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result
