"""An exported folder as something to run: which format it is, checked without building a model (and without
importing torch: the tools refuse a damaged folder at once), and loaded.

Every format the export writes (``hf``, ``onnx`` with its int8 files, ``mxint8``) holds a Hugging Face
``config.json`` with the task's label names (``id2label`` / ``label2id``, from the run's data, as the model was
trained) and how the run fed it texts (:data:`INPUTS_KEY`: the task, whether it takes pairs, the truncation
length and side), and the tokenizer's files: the folder alone turns texts into labels
(:mod:`adls_lightning.export.predict`) and scores on the test split (:mod:`adls_lightning.export.evaluate`).

A path is an export when it is one of: a ``format=mxint8`` folder (``mxint8_config.json`` and
``model.safetensors``), a ``format=hf`` folder (``config.json`` and ``model.safetensors``), or an ONNX export
(``config.json`` beside ``*.onnx`` or a ``*.pt2`` package: the folder runs ``model.onnx``, or its only graph; a
path to one of its files runs that one, e.g. ``model_int8.onnx``). Weights as a pickle are never read (a pickle can run
code when loaded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adls_lightning.errors import ConfigError
from adls_lightning.export.recipe import ACTIVATION_STATE_FILE, ExportRecipe

#: a ``format=mxint8`` folder's config and every export's weights (:mod:`adls_lightning.export.packed` writes them)
CONFIG_FILE = "mxint8_config.json"
WEIGHTS_FILE = "model.safetensors"

#: the Hugging Face config every export folder holds (``format=hf``: the one ``from_pretrained`` reads)
HF_CONFIG_FILE = "config.json"
#: weights files a folder may hold that are pickles: never read here (a pickle can run code when loaded)
PICKLED_WEIGHTS = ("pytorch_model.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
#: the export's self-check (:mod:`adls_lightning.export.selfcheck`); its ``failed`` key marks an export whose
#: read-back disagreed with the run, which no reader runs (:func:`check_folder`)
EXPORT_JSON = "export.json"
FAILED_KEY = "failed"
#: the key of ``config.json`` that says how the run fed texts to the model (see :func:`task_inputs`)
INPUTS_KEY = "adls_inputs"
ONNX_DEFAULT = "model.onnx"
EXPORT_KINDS = ("mxint8", "hf", "onnx")
#: files that are a whole compiled model, by the kind of export they make: ONNX graphs (ONNX Runtime) and
#: AOTInductor packages (``format=onnx int8=auto`` where PT2E int8 is the fastest, :mod:`adls_lightning.export.pt2e`)
GRAPH_SUFFIXES = {".onnx": "onnx", ".pt2": "pt2"}


@dataclass(frozen=True)
class ExportFolder:
    """A checked export: its folder, its format, and for ``onnx`` and ``pt2`` the graph that runs."""

    folder: Path
    kind: str
    graph_file: Path | None = None

    def graph_note(self, given: Path | str) -> str | None:
        """``note: DIR: runs GRAPH (no model.onnx in it)`` when ``given`` (what the command line named) is the
        folder and the graph it runs is not :data:`ONNX_DEFAULT` (its only one): the command line does not say
        which; None otherwise."""
        if Path(given).is_dir() and self.graph_file is not None and self.graph_file.name != ONNX_DEFAULT:
            return f"note: {given}: runs {self.graph_file.name} (no {ONNX_DEFAULT} in it)"
        return None

    @property
    def config(self) -> dict[str, Any]:
        """The folder's Hugging Face config (``config.json``; a packed folder without one: the packed config's)."""
        if (self.folder / HF_CONFIG_FILE).is_file():
            return read_json(self.folder / HF_CONFIG_FILE)
        return read_json(self.folder / CONFIG_FILE)["hf_config"]


def task_inputs(data: Any) -> dict[str, Any]:
    """How a run's data module feeds the model: ``task`` (its name), ``text_pair`` (True: pairs of texts,
    False: single texts, None: not known without reading the data), ``max_length`` and ``truncation_side``."""
    spec = getattr(data, "spec", None)  # a GLUE task knows its columns without its files
    if spec is not None:
        pairs = spec.text_pair is not None
    else:
        # a folder task knows once it has read its files (it does to infer labels); reading them only for this
        # would make the export depend on the data being at hand
        loaded = getattr(data, "_encoded", None)
        pairs = None if loaded is None else "text_pair" in loaded[0]["train"].column_names
    return {
        "task": data.task.name,
        "text_pair": pairs,
        "max_length": int(data.hparams.max_length),
        "truncation_side": str(data.hparams.truncation_side),
    }


def write_config(model_config: Any, out: Path, inputs: dict[str, Any] | None) -> None:
    """``out/config.json``: the model's Hugging Face config (its ``id2label`` the task's label names) with
    :data:`INPUTS_KEY`; formats whose weights are not a ``save_pretrained`` folder write it beside their files."""
    if inputs is not None:
        setattr(model_config, INPUTS_KEY, dict(inputs))
    model_config.save_pretrained(out)


def save_tokenizer(name: str | None, out: Path) -> bool:
    """Save the run's tokenizer beside an export so the folder predicts on its own; False when it cannot be had."""
    from adls_lightning.models import load_tokenizer

    if not name:
        return False
    try:
        load_tokenizer(name).save_pretrained(out)
    except (ConfigError, OSError):
        return False
    return True


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{path}: not a JSON file ({str(error).splitlines()[0][:200]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a JSON {type(data).__name__}, expected an object (a damaged export)")
    return data


def check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        # numpy's reader: the header and offsets are what is checked, and torch's would import torch (seconds)
        with safe_open(str(path), "numpy") as handle:
            handle.keys()
    except Exception as error:  # noqa: BLE001 - safetensors' own error type: a damaged or cut file, named
        raise ConfigError(
            f"{path}: not a readable safetensors file ({str(error).splitlines()[0][:200]}); export the "
            "checkpoint again"
        ) from None


def _graph_export(path: Path, usage: str) -> ExportFolder | None:
    """The compiled-graph export ``path`` names (its folder, or one of its :data:`GRAPH_SUFFIXES` files: an ONNX
    graph or a ``.pt2`` package), or None when it is none."""
    if path.is_file():
        if path.suffix not in GRAPH_SUFFIXES:
            raise ConfigError(
                f"{path}: a file, expected an exported folder or its .onnx or .pt2 file ({usage})"
            )
        folder, graph = path.parent, path
    else:
        graphs = sorted(p for suffix in GRAPH_SUFFIXES for p in path.glob(f"*{suffix}"))
        if not graphs:
            return None
        folder = path
        default = [g for g in graphs if g.name == ONNX_DEFAULT]
        graph = (default or graphs)[0] if len(graphs) == 1 or default else None
        if graph is None:
            names = ", ".join(g.name for g in graphs)
            raise ConfigError(f"{path}: several graphs ({names}); valid: the path of the one to run")
    kind = GRAPH_SUFFIXES[graph.suffix]
    if not (folder / HF_CONFIG_FILE).is_file():
        raise ConfigError(
            f"{folder}: an {'ONNX' if kind == 'onnx' else 'AOTInductor'} export ({graph.name}) without {HF_CONFIG_FILE} (written before exports held "
            "their labels); export the checkpoint again"
        )
    read_json(folder / HF_CONFIG_FILE)
    if graph.stat().st_size == 0:
        raise ConfigError(f"{graph}: an empty file; export the checkpoint again")
    return ExportFolder(folder, kind, graph)


def refuse_failed_export(folder: Path) -> None:
    """Refuse a folder whose export failed its self-check (:data:`EXPORT_JSON` says so under :data:`FAILED_KEY`):
    its files are kept for inspection, but they do not compute what the run did."""
    check = folder / EXPORT_JSON
    if not check.is_file():
        return
    failed = read_json(check).get(FAILED_KEY)
    if failed:
        raise ConfigError(
            f"{folder}: its export failed its self-check ({failed}); valid: export the checkpoint again into a "
            "new folder"
        )


def check_folder(path: Path, usage: str = "an exported folder") -> ExportFolder:
    """What :func:`load_folder` reads, checked without building a model: ``format=mxint8`` (its config and
    weights), ``format=hf`` (``config.json`` and ``model.safetensors``) or an ONNX export (``config.json`` and
    the graph), nothing pickled, nothing damaged that can be seen without loading it.

    Raises:
        ConfigError: naming the folder or the file, and what would be valid.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such folder; expected an exported folder ({usage})")
    refuse_failed_export(path if path.is_dir() else path.parent)
    graph = _graph_export(path, usage)
    if graph is not None:
        return graph
    # a per-layer mixed export (issue 60: adls-budget out=, adls_lightning/export/mixed.py): format=hf's files
    # checked as below, its layers' choices here; kind "mixed"
    from adls_lightning.export.mixed import MIXED_CONFIG_FILE, read_mixed_config

    mixed = path.is_dir() and (path / MIXED_CONFIG_FILE).is_file()
    if mixed:
        read_mixed_config(path)
    if (path / CONFIG_FILE).is_file():
        config = read_json(path / CONFIG_FILE)
        missing = [
            k for k in ("hf_config", "group_size", "packed_linear", "packed_embeddings") if k not in config
        ]
        if missing:
            raise ConfigError(f"{path / CONFIG_FILE}: no {missing[0]!r} (not written by format=mxint8)")
        kind = "mxint8"
        if (path / HF_CONFIG_FILE).is_file():
            read_json(path / HF_CONFIG_FILE)
    elif (path / HF_CONFIG_FILE).is_file():
        read_json(path / HF_CONFIG_FILE)
        kind = "mixed" if mixed else "hf"
    else:
        raise ConfigError(
            f"{path}: no {CONFIG_FILE}, {HF_CONFIG_FILE} or *.onnx; valid: folders written by "
            f"python -m adls_lightning.export (format={', '.join(EXPORT_KINDS)}) ({usage})"
        )
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in path.glob(pattern))
        found = f"its weights are a pickle ({pickled[0]}), which is not loaded" if pickled else "no weights"
        raise ConfigError(f"{path}: {found}; valid: {WEIGHTS_FILE}, as the export writes it")
    check_safetensors(weights)
    if (path / ACTIVATION_STATE_FILE).is_file():
        check_safetensors(path / ACTIVATION_STATE_FILE)
    return ExportFolder(path, kind)


def load_folder(path: Path, recipe: ExportRecipe | None = None, usage: str = "an exported folder"):
    """The export's model (a PyTorch classifier; :class:`~adls_lightning.export.onnx.OnnxClassifier` for an ONNX
    export, :class:`~adls_lightning.export.pt2e.Pt2Classifier` for a ``.pt2`` package), with its compression recipe
    applied (activation quantizers and pruning).

    Raises:
        ConfigError: the path is not an export or is damaged (:func:`check_folder`), or its files do not
            build a model.
    """
    export = check_folder(Path(path), usage)
    folder = export.folder
    try:
        if export.kind == "onnx":
            from adls_lightning.export.onnx import OnnxClassifier

            model = OnnxClassifier(export.graph_file)
        elif export.kind == "pt2":
            from adls_lightning.export.pt2e import Pt2Classifier

            model = Pt2Classifier(export.graph_file)
        elif export.kind == "mxint8":
            from adls_lightning.export import load_packed

            model = load_packed(folder)
        elif export.kind == "mixed":  # issue 60: each linear layer in its own runtime (export/mixed.py)
            from adls_lightning.export.mixed import load_mixed

            model = load_mixed(folder)
        else:
            from adls_lightning.prune.structured import load_pretrained_structured

            # from_pretrained, or the sizes a structurally pruned export records in its config rebuilt first
            model = load_pretrained_structured(folder).eval()
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 - torch, transformers and ONNX Runtime each raise their own types
        # a config, weights or graph that do not build the model they describe (edited, cut, mixed from two exports)
        raise ConfigError(
            f"{export.graph_file or folder}: its files do not load as a model ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200] if str(error) else ''}); export the checkpoint again"
        ) from None
    if export.kind in GRAPH_SUFFIXES.values():
        # the export refuses activation compression for graphs: a recipe asking for it is not from the export
        if recipe is not None and (recipe.activation_quant or recipe.activation_prune):
            raise ConfigError(
                f"{folder}: its recipe acts on activations, which a compiled graph does not carry"
            )
        return model
    if recipe is None:
        return model
    from adls_lightning.export.compressed import apply_recipe

    return apply_recipe(model, folder, recipe)


__all__ = [
    "EXPORT_JSON",
    "EXPORT_KINDS",
    "FAILED_KEY",
    "GRAPH_SUFFIXES",
    "HF_CONFIG_FILE",
    "INPUTS_KEY",
    "PICKLED_WEIGHTS",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "ExportFolder",
    "check_folder",
    "check_safetensors",
    "load_folder",
    "read_json",
    "refuse_failed_export",
    "task_inputs",
    "write_config",
]
