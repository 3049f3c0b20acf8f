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
B·A that the models add to their weights: soups are for full fine-tunes (``model/lora=none``). The checkpoints'
recipe must agree too (:func:`adls_lightning.soup.recipe`): the task, data folder, label set and tokenizer they
record (the datamodule's hyper-parameters) and, for checkpoints in run folders, the model (``model.backbone`` of
the run record); the seed and training settings (learning rate, batch size, epochs) may differ.

The soup is a checkpoint with the first one's hyper-parameters, its data module's (the task train.py's and the
export's checks read) and its run's overrides (so ``adls-export ckpt=FILE`` needs none the first checkpoint does
not), and no optimizer or loop state: evaluate it with the runs' own command and ``train=false ckpt_path=FILE``,
start a run from it with ``init_ckpt=FILE``, or export it.
Bad input (an unknown option, a checkpoint that cannot be averaged or of another recipe, an ``out`` that cannot be
written): one line naming the key and the file (and the recipe's key that differs), exit code 2, nothing written. ``--help``: this text.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from adls_lightning.errors import ConfigError
from adls_lightning.soup import TOO_FEW, USAGE, best_checkpoint, make_soup
from adls_lightning.tools.options import check_writable, flag_option, run_tool, split_options

OPTIONS = {"ckpts": None, "out": None, "overwrite": "false"}


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
