"""Per-layer choices under a latency or size budget: ``adls-budget ckpt=CKPT latency=RATIO [bytes=RATIO] [batch=8]
[threads=1] [tokens=128] [calibration=32] [out=DIR] [overwrite=false] [overrides]``; or a given assignment exported
and measured: ``adls-budget ckpt=CKPT assignment=deployed|FILE.json [out=DIR]``.

From a full-precision checkpoint (LoRA merged, as the export loads it) it

1. prices every linear layer of the model in each runtime choice measured on this machine (fp32, bf16, int8,
   MXINT8 packed, structured widths 75 % / 50 % of each feed-forward pair; the cost table of
   :mod:`adls_lightning.search.cost`, cached per CPU model in ``paths.cache_dir``) at ``batch x tokens`` on
   ``threads`` threads;
2. scores each group's choices (query/key/value of one attention share one, and so do the two layers of a
   feed-forward pair) by how far the model's output distribution moves on ``calibration`` validation rows when
   only that group takes the choice (:func:`adls_lightning.search.budget.sensitivities`);
3. chooses the assignment of least summed score whose predicted latency is at most ``latency`` x the fp32 model's
   (or whose weight bytes are at most ``bytes`` x fp32's): a multiple-choice knapsack solved exactly by dynamic
   programming (:func:`adls_lightning.search.budget.solve`);
4. exports that model to ``out`` as a mixed folder, each layer's weights in its format
   (:mod:`adls_lightning.export.mixed`: ``config.json`` with the labels, the tokenizer, ``model.safetensors``,
   ``mixed_config.json`` and the recipe), reloads it from the folder alone, evaluates the run's main metric on
   its test split with the reloaded model (the fp32 model's beside it), and measures both models' latency at the
   batch and length asked (interleaved rounds, medians);
5. prints the assignment, the predicted and measured latency (ms and x fp32) and the metric, and writes them to
   ``budget.json`` in ``out`` (default ``<run>/budget/latency<RATIO>`` beside the checkpoint's run folder).
   ``adls-evaluate DIR`` and ``adls-predict DIR`` run the folder like any export.

``assignment=`` skips steps 2-3: ``deployed`` takes each layer's choice from a quantized run's checkpoint (the
runtime its format deploys as, :func:`adls_lightning.search.cost.deployed_choice`: a search trial's
``compressed.ckpt``; the fp32 weights under its fake quantization are the ones converted), ``FILE.json`` from a
file (a ``budget.json``'s ``assignment``, or ``{layer: choice}``); the Pareto page of an ``acc_latency`` study gives
each point this command.

The chosen model runs in PyTorch eager (torch's dynamic int8 linear for int8: the project's ``int8=scaled`` ONNX
export holds int8 and fp32 layers only, not a mix with bf16 or MXINT8 layers).

Bad input: one line naming the key, exit code 2, before anything is loaded; a budget that no assignment meets is
one line naming the cheapest assignment's ratio, exit code 2, nothing written; an assignment that names a layer
the model lacks or a choice the layer has no runtime for, one line naming it. ``--help``: this text.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adls_lightning.errors import ConfigError
from adls_lightning.tool_options import check_writable, flag_option, split_options

OPTIONS: dict[str, str | None] = {
    "ckpt": None,
    "latency": None,
    "bytes": None,
    "assignment": None,
    "batch": "8",
    "threads": "1",
    "tokens": "128",
    "calibration": "32",
    "rounds": "7",
    "out": None,
    "overwrite": "false",
}
USAGE = "adls-budget ckpt=CKPT latency=0.5 [batch=8 threads=1 tokens=128 out=DIR] (or assignment=deployed|FILE.json)"
DEPLOYED = "deployed"
RESULT_FILE = "budget.json"
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _positive_int(options: dict, key: str) -> int:
    value = options[key]
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or str(number) != str(value).strip():
        raise ConfigError(f"{key}={value}: must be a positive integer")
    return number


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """Every option checked (one line naming the key) before anything is loaded."""
    if not options["ckpt"]:
        raise ConfigError(f"ckpt: required, a train.py checkpoint ({USAGE})")
    ckpt = Path(options["ckpt"])
    if not ckpt.is_file():
        raise ConfigError(f"ckpt={ckpt}: no such file (give a train.py checkpoint)")
    given = [key for key in ("latency", "bytes", "assignment") if options[key] is not None]
    if len(given) != 1:
        raise ConfigError(
            f"latency= or bytes=: give exactly one budget, a ratio of the fp32 model, or assignment= ({USAGE})"
        )
    metric = given[0]
    assignment = options["assignment"]
    ratio = math.nan
    if assignment is not None:
        if assignment != DEPLOYED and not Path(assignment).is_file():
            raise ConfigError(
                f"assignment={assignment}: no such file; valid: {DEPLOYED} (the checkpoint's own formats) or a "
                "JSON file of {layer: choice} (or a budget.json)"
            )
    else:
        try:
            ratio = float(options[metric])
        except ValueError:
            ratio = math.nan
        if not (ratio > 0 and math.isfinite(ratio)):
            raise ConfigError(
                f"{metric}={options[metric]}: must be a ratio of the fp32 model above 0, e.g. 0.5"
            )
    checked = {
        "ckpt": ckpt,
        "metric": metric,
        "ratio": ratio,
        "assignment": assignment,
        **{
            key: _positive_int(options, key)
            for key in ("batch", "threads", "tokens", "calibration", "rounds")
        },
        "overwrite": flag_option(options, "overwrite"),
    }
    default_name = f"{metric}{ratio:g}" if assignment is None else f"assignment-{Path(assignment).stem}"
    out = Path(options["out"]) if options["out"] else ckpt.parent.parent / "budget" / default_name
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: a file, not a folder (give a folder for the export and {RESULT_FILE})")
    if out.exists() and any(out.iterdir()) and not checked["overwrite"]:
        raise ConfigError(f"out={out}: already holds files (give another out= or overwrite=true)")
    check_writable(out)
    checked["out"] = out
    return checked


def main(argv: Sequence[str] | None = None) -> int:
    """The console command ``adls-budget`` (and ``python -m adls_lightning.search.budget_tool``)."""
    from adls_lightning.logs import configure_tool
    from adls_lightning.tool_options import run_tool

    argv = list(sys.argv[1:] if argv is None else argv)
    configure_tool()
    return run_tool(lambda: budget_command(argv), __doc__)


def _inputs(batch: dict) -> dict:
    return {key: batch[key] for key in MODEL_INPUTS if key in batch}


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


def budget_command(argv: Sequence[str]) -> None:
    """The command (for :func:`main`): check, load, price, choose, export, reload, evaluate, measure, write."""
    options, overrides = split_options(argv, OPTIONS, USAGE)
    opts = check_options(options)

    import torch

    from adls_lightning.build import build
    from adls_lightning.data.tasks import build_metric
    from adls_lightning.export.mixed import load_mixed
    from adls_lightning.export.mixed_save import save_mixed
    from adls_lightning.run_loading import load_checkpoint_model
    from adls_lightning.search import budget, cost

    deployed = opts["assignment"] == DEPLOYED
    loaded = load_checkpoint_model(opts["ckpt"], overrides, keep_quantized=deployed, options=list(OPTIONS))
    unpriced = 0
    given: dict[str, str] | None = None
    if deployed:
        given, unpriced = deployed_assignment(loaded.model)
        model = cost.fp32_model(loaded.model).float().eval()
    else:
        if loaded.recipe.baked.get("quantized_layers") or loaded.recipe.baked.get("pruned_layers"):
            raise ConfigError(
                f"ckpt={opts['ckpt']}: its run was compressed (quantized or pruned); adls-budget starts from a "
                f"full-precision checkpoint (or give assignment={DEPLOYED} to export its own formats)"
            )
        model = loaded.model.float().eval()
        if opts["assignment"] is not None:
            given = read_assignment(Path(opts["assignment"]))
    cfg = loaded.config
    data = build(cfg.data, "data")
    task = data.task
    data.setup("fit")
    data.setup("test")

    with cost.torch_threads(opts["threads"]):
        table = cost.cost_table(
            model, opts["batch"], opts["tokens"], opts["threads"], cfg.paths.cache_dir, rounds=opts["rounds"]
        )
        print(cost.describe(table), flush=True)
        groups = budget.layer_groups(table.layers)
        solution = None
        if given is not None:
            try:
                table.check(given)
            except ConfigError as error:
                raise ConfigError(f"assignment={opts['assignment']}: {error}") from None
            assignment = {name: given.get(name, "fp32") for name in table.layers}
        else:
            # a budget no assignment meets is refused before the sensitivities are computed (scores do not matter)
            unscored = {
                g: dict.fromkeys(budget.group_choices(table, names), 0.0) for g, names in groups.items()
            }
            budget.budget_assignment(table, groups, unscored, opts["ratio"], metric=opts["metric"])
            calibration, rows = [], 0
            for batch in data.val_dataloader():
                calibration.append(_inputs(batch))
                rows += int(batch["input_ids"].shape[0])
                if rows >= opts["calibration"]:
                    break

            def progress(done: int, total: int) -> None:
                if done == total or done % 20 == 0:
                    print(f"sensitivity: {done}/{total} group choices scored", flush=True)

            losses = budget.sensitivities(model, table, groups, calibration, progress)
            assignment, solution = budget.budget_assignment(
                table, groups, losses, opts["ratio"], metric=opts["metric"]
            )
        out = opts["out"]
        # the export first: what is evaluated and timed is the model rebuilt from the folder alone
        save_mixed(
            model,
            assignment,
            out,
            inputs=loaded.inputs,
            tokenizer=loaded.tokenizer,
            run_overrides=loaded.recipe.run_overrides,
            note=f"adls-budget ckpt={opts['ckpt']}",
        )
        chosen = load_mixed(out)

        @torch.inference_mode()
        def evaluate(candidate) -> float:
            metric = build_metric(task.main_metric, task.num_labels)
            for batch in data.test_dataloader():
                logits = candidate(**_inputs(batch)).logits
                predicted = logits.squeeze(-1) if task.is_regression else logits.argmax(-1)
                metric.update(predicted, batch["labels"])
            return float(metric.compute())

        fp32_metric = evaluate(model)
        chosen_metric = evaluate(chosen)
        measured = cost.measure_models(
            {"fp32": model, "chosen": chosen}, opts["batch"], opts["tokens"], opts["threads"], opts["rounds"]
        )
    predicted = table.predict(assignment)
    fp32_predicted = table.fp32_predicted_ms
    chosen_groups = (
        solution.choices
        if solution is not None
        else {g: "/".join(sorted({assignment[n] for n in names})) for g, names in groups.items()}
    )
    result = {
        "ckpt": str(opts["ckpt"]),
        "budget": (
            {"metric": opts["metric"], "ratio": opts["ratio"]}
            if solution is not None
            else {"assignment": str(opts["assignment"])}
        ),
        "machine": table.machine,
        "batch": opts["batch"],
        "tokens": opts["tokens"],
        "threads": opts["threads"],
        "groups": chosen_groups,
        "assignment": assignment,
        "sensitivity_sum": solution.loss if solution is not None else None,
        "unpriced_layers": unpriced,
        "predicted_ms": predicted,
        "predicted_x_fp32": fp32_predicted / predicted,
        "measured_ms": measured["chosen"],
        "measured_fp32_ms": measured["fp32"],
        "measured_x_fp32": measured["fp32"] / measured["chosen"],
        "prediction_error_pct": 100 * (predicted - measured["chosen"]) / measured["chosen"],
        "model_bytes": table.model_bytes(assignment),
        "fp32_model_bytes": table.model_bytes({}),
        "bitops": table.bitops(assignment),
        "metric": task.main_metric,
        f"test/{task.main_metric}": chosen_metric,
        f"fp32_test/{task.main_metric}": fp32_metric,
        "export": str(out),
        "runtime": "PyTorch eager (int8: torch's dynamic int8 linear; mxint8: QLinearPacked), reloaded from the export",
        "cost_table": cost.table_json(table),
    }
    counts: dict[str, int] = {}
    for choice in assignment.values():
        counts[choice] = counts.get(choice, 0) + 1
    print("assignment (group: choice):")
    for group, choice in chosen_groups.items():
        print(f"  {group}: {choice}")
    print(f"layers per choice: {', '.join(f'{c} {n}' for c, n in sorted(counts.items()))}")
    if unpriced:
        print(f"{unpriced} quantized layers have no runtime here (their format): exported as fp32")
    print(
        f"latency at batch {opts['batch']} x {opts['tokens']} tokens, {opts['threads']} thread(s): predicted "
        f"{predicted:.2f} ms ({result['predicted_x_fp32']:.2f}x fp32), measured {measured['chosen']:.2f} ms "
        f"({result['measured_x_fp32']:.2f}x fp32 measured at {measured['fp32']:.2f} ms); prediction error "
        f"{result['prediction_error_pct']:+.1f}%"
    )
    print(f"weights: {result['model_bytes'] / 1e6:.2f} MB of {result['fp32_model_bytes'] / 1e6:.2f} MB fp32")
    print(
        f"test/{task.main_metric}: {chosen_metric:.4f} (fp32 {fp32_metric:.4f}), the export reloaded from {out}"
    )
    (out / RESULT_FILE).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out} (adls-evaluate {out}; adls-predict {out} TEXT) and {out / RESULT_FILE}")


if __name__ == "__main__":
    sys.exit(main())
