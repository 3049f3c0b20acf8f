"""Quantization methods: the strategies of :class:`~adls_lightning.callbacks.quantization.QuantizationCallback`.

The callback owns the Lightning hooks and the timing (QAT quantizes before training, PTQ before evaluation); the
method, one class per entry of :data:`QUANT_METHODS`, chosen from the settings by :func:`choose_method`, owns what
differs between methods:

- :meth:`QuantMethod.check_quantized`: a check of the model just quantized (LSQ: calibrated activation ranges);
- :meth:`QuantMethod.prepare`: the one step before the weights train (QAT) or are evaluated (PTQ), from training
  batches: its own step (SmoothQuant's smoothing, GPTQ's weight solve), the static activation ranges
  (``quant.calibration``), then its learned state (LSQ's steps start from calibration);
- :meth:`QuantMethod.record`: what it adds to the checkpoint's quantization record
  (:func:`adls_lightning.compression_record.quantization_record`).

Methods: ``round_to_nearest`` (:class:`RoundToNearest`, every preset without the others), ``smoothquant``
(``quant.smoothquant.alpha``), ``gptq`` (``quant.gptq``), ``lsq`` (a recipe whose formats learn their steps,
``lsq: true``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from adls_lightning.callbacks.calibration import CalibrationSettings, calibration_batches
from adls_lightning.errors import ConfigError
from adls_lightning.quant import QuantRecipe, calibrate, init_learned_steps, quantized_layers
from adls_lightning.quant.gptq import GPTQConfig, gptq_quantize, put_weights
from adls_lightning.quant.recipe import OPERANDS
from adls_lightning.quant.smoothquant import Smoothed, SmoothQuantSettings, check_alpha, check_scope, smooth
from adls_lightning.registry import Registry
from adls_lightning.typed_settings import section

# the callback's logger: a run's log lines read as they did when the callback ran every method itself
log = logging.getLogger("adls_lightning.callbacks.quantization")

MODES = ("qat", "ptq")

#: the quantization methods by the name the record and the docs use
QUANT_METHODS: Registry[type[QuantMethod]] = Registry("quantization method")


@dataclasses.dataclass(frozen=True)
class MethodSettings:
    """The callback's settings that choose and drive a method, checked (:func:`read_method_settings`)."""

    mode: str
    calibration_batches: int
    gptq: GPTQConfig | None = None
    smoothquant_alpha: float | None = None
    smoothquant_scope: str = "norm_fed"


def read_method_settings(
    mode: str,
    calibration: CalibrationSettings | Mapping[str, Any] | None,
    gptq: GPTQConfig | Mapping[str, Any] | None,
    smoothquant: SmoothQuantSettings | Mapping[str, Any] | None,
) -> MethodSettings:
    """``quant.calibration``, ``quant.gptq`` and ``quant.smoothquant`` checked, each alone and together.

    Raises:
        ConfigError: a bad value or an unknown key (named), or settings that do not combine.
    """
    # a section given false is off, as null
    gptq = gptq if isinstance(gptq, GPTQConfig) else section(gptq, "quant.gptq")
    batches = calibration_batches(calibration, "quant.calibration")
    if gptq is not None:
        if mode != "ptq":
            raise ConfigError(
                "quant.gptq: GPTQ is post-training quantization; give quant.mode=ptq (or quant.gptq=null)"
            )
        if not isinstance(gptq, GPTQConfig):
            unknown = sorted(set(gptq) - {f.name for f in dataclasses.fields(GPTQConfig)})
            if unknown:
                raise ConfigError(
                    f"quant.gptq.{unknown[0]}: unknown key; valid: batches, damp, act_order, block_size"
                )
            gptq = GPTQConfig(**gptq)
    smoothquant = section(smoothquant, "quant.smoothquant") or {}
    unknown = sorted(set(smoothquant) - {"alpha", "scope"})
    if unknown:
        raise ConfigError(f"quant.smoothquant.{unknown[0]}: unknown key; valid: alpha, scope")
    alpha = smoothquant.get("alpha")
    alpha = None if alpha is None else check_alpha(alpha)
    scope = check_scope(smoothquant.get("scope", "norm_fed"))
    if alpha is not None and not batches:
        raise ConfigError(
            "quant.smoothquant.alpha: SmoothQuant's factors come from calibration batches; give "
            "quant.calibration.batches=N (N >= 1)"
        )
    if alpha is not None and gptq is not None:
        raise ConfigError(
            "quant.smoothquant.alpha with quant.gptq: not combined here; choose one (the other null)"
        )
    if mode not in MODES:
        raise ConfigError(f"quant.mode={mode!r}: must be one of {', '.join(MODES)}")
    return MethodSettings(mode, batches, gptq, alpha, scope)


