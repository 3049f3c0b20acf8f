"""The budgeted solver against an NSGA-II search over the same per-layer space, with 5x its evaluations.

Both start from one fine-tuned full-precision checkpoint (``--ckpt``, loaded as ``adls-budget`` and the export load
it: LoRA merged) and search the same space: each group of linear layers (query/key/value of one attention, a
feed-forward pair, each other layer; :func:`adls_lightning.search.budget.layer_groups`) takes one runtime choice
(fp32, bf16, int8, MXINT8 packed; structured widths 75 % / 50 % for a feed-forward pair), applied after training
(PTQ). Both price a candidate with the same cost table (:mod:`adls_lightning.search.cost`, cached per CPU in
``--cache-dir``) and score it the same way: accuracy on the same held rows (the first ``--rows`` reviews of the
run's test split).

* **Solver** (``adls-budget``'s steps): sensitivities on ``--calibration`` validation rows (one forward per group and
  choice), the multiple-choice knapsack under ``--latency`` x the fp32 model's predicted latency, then the chosen
  assignment evaluated once on the held rows.
* **NSGA-II** (Optuna's ``NSGAIISampler``, the sampler of ``hydra/sweeper/sampler=nsgaii``; objectives accuracy (max)
  and predicted latency (min), the budget given as a constraint): ``--multiplier`` x the solver's evaluations, where
  the solver's evaluations are its forwarded rows (the sensitivities' and the held rows') over the held rows, rounded
  up -- the compute the solver spent, in units of one candidate's evaluation.

Printed: each side's accuracy, predicted latency and evaluations; NSGA-II's best trial that meets the budget; the
difference (acceptance: the solver within 1 pt); and the solver's choice exported as a mixed folder
(:mod:`adls_lightning.export.mixed`), reloaded from disk and timed against the fp32 model (interleaved rounds, the
thread's CPU clock at one thread): its measured latency against the budget.

    python benchmarks/bench_budget_vs_nsga.py --ckpt CKPT                      # 0.5x fp32, batch 8 x 128, 1 thread
    python benchmarks/bench_budget_vs_nsga.py --ckpt CKPT --rows 500 --multiplier 5 --population 12
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import optuna
import torch

from adls_lightning.data.inputs import model_inputs
from adls_lightning.export.mixed import load_mixed
from adls_lightning.export.mixed_save import save_mixed
from adls_lightning.gemm import cpu_name
from adls_lightning.search import budget, cost

ROOT = Path(__file__).resolve().parents[1]
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def take_rows(loader, rows: int) -> list[dict[str, torch.Tensor]]:
    """The loader's first ``rows`` rows as batches (inputs and labels)."""
    batches, taken = [], 0
    for batch in loader:
        keep = min(rows - taken, int(batch["input_ids"].shape[0]))
        batches.append({k: v[:keep] for k, v in model_inputs(batch, labels=True).items()})
        taken += keep
        if taken >= rows:
            break
    return batches


