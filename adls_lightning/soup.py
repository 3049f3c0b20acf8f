"""``python -m adls_lightning.soup ckpts=A,B[,C...] out=FILE [overwrite=false]``: a uniform "model soup".

Each of ``ckpts`` is a checkpoint file or a run folder (its ``checkpoints/best*.ckpt``, the checkpoint train.py
evaluates after fitting).

The element-wise mean of the weights of models fine-tuned from the same start (Wortsman et al. 2022, "Model soups:
averaging weights of multiple fine-tuned models improves accuracy without increasing inference time"): one model,
as large and as fast as each of them. Runs of one recipe that differ only in ``seed`` stay close enough to the
start (and so to each other) that their mean is a good model, where the mean of unrelated models is not.

What is averaged: every floating-point tensor of the checkpoints' ``state_dict``. What must agree instead: every
other tensor (integer buffers such as position ids) and pruning masks (``*.mask``: a mean of two different masks
is no mask); LoRA checkpoints are refused, because the mean of the factors A and B is not the mean of the products
B·A that the models add to their weights: soups are for full fine-tunes (``model/lora=none``).

The soup is a checkpoint with the first one's hyper-parameters and no optimizer or loop state: evaluate it with
the runs' own command and ``train=false ckpt_path=FILE``, start a run from it with ``init_ckpt=FILE``, or export it.
Bad input (an unknown option, a checkpoint that cannot be averaged, an ``out`` that cannot be written): one line
naming the key and the file, exit code 2, nothing written. ``--help``: this text.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from adls_lightning.checkpoints import read_checkpoint
from adls_lightning.errors import ConfigError
from adls_lightning.tool_options import check_writable, flag_option, run_tool, split_options

OPTIONS = {"ckpts": None, "out": None, "overwrite": "false"}
USAGE = "python -m adls_lightning.soup ckpts=A.ckpt,B.ckpt out=SOUP.ckpt"
# the parts of a Lightning checkpoint a soup keeps: the weights, and what loading them needs
KEPT_KEYS = ("pytorch-lightning_version", "hyper_parameters", "hparams_name")
MASK_SUFFIX = ".mask"
TOO_FEW = f"give at least two checkpoints to average, comma-separated (usage: {USAGE})"


def average_state_dicts(
    state_dicts: Sequence[Mapping[str, Any]], names: Sequence[str], key: str = "ckpts"
) -> dict[str, Any]:
    """The element-wise mean of ``state_dicts``' floating-point tensors (computed in float64, stored in each
    tensor's own dtype); every other entry, and pruning masks, taken from the first after checking they agree.

    ``names`` names each state (its file) in errors.

    Raises:
        ConfigError: ``KEY=NAME: ...`` for fewer than two states, a LoRA state, keys or shapes that differ, or
            masks or integer tensors that differ.
    """
    import torch

    if len(state_dicts) < 2:
        raise ConfigError(f"{key}: {TOO_FEW}")
    first, first_name = state_dicts[0], names[0]
    for state, name in zip(state_dicts, names):
        if lora := next((k for k in state if ".lora_A." in k), None):
            raise ConfigError(
                f"{key}={name}: a LoRA checkpoint ({lora}): the mean of LoRA's A and B factors is not the mean of "
                "the models; average full fine-tunes (model/lora=none)"
            )
    for state, name in zip(state_dicts[1:], names[1:]):
        if missing := next((k for k in first if k not in state), None) or next(
            (k for k in state if k not in first), None
        ):
            raise ConfigError(
                f"{key}={name}: key {missing} is in one of {first_name} and {name} only (checkpoints of "
                "different models or compressions cannot be averaged)"
            )
        for name_k, ours in first.items():
            theirs = state[name_k]
            if not isinstance(ours, torch.Tensor):
                continue
            if theirs.shape != ours.shape or theirs.dtype != ours.dtype:
                raise ConfigError(
                    f"{key}={name}: key {name_k} is {tuple(theirs.shape)} {theirs.dtype} there and "
                    f"{tuple(ours.shape)} {ours.dtype} in {first_name} (another architecture or task)"
                )
            if (not ours.is_floating_point() or name_k.endswith(MASK_SUFFIX)) and not torch.equal(
                ours, theirs
            ):
                what = "pruning mask" if name_k.endswith(MASK_SUFFIX) else f"{ours.dtype} tensor"
                raise ConfigError(
                    f"{key}={name}: {what} {name_k} differs from {first_name}'s (only floating-point weights are "
                    "averaged; the rest must be the same in every checkpoint)"
                )
    averaged: dict[str, Any] = {}
    for name_k, ours in first.items():
        if isinstance(ours, torch.Tensor) and ours.is_floating_point() and not name_k.endswith(MASK_SUFFIX):
            total = torch.zeros(ours.shape, dtype=torch.float64)
            for state in state_dicts:
                total += state[name_k].to(torch.float64)
            averaged[name_k] = (total / len(state_dicts)).to(ours.dtype)
        else:
            averaged[name_k] = ours
    return averaged


def best_checkpoint(path: Path) -> Path:
    """``path`` itself, or for a run folder its one ``checkpoints/best*.ckpt``; raises ConfigError for none or several."""
    if not path.is_dir():
        return path
    found = sorted((path / "checkpoints").glob("best*.ckpt"))
    if len(found) != 1:
        what = "no checkpoints/best*.ckpt" if not found else f"{len(found)} checkpoints/best*.ckpt files"
        raise ConfigError(f"ckpts={path}: a folder with {what} (name the checkpoint file)")
    return found[0]


def check_options(options: Mapping[str, str | None]) -> tuple[list[Path], Path]:
    """The checkpoint paths and the output path; raises ConfigError naming the first bad key."""
    for required in ("ckpts", "out"):
        if not options[required]:
            raise ConfigError(f"{required}: required (usage: {USAGE})")
    ckpts = [
        best_checkpoint(Path(p.strip())) for p in str(options["ckpts"]).strip("[]").split(",") if p.strip()
    ]
    if len(ckpts) < 2:  # before any file is read
        raise ConfigError(f"ckpts: {TOO_FEW}")
    out = Path(str(options["out"]))
    overwrite = flag_option(options, "overwrite")
    if out.is_dir():
        raise ConfigError(f"out={out}: is a folder (give the soup's .ckpt file path)")
    if out.exists() and not overwrite:
        raise ConfigError(f"out={out}: exists (give another path, or overwrite=true)")
    if out.resolve() in {p.resolve() for p in ckpts}:
        raise ConfigError(f"out={out}: is one of the checkpoints to average (give another path)")
    check_writable(out, "out", file=True)  # before the checkpoints are read
    return ckpts, out


def make_soup(ckpts: Sequence[Path], out: Path) -> dict[str, Any]:
    """Average ``ckpts`` (:func:`average_state_dicts`) and write the soup to ``out`` atomically; returns it."""
    import torch

    from adls_lightning.atomic_files import atomic_write

    checkpoints = [
        read_checkpoint(path, "ckpts", mmap=True) for path in ckpts
    ]  # the optimizer states stay unread
    state = average_state_dicts([c["state_dict"] for c in checkpoints], [str(p) for p in ckpts])
    soup = {k: checkpoints[0][k] for k in KEPT_KEYS if k in checkpoints[0]}
    soup["state_dict"] = state
    soup["soup"] = [str(p) for p in ckpts]  # where the weights came from
    atomic_write(out, lambda tmp: torch.save(soup, tmp))
    return soup


def main(argv: Sequence[str] | None = None) -> int:
    from adls_lightning.logs import configure_tool

    configure_tool()

    def soup() -> None:
        options, _ = split_options(sys.argv[1:] if argv is None else argv, OPTIONS, USAGE, overrides=False)
        ckpts, out = check_options(options)
        made = make_soup(ckpts, out)
        print(f"Averaged {len(ckpts)} checkpoints ({len(made['state_dict'])} tensors) into {out}")

    return run_tool(soup, __doc__)


if __name__ == "__main__":
    sys.exit(main())