def learns_steps(recipe: QuantRecipe) -> bool:
    """Whether any entry of ``recipe`` gives an operand a learned step (``lsq: true``)."""
    entries = [recipe.default, *recipe.layers.values(), *recipe.patterns.values()]
    entries += [getattr(recipe, kind) for kind in ("matmul", "bmm", "softmax", "gelu", "layer_norm", "add")]
    return any(
        bool(operand.params.get("lsq", False))
        for entry in entries
        if entry is not None
        for operand in (getattr(entry, name) for name in OPERANDS)
        if operand is not None
    )


def choose_method(settings: MethodSettings, recipe: QuantRecipe) -> QuantMethod:
    """The method the settings describe: GPTQ with ``quant.gptq``, SmoothQuant with ``quant.smoothquant.alpha``,
    LSQ for a recipe that learns steps, else round to nearest.

    Raises:
        ConfigError: LSQ with GPTQ or SmoothQuant (each decides the grid its own way).
    """
    lsq = learns_steps(recipe)
    if lsq and settings.gptq is not None:
        raise ConfigError(
            f"quant.gptq with lsq: true in {recipe.key}: GPTQ fixes the weights' grid after training and LSQ learns "
            "steps while training; choose one (quant.gptq=null, or a recipe without lsq)"
        )
    if lsq and settings.smoothquant_alpha is not None:
        raise ConfigError(
            f"quant.smoothquant.alpha with lsq: true in {recipe.key}: the smoothed layers' quantizers would keep "
            "their learned steps unstarted; choose one (quant.smoothquant.alpha=null, or a recipe without lsq)"
        )
    if settings.gptq is not None:
        name = "gptq"
    elif settings.smoothquant_alpha is not None:
        name = "smoothquant"
    else:
        name = "lsq" if lsq else "round_to_nearest"
    return QUANT_METHODS[name](settings)


def register_quant_method(cls: type[QuantMethod]) -> type[QuantMethod]:
    """Class decorator: ``cls`` in :data:`QUANT_METHODS` under its :attr:`~QuantMethod.name`."""
    return QUANT_METHODS.register(cls.name, cls)


Batches = Callable[[], Iterable[Any]]
Forward = Callable[[Mapping[str, Any]], Any]


class QuantMethod:
    """The steps every method shares, and the hooks a method overrides (:meth:`check_quantized`,
    :meth:`transform`, :meth:`start`, :meth:`record`, :attr:`needs_data`).

    Args:
        settings: the checked settings (:func:`read_method_settings`).
    """

    name: ClassVar[str]

    def __init__(self, settings: MethodSettings) -> None:
        self.settings = settings

    @property
    def needs_data(self) -> bool:
        """Whether :meth:`prepare` reads training batches."""
        return bool(self.settings.calibration_batches)

    def check_quantized(self, model: torch.nn.Module) -> None:
        """Refuse a model just quantized that this method cannot prepare."""

    def prepare(self, pl_module: torch.nn.Module, batches: Batches | None, forward: Forward) -> None:
        """Once, with the weights that train (QAT) or are evaluated (PTQ) in place: the method's own step, then the
        static ranges, then the learned state; not what a resumed checkpoint brought back. ``batches`` gives the
        training batches (None when :attr:`needs_data` is false)."""
        if batches is None:
            self.start(pl_module)
            return
        self.transform(pl_module, batches, forward)
        self.calibrate_ranges(pl_module, batches, forward)
        self.start(pl_module)

    def transform(self, pl_module: torch.nn.Module, batches: Batches, forward: Forward) -> None:
        """The method's own step before the ranges are calibrated (SmoothQuant's factors, GPTQ's weights)."""

    def calibrate_ranges(self, pl_module: torch.nn.Module, batches: Batches, forward: Forward) -> None:
        """The static activation ranges (``quant.calibration.batches``), unless a resumed checkpoint holds them."""
        from adls_lightning.quant.scaled import static_quantizers

        count = self.settings.calibration_batches
        static = static_quantizers(pl_module)  # per-tensor and per-embedding-channel ranges alike
        if count and static and not all(int(q.batches_observed) > 0 for q in static):
            run = calibrate(pl_module, batches(), forward, count)
            log.info("Calibrated %d activation scales on %d training batches", len(static), run)

    def start(self, pl_module: torch.nn.Module) -> None:
        """State the method learns while training, started after calibration (LSQ's steps)."""

    def record(self) -> dict[str, Any]:
        """The method's fields of the quantization record."""
        return {"smoothquant": None, "gptq": False, "calibrated": bool(self.settings.calibration_batches)}


