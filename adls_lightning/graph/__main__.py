"""Lab 0 in one command: ``python -m adls_lightning.graph model=tiny_random out=DIR`` (config: conf/graph.yaml).

Writes to ``out``: ``graph.svg/png`` (the captured graph), ``graph_passes.svg/png`` (after ``passes``),
``report.csv`` (one row per node of the final graph, also summarised on stdout), ``remove_dropout_error.txt``
(FX's error when dropout is erased without ``replace_all_uses_with``), ``topology_<inputs>.svg/png`` for each input
case and ``topology_diff.txt``. Bad input stops with one line naming the key, exit code 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from adls_lightning.errors import ConfigError

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
os.environ.setdefault("PROJECT_ROOT", str(Path(CONF_DIR).parent))


def _names(key: str, value) -> list[str]:
    from adls_lightning.graph.capture import check_input_names

    if isinstance(value, str):  # inputs=input_ids,attention_mask arrives as a list; a single name as a str
        value = [value]
    names = [str(name) for name in value]
    try:
        check_input_names(names)
    except ValueError as err:
        raise ConfigError(f"{key}={names}: {err}") from None
    return names


def validate(cfg: DictConfig) -> None:
    """Check the command's own keys before anything is built.

    Raises:
        ConfigError: naming the first offending key.
    """
    from adls_lightning.graph.draw import ENGINES, FORMATS
    from adls_lightning.graph.passes import PASSES

    _names("inputs", cfg.inputs)
    for index, case in enumerate(cfg.cases):
        _names(f"cases[{index}]", case)
    passes = [cfg.passes] if isinstance(cfg.passes, str) else list(cfg.passes)
    for name in passes:
        if name not in PASSES:
            raise ConfigError(f"passes: unknown pass {name!r} (registered: {', '.join(sorted(PASSES))})")
    if cfg.draw.engine not in ENGINES:
        raise ConfigError(f"draw.engine={cfg.draw.engine}: must be one of {', '.join(ENGINES)}")
    for fmt in cfg.draw.formats:
        if fmt not in FORMATS:
            raise ConfigError(f"draw.formats: unknown format {fmt!r} (valid: {', '.join(FORMATS)})")
    pairs = cfg.get("text_pair")
    if pairs is not None and (
        len(pairs) != len(cfg.text or []) or not all(isinstance(line, str) and line for line in pairs)
    ):
        raise ConfigError(
            f"text_pair: give one non-empty second sentence per text ({len(cfg.text or [])}), or null"
        )
    if not cfg.text or not all(isinstance(line, str) and line for line in cfg.text):
        raise ConfigError("text: give a list of one or more non-empty sentences")
    out = Path(str(cfg.out))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not cfg.overwrite:
        raise ConfigError(
            f"out={out}: already holds files of an earlier run (pass overwrite=true or another out)"
        )


def build_model(cfg: DictConfig) -> torch.nn.Module:
    """The Hugging Face model of ``cfg.model`` (its backbone, with PEFT LoRA when ``model.lora`` is set)."""
    from peft import get_peft_model

    from adls_lightning.build import build
    from adls_lightning.models import set_attn_implementation

    model = build(cfg.model.backbone, "model.backbone")
    if cfg.model.get("attn_implementation"):
        set_attn_implementation(model, cfg.model.attn_implementation)
    if cfg.model.get("lora"):
        model = get_peft_model(model, build(cfg.model.lora, "model.lora"))
    return model.train(cfg.train_mode)


def tokenized_inputs(cfg: DictConfig) -> dict[str, torch.Tensor]:
    """The ``text`` sentences through the model's tokenizer, padded to one length, with labels 1, 0, 1, ..."""
    from adls_lightning.models import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.backbone.name_or_path)
    pairs = list(cfg.text_pair) if cfg.get("text_pair") else None
    encoded = tokenizer(list(cfg.text), pairs, padding=True, return_tensors="pt")
    inputs = {
        name: encoded[name] for name in ("input_ids", "attention_mask", "token_type_ids") if name in encoded
    }
    inputs.setdefault("token_type_ids", torch.zeros_like(encoded["input_ids"]))
    inputs["labels"] = torch.tensor([(i + 1) % 2 for i in range(len(cfg.text))])
    return inputs


def run(cfg: DictConfig) -> Path:
    """Everything the command does; returns the output folder."""
    from adls_lightning.graph import capture, diff, draw, remove_dropout_without_rewire, run_passes
    from adls_lightning.graph.report import report_rows, summarise, write_csv

    validate(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    inputs = tokenized_inputs(cfg)
    out = Path(str(cfg.out))
    out.mkdir(parents=True, exist_ok=True)
    model_name = (
        HydraConfig.get().runtime.choices.get("model", "model") if HydraConfig.initialized() else "model"
    )
    engine, formats = cfg.draw.engine, list(cfg.draw.formats)

    def captured(names: list[str]):
        return capture(model, names, inputs=inputs, dynamic=cfg.dynamic)

    main_inputs = _names("inputs", cfg.inputs)
    graph_module = captured(main_inputs)
    nodes_before = len(graph_module.graph.nodes)
    written = draw(
        graph_module, out / "graph", engine=engine, formats=formats, title=f"{model_name} {main_inputs}"
    )
    try:
        remove_dropout_without_rewire(captured(main_inputs))
        error = "no error: the graph has no dropout node with users"
    except RuntimeError as err:
        error = f"RuntimeError: {err}"
    (out / "remove_dropout_error.txt").write_text(error + "\n")
    passes = [cfg.passes] if isinstance(cfg.passes, str) else list(cfg.passes)
    if passes:
        graph_module = run_passes(graph_module, passes)
        written += draw(
            graph_module,
            out / "graph_passes",
            engine=engine,
            formats=formats,
            title=f"{model_name} {main_inputs} after {passes}",
        )
    rows = report_rows(graph_module)
    written.append(write_csv(rows, out / "report.csv"))
    print(
        f"{model_name}, inputs {main_inputs}: {nodes_before} nodes captured, {len(rows)} after passes {passes}"
    )
    print(summarise(rows))
    print(f"without replace_all_uses_with: {error}")

    cases = [_names(f"cases[{i}]", case) for i, case in enumerate(cfg.cases)]
    graphs = []
    for names in cases:
        graphs.append(captured(names))
        written += draw(
            graphs[-1],
            out / f"topology_{'+'.join(names)}",
            engine=engine,
            formats=formats,
            title=f"{model_name} {names}",
        )
    diffs = [
        diff(a, b).summary(
            f"{names_a} ({len(a.graph.nodes)} nodes)", f"{names_b} ({len(b.graph.nodes)} nodes)"
        )
        for (names_a, a), (names_b, b) in zip(zip(cases, graphs), zip(cases[1:], graphs[1:]))
    ]
    (out / "topology_diff.txt").write_text("\n\n".join(diffs) + "\n")
    written.append(out / "topology_diff.txt")
    print("\n\n".join(diffs))
    print("wrote " + ", ".join(str(path) for path in written))
    return out


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="graph")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