@torch.inference_mode()
def accuracy(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    right = total = 0
    for batch in batches:
        predicted = model(**model_inputs(batch)).logits.argmax(-1)
        right += int((predicted == batch["labels"]).sum())
        total += int(batch["labels"].numel())
    return right / total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", required=True, help="a fine-tuned full-precision train.py checkpoint")
    parser.add_argument("--latency", type=float, default=0.5, help="the budget, x the fp32 model's latency")
    parser.add_argument("--rows", type=int, default=256, help="held test rows every candidate is scored on")
    parser.add_argument("--calibration", type=int, default=32, help="validation rows of the sensitivities")
    parser.add_argument("--multiplier", type=int, default=5, help="NSGA-II evaluations per solver evaluation")
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help="NSGA-II's trials, instead of --multiplier x the solver's evaluations (printed as the multiple it is)",
    )
    parser.add_argument("--population", type=int, default=10, help="NSGA-II's population per generation")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7, help="timing rounds of the exported model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=str(ROOT / ".cache"), help="the cost table's cache folder")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the run's config (data.*)")
    args = parser.parse_args()

    from adls_lightning.build import build
    from adls_lightning.runs.loading import load_checkpoint_model

    torch.set_num_threads(args.threads)
    flags = set(cost.cpu_flags().split())
    print(f"CPU: {cpu_name()}; flags: {' '.join(f for f in SHOWN_FLAGS if f in flags) or '(none of ours)'}")
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch} x {args.tokens} tokens")
    loaded = load_checkpoint_model(Path(args.ckpt), args.overrides)
    model = loaded.model.float().eval()
    data = build(loaded.config.data, "data")
    data.setup("fit")
    data.setup("test")
    held = take_rows(data.test_dataloader(), args.rows)
    calibration = [model_inputs(b) for b in take_rows(data.val_dataloader(), args.calibration)]
    rows = sum(int(b["labels"].numel()) for b in held)

    table = cost.cost_table(model, args.batch, args.tokens, args.threads, args.cache_dir)
    groups = budget.layer_groups(table.layers)
    budget_ms = args.latency * table.fp32_predicted_ms
    fp32_accuracy = accuracy(model, held)
    print(
        f"fp32: predicted {table.fp32_predicted_ms:.1f} ms, accuracy {fp32_accuracy:.4f} on {rows} held test rows; "
        f"budget {args.latency:g} x fp32 = {budget_ms:.1f} ms"
    )

    # the solver, as adls-budget runs it
    start = time.perf_counter()
    losses = budget.sensitivities(model, table, groups, calibration)
    scored = sum(len(budget.group_choices(table, layers)) - 1 for layers in groups.values())
    assignment, _ = budget.budget_assignment(table, groups, losses, args.latency)
    solver_accuracy = accuracy(cost.apply_assignment(model, assignment), held)
    solver_seconds = time.perf_counter() - start
    calibration_rows = sum(int(b["input_ids"].shape[0]) for b in calibration)
    solver_rows = scored * calibration_rows + rows
    solver_evaluations = math.ceil(solver_rows / rows)
    trials = args.trials or args.multiplier * solver_evaluations
    print(
        f"solver: {scored} group choices scored on {calibration_rows} rows + 1 evaluation = {solver_rows} rows "
        f"forwarded = {solver_evaluations} evaluations of {rows} rows; {solver_seconds:.0f} s; NSGA-II: {trials} "
        f"trials = {trials / solver_evaluations:.1f}x the solver's evaluations"
    )

    # NSGA-II over the same per-group choices, scored the same way
    def objective(trial: optuna.Trial) -> tuple[float, float]:
        chosen = {
            g: trial.suggest_categorical(g, budget.group_choices(table, layers))
            for g, layers in groups.items()
        }
        candidate = budget.assignment_of(groups, chosen)
        predicted = table.predict(candidate)
        trial.set_constraint("predicted_ms_over_budget", predicted - budget_ms)  # feasible at <= 0
        return accuracy(cost.apply_assignment(model, candidate), held), predicted

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.NSGAIISampler(population_size=args.population, seed=args.seed)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    start = time.perf_counter()
    study.optimize(objective, n_trials=trials)
    nsga_seconds = time.perf_counter() - start
    feasible = [t for t in study.trials if t.values and t.values[1] <= budget_ms]
    best = max(feasible, key=lambda t: (t.values[0], -t.values[1])) if feasible else None

    print()
    print("| search | evaluations | accuracy | predicted ms (x fp32) | within budget | wall s |")
    print("|---|---:|---:|---:|---|---:|")
    solver_ms = table.predict(assignment)
    print(
        f"| solver | {solver_evaluations} | {solver_accuracy:.4f} | {solver_ms:.1f} ({solver_ms / table.fp32_predicted_ms:.2f}) "
        f"| yes | {solver_seconds:.0f} |"
    )
    if best is not None:
        print(
            f"| NSGA-II best within budget (trial {best.number}, {len(feasible)} of {trials} within) | {trials} | "
            f"{best.values[0]:.4f} | {best.values[1]:.1f} ({best.values[1] / table.fp32_predicted_ms:.2f}) | yes | "
            f"{nsga_seconds:.0f} |"
        )
    else:
        print(f"| NSGA-II | {trials} | none of its trials met the budget | | no | {nsga_seconds:.0f} |")
    accuracies = [t.values[0] for t in study.trials if t.values]
    print(
        f"NSGA-II accuracies: median {statistics.median(accuracies):.4f}, max {max(accuracies):.4f} (any latency)"
    )
    fastest = min((t for t in study.trials if t.values), key=lambda t: t.values[1])
    print(
        f"NSGA-II's fastest trial: {fastest.number}, predicted {fastest.values[1]:.1f} ms "
        f"({fastest.values[1] / table.fp32_predicted_ms:.2f} x fp32), accuracy {fastest.values[0]:.4f}"
    )
    if best is not None:
        gap = 100 * (best.values[0] - solver_accuracy)
        print(
            f"solver - NSGA-II best within budget: {-gap:+.2f} pt ({'within' if gap <= 1 else 'NOT within'} 1 pt)"
        )

    # the solver's choice as it deploys: exported, reloaded from disk, timed against fp32
    with tempfile.TemporaryDirectory() as out:
        save_mixed(model, assignment, out)
        exported = load_mixed(out)
        measured = cost.measure_models(
            {"fp32": model, "chosen": exported}, args.batch, args.tokens, args.threads, args.rounds
        )
    ratio = measured["chosen"] / measured["fp32"]
    counts: dict[str, int] = {}
    for choice in assignment.values():
        counts[choice] = counts.get(choice, 0) + 1
    print(f"solver's layers per choice: {', '.join(f'{c} {n}' for c, n in sorted(counts.items()))}")
    print(
        f"exported and reloaded: measured {measured['chosen']:.1f} ms vs fp32 {measured['fp32']:.1f} ms = "
        f"{ratio:.3f} x fp32 ({'within' if ratio <= args.latency else 'NOT within'} the {args.latency:g} budget); "
        f"predicted {solver_ms:.1f} ms ({100 * (solver_ms - measured['chosen']) / measured['chosen']:+.1f}%)"
    )


if __name__ == "__main__":
    main()