@register_quant_method
class RoundToNearest(QuantMethod):
    """Each format rounds to its grid: the shared steps alone (static ranges calibrated when
    ``quant.calibration.batches`` is set)."""

    name = "round_to_nearest"


@register_quant_method
class SmoothQuant(QuantMethod):
    """SmoothQuant (Xiao et al. 2023): per-channel factors with migration strength ``quant.smoothquant.alpha`` from
    the calibration batches move activation outliers into the weights, before the ranges are calibrated."""

    name = "smoothquant"

    def transform(self, pl_module: torch.nn.Module, batches: Batches, forward: Forward) -> None:
        if any(isinstance(m, Smoothed) for m in pl_module.modules()):  # a resumed run's factors
            return
        alpha, scope = self.settings.smoothquant_alpha, self.settings.smoothquant_scope
        layers, run = smooth(pl_module, batches(), forward, self.settings.calibration_batches, alpha, scope)
        log.info(
            "SmoothQuant (alpha %g, %s) smoothed %d layers from %d training batches",
            alpha,
            scope,
            len(layers),
            run,
        )

    def record(self) -> dict[str, Any]:
        alpha, scope = self.settings.smoothquant_alpha, self.settings.smoothquant_scope
        return {**super().record(), "smoothquant": {"alpha": alpha, "scope": scope}}


@register_quant_method
class GPTQ(QuantMethod):
    """GPTQ (Frantar et al. 2023), post-training: the quantized weights chosen column by column from the Hessian of
    ``quant.gptq.batches`` training batches (:func:`adls_lightning.quant.gptq.gptq_quantize`)."""

    name = "gptq"

    @property
    def needs_data(self) -> bool:
        return True

    def transform(self, pl_module: torch.nn.Module, batches: Batches, forward: Forward) -> None:
        from adls_lightning.quant.scaled import scaled_quantizers

        if any(q.fixed_scale.numel() for q in scaled_quantizers(pl_module)):  # a resumed run's weights
            return
        assert self.settings.gptq is not None
        solutions, run = gptq_quantize(pl_module, batches(), forward, self.settings.gptq)
        log.info("GPTQ chose the weights of %d layers from %d training batches", len(solutions), run)
        # trainer.test(ckpt_path=...) reloads the float weights after validation: GPTQ's go back in each time
        pl_module.register_load_state_dict_post_hook(
            lambda module, incompatible: put_weights(module, solutions)
        )

    def record(self) -> dict[str, Any]:
        return {**super().record(), "gptq": True}


@register_quant_method
class LSQ(QuantMethod):
    """LSQ (Esser et al. 2019): formats with ``lsq: true`` learn their steps while training, each started from
    calibration: a weight's from its observer, an activation's from its calibrated range."""

    name = "lsq"

    def check_quantized(self, model: torch.nn.Module) -> None:
        if not self.settings.calibration_batches and any(
            layer.data_in_quantizer is not None and getattr(layer.data_in_quantizer, "lsq", False)
            for layer in quantized_layers(model)
        ):
            raise ConfigError(
                "quant.calibration.batches=0: LSQ activation steps (lsq: true on data_in) start from "
                "calibrated ranges; give quant.calibration.batches=N (N >= 1)"
            )

    def start(self, pl_module: torch.nn.Module) -> None:
        try:
            started = init_learned_steps(pl_module)
        except ValueError as err:
            raise ConfigError(f"quant.config: {err}") from None
        if started:
            log.info("LSQ: %d learned steps start from calibration", started)
