"""Define-by-run search spaces: callables ``space(trial) -> {Hydra override key: value}``.

The sweeper (``hydra.sweeper.search_space``) calls the space once per trial, after ``study.ask()``; the space
suggests Optuna parameters (which may depend on earlier ones: the square linears exist only for the chosen number
of layers) and turns them into the overrides of that trial's job. A space rejects an impossible combination by
raising ``optuna.TrialPruned`` with the reason; the sweeper records it as a pruned trial without running it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optuna

from adls_lightning.errors import ConfigError, did_you_mean
from adls_lightning.registry import import_plugins

if TYPE_CHECKING:
    from torch import nn

# The model libraries (torch, transformers: seconds to import) are imported where a space samples or measures a
# model, not with this module: the pre-flight check builds the configured space to check its choices, and a search
# refused there (a bad value, an empty choice list) should not pay for them.

LAYER_CHOICES = ("linear", "identity")
# Knobs of the searched architecture (arguments of adls_lightning.nas.build_nas_bert), in the order they are sampled.
ARCH_KNOBS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size")


def _check_choices(
    key: str, choices: Any, valid: Sequence[Any] | None = None, positive_ints: bool = False
) -> list[Any]:
    """The choices as a list. Raises ConfigError (naming the key) unless non-empty and valid."""
    choices = list(choices) if isinstance(choices, Sequence) and not isinstance(choices, str) else None
    if not choices:
        raise ConfigError(f"hydra.sweeper.search_space.{key}: must be a non-empty list of choices")
    if valid is not None and not set(choices) <= set(valid):
        raise ConfigError(f"hydra.sweeper.search_space.{key}={choices}: choices must be among {list(valid)}")
    if positive_ints and not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in choices):
        raise ConfigError(f"hydra.sweeper.search_space.{key}={choices}: choices must be positive integers")
    return choices


class NasSpace:
    """Lab 2's NAS space over :func:`adls_lightning.nas.build_nas_bert`.

    Parameters (Optuna names): the four ``BertConfig`` knobs, then, for each square linear of the chosen
    architecture (its module name), ``linear`` or ``identity``. Architectures transformers cannot build
    (hidden size not a multiple of the heads) are rejected with the reason.

    Args:
        num_hidden_layers: choices for the number of transformer layers.
        num_attention_heads: choices for the heads per layer.
        hidden_size: choices for the hidden width.
        intermediate_size: choices for the feed-forward width.
        layer_choices: what each square linear may become (``linear``, ``identity``).
        target: config key of the model builder whose arguments the overrides set.
    """

    def __init__(
        self,
        num_hidden_layers: Sequence[int],
        num_attention_heads: Sequence[int],
        hidden_size: Sequence[int],
        intermediate_size: Sequence[int],
        layer_choices: Sequence[str] = LAYER_CHOICES,
        target: str = "model.backbone",
    ) -> None:
        given = dict(
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
        )
        self.knobs = {knob: _check_choices(knob, given[knob], positive_ints=True) for knob in ARCH_KNOBS}
        self.layer_choices = _check_choices("layer_choices", layer_choices, LAYER_CHOICES)
        self.target = target

    def __call__(self, trial: optuna.Trial) -> dict[str, Any]:
        from adls_lightning.nas import square_linear_names

        arch = {knob: trial.suggest_categorical(knob, choices) for knob, choices in self.knobs.items()}
        try:
            squares = square_linear_names(**arch)
        except ConfigError as err:
            raise optuna.TrialPruned(f"rejected architecture: {err}") from None
        identities = [
            name for name in squares if trial.suggest_categorical(name, self.layer_choices) == "identity"
        ]
        overrides = {f"{self.target}.{knob}": value for knob, value in arch.items()}
        overrides[f"{self.target}.identity_layers"] = identities
        return overrides


FULL_PRECISION = "fp32"
ALL_FORMATS = "all"


def _precision_formats(precision: str | None, formats: list[str]) -> list[str]:
    """The formats of one ``search.precision``: fp32 and that format, or every format for ``all`` / None.

    Raises:
        ConfigError: ``precision`` is none of the formats.
    """
    if precision in (None, ALL_FORMATS):
        return formats
    if precision == FULL_PRECISION or precision not in formats:
        valid = [f for f in formats if f != FULL_PRECISION] + [ALL_FORMATS]
        raise ConfigError(
            f"search.precision={precision}: not a searchable format (valid: {', '.join(valid)})"
        )
    return [f for f in (FULL_PRECISION, precision) if f in formats]


#: ``search_space.points`` value searching every point kind of the model's family.
ALL_POINTS = "all"


class MixedPrecisionSpace:
    """Lab 3's mixed-precision space: per linear layer (and, with ``points``, per encoder point: attention's Q·Kᵀ
    and P·V, softmax, GELU, LayerNorm, residual adds) a number format and that format's widths.

    Parameters (Optuna names): ``<layer>/format`` (only when more than one format is used), then for a
    quantized layer ``<layer>/<format>.<parameter>`` for each parameter of the format (e.g. ``width``,
    ``frac_width``); the names carry the format because each format has its own choices. A layer's format and
    widths apply to the operands in ``slots`` (input, weight and bias by default). Combinations the format
    rejects (checked by building its quantizer), and block sizes that do not tile a layer's
    dimension, are rejected with the reason before anything is trained.

    The overrides add one :class:`~adls_lightning.quant.LayerRecipe` entry per quantized layer under
    ``target.layers`` (the quantization callback's :class:`~adls_lightning.quant.QuantRecipe`), e.g.
    ``++quant.config.layers.classifier={data_in: {format: integer, params: {width: 8}}, weight: ..., bias: ...}``;
    full-precision layers get none (they fall to the recipe's ``default``, no quantization).

    A searched point (:mod:`adls_lightning.quant.points`) is one more name with the same parameters
    (``bert.encoder.layer.0.attention.self.softmax/format``...) and an entry under ``target.layers`` by its name;
    its format's slots apply to the operands its kind has (a matmul's ``data_in`` and ``weight``, a LayerNorm's
    ``data_in``, γ and β, a softmax's, GELU's or add's ``data_in``: both summands).

    Args:
        backbone: the model being quantized (``${model.backbone}``: built once in the sweeper, cached in-process);
            its linear layers, named as the quantization config names them, are the searched layers.
        formats: ``{format: {params: {parameter: [choices]}, slots: [operands]}}``; ``fp32`` = full precision.
            Each entry is read over the format's own default (``Quantizer.search_space``: a given ``params`` or
            ``slots`` replaces the default's). None = ``fp32`` and every registered format that has a default.
        use: the formats searched (e.g. ``[fp32, integer, log]``); None = as ``precision`` says.
        layers: a regular expression a layer name must fully match to be searched; None = every linear layer. It
            filters the searched points' names too (``points``), so one expression can name layers and points.
        target: config key of the quantization config the overrides extend.
        plugins: modules to import first, so the formats they register can be searched (``quant.plugins``).
        precision: ``search.precision``, used when ``use`` is None: a format name searches ``[fp32, <format>]``
            (one curve of Lab 3), ``all`` (or None) every format of ``formats``.
        points: the point kinds searched beside the linear layers (chop's keys: ``matmul``/``bmm``, ``softmax``,
            ``gelu``, ``layer_norm``, ``add``), or ``all`` for every kind the model's family has; None = none.
    """

    def __init__(
        self,
        backbone: nn.Module,
        formats: Mapping[str, Mapping[str, Any] | None] | None = None,
        use: Sequence[str] | None = None,
        layers: str | None = None,
        target: str = "quant.config",
        plugins: Sequence[str] | None = None,
        precision: str | None = None,
        points: Sequence[str] | str | None = None,
    ) -> None:
        from adls_lightning.quant.quantizers import QUANTIZERS
        from adls_lightning.quant.transform import find_linear_layers

        import_plugins(plugins, "hydra.sweeper.search_space.plugins")
        if formats is None:
            formats = {FULL_PRECISION: {}} | {
                name: {} for name, cls in QUANTIZERS.items() if cls.search_space is not None
            }
        if use is None:
            use = _precision_formats(precision, list(formats))
        use = _check_choices("use", use, list(formats))
        # every given format is checked, used or not: its entries are static config, so a misspelt one is
        # refused before a study exists, not left to prune every trial
        spaces = {name: _format_space(name, given) for name, given in formats.items()}
        self.formats: dict[str, tuple[dict[str, list[Any]], list[str]]] = {
            name: spaces[name] for name in use if name != FULL_PRECISION
        }
        self.use = use
        linears = {
            layer.name: getattr(layer.module, "linear", layer.module)
            for layer in find_linear_layers(backbone)
        }
        self.layers = [n for n in linears if layers is None or re.fullmatch(layers, n)]
        #: the searched points by name (searched after the linear layers, in module order)
        self.points = {
            n: p
            for n, p in _searched_points(backbone, points).items()
            if layers is None or re.fullmatch(layers, n)
        }
        if not self.layers and not self.points:
            what = "linear layer or searched point" if points is not None else "linear layer"
            raise ConfigError(
                f"hydra.sweeper.search_space.layers={layers}: matches no {what} (e.g. {next(iter(linears))})"
            )
        self.linears = {n: m for n, m in linears.items() if n in self.layers}
        self.target = target

    def __call__(self, trial: optuna.Trial) -> dict[str, Any]:
        from adls_lightning.quant.quantizers import QUANTIZERS
        from adls_lightning.quant.recipe import OperandRecipe
        from adls_lightning.quant.transform import dimension_problem

        overrides: dict[str, Any] = {}
        for layer in self.layers:
            fmt = trial.suggest_categorical(f"{layer}/format", self.use) if len(self.use) > 1 else self.use[0]
            if fmt == FULL_PRECISION:
                continue
            params, slots = self.formats[fmt]
            values = {
                p: trial.suggest_categorical(f"{layer}/{fmt}.{p}", choices) for p, choices in params.items()
            }
            try:  # builds (and so checks) the quantizer that the layer's slots share
                operand = OperandRecipe(fmt, values)
            except ConfigError as err:
                raise optuna.TrialPruned(f"rejected {layer}: {fmt} {err}") from None
            # a format without searched parameters quantizes its own default operands
            slots = slots if params else QUANTIZERS[fmt].slots
            found = dimension_problem(self.linears[layer], dict.fromkeys(slots, operand.build()))
            if found:
                raise optuna.TrialPruned(f"rejected {layer}: {fmt} {found[0]}: {found[1]}")
            overrides[f"++{self.target}.layers.{layer}"] = {
                slot: {"format": fmt, "params": values} for slot in slots
            }
        for name, point in self.points.items():
            entry = self._sample_point(trial, name, point)
            if entry:
                overrides[f"++{self.target}.layers.{name}"] = entry
        return overrides

    def _sample_point(self, trial: optuna.Trial, name: str, point: Any) -> dict[str, Any] | None:
        """One point's sampled entry (None: full precision); an impossible one prunes the trial."""
        from adls_lightning.quant.points import KIND_OPERANDS, point_dimension_problem
        from adls_lightning.quant.quantizers import QUANTIZERS
        from adls_lightning.quant.recipe import OperandRecipe

        fmt = trial.suggest_categorical(f"{name}/format", self.use) if len(self.use) > 1 else self.use[0]
        if fmt == FULL_PRECISION:
            return None
        params, slots = self.formats[fmt]
        values = {p: trial.suggest_categorical(f"{name}/{fmt}.{p}", choices) for p, choices in params.items()}
        try:
            operand = OperandRecipe(fmt, values)
        except ConfigError as err:
            raise optuna.TrialPruned(f"rejected {name}: {fmt} {err}") from None
        slots = [s for s in (slots if params else QUANTIZERS[fmt].slots) if s in KIND_OPERANDS[point.kind]]
        if not slots:  # e.g. a format quantizing only weights, on a softmax: nothing to quantize there
            return None
        found = point_dimension_problem(point, dict.fromkeys(slots, operand.build()))
        if found:
            raise optuna.TrialPruned(f"rejected {name}: {fmt} {found[0]}: {found[1]}")
        return {slot: {"format": fmt, "params": values} for slot in slots}


#: The keys of one ``formats`` entry.
FORMAT_SPACE_KEYS = ("params", "slots")


def _format_space(name: str, given: Mapping[str, Any] | None) -> tuple[dict[str, list[Any]], list[str]]:
    """One ``formats`` entry read over the format's own default space: ``(params, slots)``.

    Raises:
        ConfigError: an unknown format, an entry key other than ``params``/``slots``, a parameter the format does
            not take or a choice of the wrong type (the format's constructor decides, as for ``quant.config``),
            or an empty choice list; named by its key.
    """
    from adls_lightning.quant.linear import SLOTS
    from adls_lightning.quant.quantizers import QUANTIZERS
    from adls_lightning.quant.recipe import OperandRecipe

    key = f"hydra.sweeper.search_space.formats.{name}"
    if name != FULL_PRECISION and name not in QUANTIZERS:
        raise ConfigError(f"{key}: unknown format (valid: {FULL_PRECISION}, {', '.join(QUANTIZERS)})")
    given = given or {}
    if not isinstance(given, Mapping):
        raise ConfigError(
            f"{key}={given!r}: must be a mapping {{params: {{parameter: [choices]}}, slots: [...]}}"
        )
    for entry in given:
        if name == FULL_PRECISION:
            raise ConfigError(f"{key}.{entry}: unknown key; valid: none ({FULL_PRECISION} is full precision)")
        if entry not in FORMAT_SPACE_KEYS:
            close = did_you_mean(difflib.get_close_matches(str(entry), FORMAT_SPACE_KEYS))
            raise ConfigError(f"{key}.{entry}: unknown key; valid: {', '.join(FORMAT_SPACE_KEYS)}{close}")
    if name == FULL_PRECISION:
        return {}, []
    spec = {**(QUANTIZERS[name].search_space or {}), **given}
    given_params = spec.get("params") or {}
    if not isinstance(given_params, Mapping):
        raise ConfigError(f"{key}.params={given_params!r}: must be a mapping {{parameter: [choices]}}")
    params = {p: _check_choices(f"formats.{name}.params.{p}", choices) for p, choices in given_params.items()}
    # the names (with a close match) and each choice's type, as quant.config's check
    for p, choices in params.items():
        for choice in choices:
            OperandRecipe.check_settings(key, {"format": name, "params": {p: choice}})
    slots = _check_choices(f"formats.{name}.slots", spec.get("slots", SLOTS), SLOTS)
    return params, slots


def _searched_points(backbone: nn.Module, kinds: Sequence[str] | str | None) -> dict[str, Any]:
    """The points of ``backbone`` of the searched ``kinds`` by name (``bmm`` = ``matmul``; ``all`` = every kind the
    model's family has).

    Raises:
        ConfigError: an unknown kind, or one the model's family has no points of.
    """
    from adls_lightning.quant.points import FAMILY_KINDS, KIND_KEYS, find_points, why_unsupported

    if kinds is None:
        return {}
    found = find_points(backbone)
    family = found[0].family if found else "unknown"
    if kinds == ALL_POINTS:
        kinds = list(FAMILY_KINDS.get(family, ()))
        if not kinds:
            raise ConfigError(
                f"hydra.sweeper.search_space.points=all: the model (family {family!r}) has no points"
            )
    kinds = _check_choices("points", kinds, KIND_KEYS)
    wanted = {"matmul" if kind == "bmm" else kind for kind in kinds}
    for kind in sorted(wanted):
        if not any(p.kind == kind for p in found) or kind not in FAMILY_KINDS.get(family, ()):
            raise ConfigError(f"hydra.sweeper.search_space.points: {why_unsupported(family, kind)}")
    return {p.name: p for p in found if p.kind in wanted}
