"""Lab 0 in one command: ``python -m adls_lightning.graph model=tiny_random out=DIR`` (config: conf/graph.yaml); the
capture, passes, drawing and report it calls are :mod:`adls_lightning.graph`.

Writes to ``out``: ``graph.svg/png`` (the captured graph), ``graph_passes.svg/png`` (after ``passes``),
``report.csv`` (one row per node of the final graph, also summarised on stdout), ``remove_dropout_error.txt``
(FX's error when dropout is erased without ``replace_all_uses_with``), ``topology_<inputs>.svg/png`` for each input
case and ``topology_diff.txt``. ``overwrite=true`` replaces an earlier run's files of these kinds, so ``out`` never
mixes two runs (:func:`writing_one_run`); Ctrl-C ends in one line, exit code 130, with ``out`` as it was before the run.
Bad input stops with one line naming the key, exit code 2, before Hydra runs anything:
the command line's config is composed and checked first (:func:`guarded_main`), as ``train.py``'s pre-flight does --
every ``_target_`` of it, ``hydra.callbacks`` included, against the project's allowed targets, then the command's own
keys (:func:`validate`: names, passes, flags, an ``out`` that can be written). ``--help``: Hydra's help.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from adls_lightning.app.cli import exit_interrupted, noting_interrupts
from adls_lightning.app.preflight import validate_model_settings
from adls_lightning.build import hydra_execution_whitelist
from adls_lightning.configs import CONF_DIR
from adls_lightning.errors import ConfigError, exit_with, informational_flags, refusing_in_one_line
from adls_lightning.files.earlier_outputs import earlier_outputs_kept_until_done, removed_lines, set_aside

if TYPE_CHECKING:
    import torch

os.environ.setdefault("PROJECT_ROOT", str(CONF_DIR.resolve().parent))


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
    from adls_lightning.graph.draw import FORMATS, resolve_engine
    from adls_lightning.graph.passes import PASSES

    # the model's own settings, as train.py checks them: the graph is built from the same model config
    validate_model_settings({"model": OmegaConf.to_container(cfg.model, resolve=True)})
    _names("inputs", cfg.inputs)
    for index, case in enumerate(cfg.cases):
        _names(f"cases[{index}]", case)
    passes = [cfg.passes] if isinstance(cfg.passes, str) else list(cfg.passes)
    for name in passes:
        if name not in PASSES:
            raise ConfigError(f"passes: unknown pass {name!r} (registered: {', '.join(sorted(PASSES))})")
    try:
        resolve_engine(
            cfg.draw.engine
        )  # before the model is built or out= made: dot asked for and not installed
    except ValueError as error:
        raise ConfigError(f"draw.engine={cfg.draw.engine}: {error}") from None
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
    for flag in ("dynamic", "train_mode", "overwrite"):
        if not isinstance(cfg.get(flag), bool):
            raise ConfigError(f"{flag}={cfg.get(flag)!r}: must be true or false")
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed={seed!r}: must be an integer in [0, 2**32)")
    out = Path(str(cfg.out))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not cfg.overwrite:
        raise ConfigError(
            f"out={out}: already holds files of an earlier run (pass overwrite=true or another out)"
        )
    kept = out / EARLIER_RUN_DIR
    if kept.exists():
        raise ConfigError(
            f"overwrite=true: {kept} holds the files of an earlier run, kept there by a run that was killed before "
            f"it finished; valid: move them back into {out} (or delete {kept}), then run again"
        )
    from adls_lightning.tools.options import check_writable

    check_writable(out, "out")


#: Where ``overwrite=true`` keeps an earlier run's outputs while this run writes its own (:func:`writing_one_run`).
EARLIER_RUN_DIR = ".earlier-graph"
#: The files the command writes besides its pictures (``graph``, ``graph_passes``, ``topology_<inputs>`` in each
#: of ``draw.formats``).
TEXT_OUTPUTS = ("report.csv", "remove_dropout_error.txt", "topology_diff.txt")


def is_graph_output(name: str) -> bool:
    """``name`` is one the command writes, whatever its settings (every format, every input case)."""
    from adls_lightning.graph.draw import FORMATS

    stem, _, suffix = name.rpartition(".")
    if suffix in FORMATS:
        return stem in ("graph", "graph_passes") or stem.startswith("topology_")
    return name in TEXT_OUTPUTS


def graph_outputs(out: Path) -> list[Path]:
    """The files of ``out`` the command writes (:func:`is_graph_output`), in name order; none without ``out``."""
    try:
        return sorted(p for p in out.iterdir() if is_graph_output(p.name) and p.is_file())
    except OSError:  # no folder yet
        return []


@contextlib.contextmanager
def writing_one_run(out: Path, overwrite: bool, interrupts: Sequence[int] = ()) -> Iterator[list[str]]:
    """``out`` made ready for this run's files, right before the first is written; yields the names of the earlier
    run's files that ``overwrite=true`` replaces.

    Those are set aside (:func:`~adls_lightning.files.earlier_outputs.earlier_outputs_kept_until_done`, as
    ``adls-export`` does) and deleted when the block succeeds, so ``out`` then holds this run's files and none of an
    earlier run's (with other settings it wrote pictures this run does not). When the block fails (an error,
    Ctrl-C), this run's files are deleted, the earlier ones put back, and the folders it created removed: ``out``
    is as it was, not half-written as if whole. Files the command does not write stay. ``interrupts``: Ctrl-C as
    :func:`~adls_lightning.app.cli.noting_interrupts` notes it (one that Python dropped fails the block too).
    """
    with earlier_outputs_kept_until_done(
        out, EARLIER_RUN_DIR, graph_outputs, discard_on_failure=True, interrupts=interrupts
    ):
        out.mkdir(parents=True, exist_ok=True)
        earlier = graph_outputs(out) if overwrite else []
        if earlier:
            set_aside(earlier, out / EARLIER_RUN_DIR)
        yield [path.name for path in earlier]


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
    import torch

    from adls_lightning.data.inputs import model_inputs
    from adls_lightning.models import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.backbone.name_or_path)
    pairs = list(cfg.text_pair) if cfg.get("text_pair") else None
    encoded = tokenizer(list(cfg.text), pairs, padding=True, return_tensors="pt")
    inputs = model_inputs(encoded)
    inputs.setdefault("token_type_ids", torch.zeros_like(encoded["input_ids"]))
    inputs["labels"] = torch.tensor([(i + 1) % 2 for i in range(len(cfg.text))])
    return inputs


def run(cfg: DictConfig, interrupts: Sequence[int] = ()) -> Path:
    """Everything the command does; returns the output folder. ``interrupts``: as :func:`writing_one_run`."""
    import torch  # here, not at the top: --help needs none, and a Ctrl-C in its seconds of loading is one line

    validate(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    inputs = tokenized_inputs(cfg)
    out = Path(str(cfg.out))
    with writing_one_run(out, cfg.overwrite, interrupts) as removed:
        written = write_outputs(cfg, model, inputs, out)
    for line in removed_lines(removed, "run"):
        print(line)
    print("wrote " + ", ".join(str(path) for path in written))
    return out


def write_outputs(
    cfg: DictConfig, model: torch.nn.Module, inputs: dict[str, torch.Tensor], out: Path
) -> list[Path]:
    """The pictures, report and diff of :func:`run` written to ``out`` (which exists), the summaries printed;
    returns the files written."""
    from adls_lightning.graph import capture, diff, draw, remove_dropout_without_rewire, run_passes
    from adls_lightning.graph.node_report import report_rows, summarise, write_csv

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
    written.append(out / "remove_dropout_error.txt")
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
    return written


def guarded_main(
    hydra_main: Callable[[], Any], config_name: str, check: Callable[[Any], None]
) -> Callable[[], Any]:
    """Wrap a ``@hydra.main`` function so the command line's config is checked before Hydra runs anything.

    Hydra instantiates ``hydra.callbacks`` (and sets up its logging) before the task starts, so the config is
    composed here first, with the same files and overrides, and refused in one line (exit code 2) when one of its
    ``_target_`` is outside the allowed ones (:func:`~adls_lightning.build.check_config_targets`, the check
    ``train.py``'s pre-flight makes) or when ``check(cfg)`` (the command's own keys) raises a ConfigError.
    ``--help``, ``--cfg`` and Hydra's other informational flags go straight to Hydra.
    """

    @functools.wraps(hydra_main)
    def checked_main() -> Any:
        from hydra import compose, initialize_config_dir
        from hydra._internal.utils import get_args_parser  # the parser @hydra.main itself uses
        from hydra.errors import HydraException

        from adls_lightning.build import check_config_targets

        args, _ = get_args_parser().parse_known_args()
        if not informational_flags(args):
            with refusing_in_one_line():
                if args.multirun:
                    raise ConfigError("--multirun: this command runs once; give one value per key")
                if args.config_dir is not None or args.config_path is not None:
                    raise ConfigError(
                        "--config-dir/--config-path: this command reads the project's conf/ only"
                    )
                with initialize_config_dir(config_dir=str(CONF_DIR)):
                    try:
                        cfg = compose(
                            args.config_name or config_name, args.overrides, return_hydra_config=True
                        )
                    except HydraException as err:
                        if not str(err).startswith("Could not override"):
                            raise
                        # a key the command does not have: Hydra's line, and the keys it has
                        keys = ", ".join(k for k in compose(args.config_name or config_name) if k != "hydra")
                        raise ConfigError(f"{str(err).splitlines()[0]} (valid keys: {keys})") from None
                check_config_targets(cfg)
                # ${hydra:runtime.choices.model} (the default out) resolves against the composed Hydra node
                HydraConfig.instance().set_config(copy.deepcopy(cfg))  # (it makes what it is given read-only)
                try:
                    check(cfg)
                finally:
                    HydraConfig.instance().cfg = None
        return hydra_main()

    return checked_main


def task(cfg: DictConfig) -> None:
    with noting_interrupts() as interrupts:
        try:
            run(cfg, interrupts)
        except ConfigError as err:
            exit_with(str(err))
        except BaseException:
            if not interrupts:
                raise
            # writing_one_run has put out= back as it was
            exit_interrupted(f"out={cfg.out} is as it was before this run; run the command again")


guarded_task = guarded_main(
    # No version_base: Hydra 1.4 deprecates the parameter (a warning on every run); conf/graph.yaml sets what
    # the run folder and working directory are
    hydra.main(
        config_path=str(CONF_DIR),
        config_name="graph",
        execution_whitelist=hydra_execution_whitelist(),
    )(task),
    "graph",
    validate,
)


def main() -> Any:
    """``python -m adls_lightning.graph``: :func:`task` under Hydra, its config checked first (:func:`guarded_main`)."""
    try:
        return guarded_task()
    except KeyboardInterrupt:  # while the command starts: before anything is written
        exit_interrupted("nothing was written; run the command again")


if __name__ == "__main__":
    main()
