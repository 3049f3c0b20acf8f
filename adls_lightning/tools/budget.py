"""Per-layer choices under a latency or size budget: ``adls-budget ckpt=CKPT latency=RATIO [bytes=RATIO] [batch=8]
[threads=1] [tokens=128] [calibration=32] [out=DIR] [overwrite=false] [overrides]``; or a given assignment exported
and measured: ``adls-budget ckpt=CKPT assignment=deployed|FILE.json [out=DIR]``.

From a full-precision checkpoint (LoRA merged, as the export loads it) it

1. prices every linear layer of the model in each runtime choice measured on this machine (fp32, bf16, int8,
   MXINT8 packed, structured widths 75 % / 50 % of each feed-forward pair; the cost table of
   :mod:`adls_lightning.search.cost`, cached per CPU kind in ``paths.cache_dir``) at ``batch x tokens`` on
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
5. prints the assignment, the predicted and measured latency (ms, and the speed-up over fp32) and the metric, and writes them to
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

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adls_lightning.checkpoints import missing_checkpoint
from adls_lightning.errors import ConfigError
from adls_lightning.search.budget_run import DEPLOYED, RESULT_FILE, BudgetSettings
from adls_lightning.tools.options import (
    check_override_keys,
    check_writable,
    flag_option,
    run_tool,
    split_options,
)

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


def _positive_int(options: dict, key: str) -> int:
    value = options[key]
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or str(number) != str(value).strip():
        raise ConfigError(f"{key}={value}: must be a positive integer")
    return number


def check_options(options: dict[str, Any]) -> BudgetSettings:
    """Every option checked (one line naming the key) before anything is loaded."""
    if not options["ckpt"]:
        raise ConfigError(f"ckpt: required, a train.py checkpoint ({USAGE})")
    ckpt = Path(options["ckpt"])
    if not ckpt.is_file():
        raise missing_checkpoint(ckpt, "ckpt", "a train.py checkpoint")
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
    numbers = {
        key: _positive_int(options, key) for key in ("batch", "threads", "tokens", "calibration", "rounds")
    }
    overwrite = flag_option(options, "overwrite")
    default_name = f"{metric}{ratio:g}" if assignment is None else f"assignment-{Path(assignment).stem}"
    out = Path(options["out"]) if options["out"] else ckpt.parent.parent / "budget" / default_name
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: a file, not a folder (give a folder for the export and {RESULT_FILE})")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"out={out}: already holds files (give another out= or overwrite=true)")
    check_writable(out)
    return BudgetSettings(
        ckpt=ckpt,
        out=out,
        metric=metric,
        ratio=ratio,
        assignment=assignment,
        **numbers,
        tool_keys=tuple(OPTIONS),
    )


def print_result(result: dict[str, Any]) -> None:
    """The budget run's result as lines: the assignment by group, the latency predicted and measured, the
    weights' size and the metric."""
    counts: dict[str, int] = {}
    for choice in result["assignment"].values():
        counts[choice] = counts.get(choice, 0) + 1
    print("assignment (group: choice):")
    for group, choice in result["groups"].items():
        print(f"  {group}: {choice}")
    print(f"layers per choice: {', '.join(f'{c} {n}' for c, n in sorted(counts.items()))}")
    if result["unpriced_layers"]:
        print(
            f"{result['unpriced_layers']} quantized layers have no runtime here (their format): exported as fp32"
        )
    print(
        f"latency at batch {result['batch']} x {result['tokens']} tokens, {result['threads']} thread(s): predicted "
        f"{result['predicted_ms']:.2f} ms ({result['predicted_x_fp32']:.2f}x as fast as fp32), measured "
        f"{result['measured_ms']:.2f} ms ({result['measured_x_fp32']:.2f}x as fast as fp32, measured at "
        f"{result['measured_fp32_ms']:.2f} ms); prediction error {result['prediction_error_pct']:+.1f}%"
    )
    print(f"weights: {result['model_bytes'] / 1e6:.2f} MB of {result['fp32_model_bytes'] / 1e6:.2f} MB fp32")
    metric, out = result["metric"], result["export"]
    print(
        f"test/{metric}: {result[f'test/{metric}']:.4f} (fp32 {result[f'fp32_test/{metric}']:.4f}), the export "
        f"reloaded from {out}"
    )
    print(f"wrote {out} (adls-evaluate {out}; adls-predict {out} TEXT) and {Path(out) / RESULT_FILE}")


def budget_command(argv: Sequence[str]) -> None:
    """The command (for :func:`main`): every option checked, then the budget run, then its result printed."""
    from adls_lightning.search.budget_run import run_budget

    options, overrides = split_options(argv, OPTIONS, USAGE)
    check_override_keys(overrides, list(OPTIONS))
    settings = check_options(options)
    result = run_budget(settings, overrides, report=lambda line: print(line, flush=True))
    print_result(result)


def main(argv: Sequence[str] | None = None) -> int:
    """The console command ``adls-budget``."""
    from adls_lightning.logs import configure_tool

    argv = list(sys.argv[1:] if argv is None else argv)
    configure_tool()
    return run_tool(lambda: budget_command(argv), __doc__)


if __name__ == "__main__":
    sys.exit(main())
