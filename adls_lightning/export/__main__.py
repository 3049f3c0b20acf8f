"""``python -m adls_lightning.export ckpt=PATH out=DIR [format=mxint8|hf] [options] [model overrides]``.

Options: ``group_size=32``, ``exclude=classifier`` (comma-separated module names left float),
``pack_embeddings=false`` (also pack the word embeddings), ``overwrite=false`` (allow a non-empty ``out``).
Every other ``key=value`` is a Hydra override of ``conf/train.yaml`` that builds the model the checkpoint was
trained with (default: the MiniLM + LoRA of ``train.py``), e.g. ``model=tiny_random``. LoRA adapters are
merged before anything is written. Bad input: one line naming the key, exit code 2, nothing written.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

from adls_lightning.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_ROOT / "conf"
OPTIONS = {
    "ckpt": None,
    "out": None,
    "format": "mxint8",
    "group_size": "32",
    "exclude": "classifier",
    "pack_embeddings": "false",
    "overwrite": "false",
}
BOOLEANS = {"true": True, "false": False}


def parse_arguments(argv: Sequence[str]) -> tuple[dict[str, str | None], list[str]]:
    """Split ``key=value`` tokens into this command's options and Hydra overrides of the model config."""
    options = dict(OPTIONS)
    overrides = []
    for token in argv:
        key, sep, value = token.partition("=")
        if not sep or not key:
            raise ConfigError(f"{token!r}: expected key=value, e.g. ckpt=PATH out=DIR format=mxint8")
        if key in OPTIONS:
            options[key] = value
        else:
            overrides.append(token)
    return options, overrides


def _boolean(options: dict, key: str) -> bool:
    value = str(options[key]).lower()
    if value not in BOOLEANS:
        raise ConfigError(f"{key}={options[key]}: must be true or false")
    return BOOLEANS[value]


def check_options(options: dict[str, str | None]) -> dict:
    """Validated options (paths, format, group size, flags); raises ConfigError naming the first bad key."""
    for key in ("ckpt", "out"):
        if not options[key]:
            raise ConfigError(f"{key}: required (usage: python -m adls_lightning.export ckpt=PATH out=DIR)")
    ckpt, out = Path(options["ckpt"]), Path(options["out"])
    if not ckpt.is_file():
        raise ConfigError(f"ckpt={ckpt}: no such checkpoint file")
    if options["format"] not in ("mxint8", "hf"):
        raise ConfigError(f"format={options['format']}: must be mxint8 or hf")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: is a file, expected a folder (new or empty)")
    overwrite = _boolean(options, "overwrite")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"out={out}: folder is not empty; choose a new one or pass overwrite=true")
    try:
        group_size = int(options["group_size"])
    except ValueError:
        group_size = 0
    if group_size <= 0:
        raise ConfigError(f"group_size={options['group_size']}: must be a positive integer, e.g. 32")
    exclude = tuple(name for name in str(options["exclude"]).split(",") if name)
    return {
        "ckpt": ckpt,
        "out": out,
        "format": options["format"],
        "group_size": group_size,
        "exclude": exclude,
        "pack_embeddings": _boolean(options, "pack_embeddings"),
    }


def load_checkpoint_model(ckpt: Path, overrides: Sequence[str]):
    """The merged Hugging Face model of a ``train.py`` checkpoint, and the name of its tokenizer."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from adls_lightning.build import build
    from adls_lightning.checkpoints import read_checkpoint
    from adls_lightning.lora import merge_lora

    os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))
    try:
        with warnings.catch_warnings(), initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            warnings.simplefilter("ignore")  # Hydra's version_base deprecation: not the user's concern here
            cfg = compose("train", overrides=list(overrides))
        tokenizer = cfg.data.get("tokenizer")
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(f"overrides {list(overrides)}: {str(error).splitlines()[0]}") from error
    # the data's task shapes the head (labels, regression) as in the run that wrote the checkpoint
    task = build(cfg.data, "data").task
    module = build(cfg.model, "model", _convert_="partial", **task.model_overrides())
    state = read_checkpoint(ckpt, "ckpt")["state_dict"]  # a damaged or foreign file: one line naming it
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as error:
        first = str(error).splitlines()[0]
        raise ConfigError(
            f"ckpt={ckpt}: its weights do not fit the model built from {list(overrides) or 'the defaults'} "
            f"({first}); pass the model overrides it was trained with"
        ) from error
    merge_lora(module)
    return module.model.eval(), tokenizer


def save_tokenizer(name: str | None, out: Path) -> bool:
    from adls_lightning.models import load_tokenizer

    if not name:
        return False
    try:
        load_tokenizer(name).save_pretrained(out)
    except (ConfigError, OSError):
        return False
    return True


def export(options: dict, overrides: Sequence[str]) -> None:
    from adls_lightning.export import WEIGHTS_FILE, folder_bytes, pack_for_export, save_packed

    model, tokenizer = load_checkpoint_model(options["ckpt"], overrides)
    out: Path = options["out"]
    with tempfile.TemporaryDirectory() as fp32_dir:
        model.save_pretrained(fp32_dir)
        fp32_bytes = folder_bytes(Path(fp32_dir), [WEIGHTS_FILE])
    if options["format"] == "hf":
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        summary = f"save_pretrained (merged, fp32): {fp32_bytes / 1e6:.1f} MB"
    else:
        try:
            packed = pack_for_export(
                model, options["group_size"], options["exclude"], options["pack_embeddings"]
            )
        except ValueError as error:
            raise ConfigError(f"group_size={options['group_size']}: {error}") from error
        save_packed(model, packed, out)
        weights = folder_bytes(out, [WEIGHTS_FILE])
        summary = (
            f"{len(packed.linear)} linear layers packed"
            f"{', word embeddings packed' if packed.embeddings else ''}; {WEIGHTS_FILE} {weights / 1e6:.1f} MB "
            f"vs fp32 save_pretrained {fp32_bytes / 1e6:.1f} MB ({1 - weights / fp32_bytes:.1%} smaller)"
        )
    tokenizer_saved = save_tokenizer(tokenizer, out)
    print(
        f"exported {options['format']} to {out}: {summary}; folder {folder_bytes(out) / 1e6:.1f} MB"
        f"{' (tokenizer included)' if tokenizer_saved else ''}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        options, overrides = parse_arguments(sys.argv[1:] if argv is None else argv)
        export(check_options(options), overrides)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
