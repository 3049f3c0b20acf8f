"""Quantization as a Lightning callback: QAT (train the quantized model) or PTQ (quantize after training); the
method (round to nearest, SmoothQuant, GPTQ, LSQ) is a strategy of the callback (:mod:`.quant_methods`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from adls_lightning.callbacks.calibration import CalibrationSettings, model_forward
from adls_lightning.callbacks.evaluated_model import save_evaluated_model
from adls_lightning.callbacks.pruning import StructuredPruning
from adls_lightning.callbacks.quant_methods import QuantMethod, choose_method, read_method_settings
from adls_lightning.compression_record import merge_into, quantization_record
from adls_lightning.data.tasks import DEFAULT_MAIN_METRIC
from adls_lightning.errors import ConfigError
from adls_lightning.lora import merge_before_compression
from adls_lightning.quant import (
    QuantRecipe,
    check_recipe_fits,
    quantization_report,
    quantize_model,
    quantized_layers,
    to_recipe,
)
from adls_lightning.quant.gptq import GPTQConfig
from adls_lightning.quant.smoothquant import SmoothQuantSettings
from adls_lightning.registry import import_plugins

log = logging.getLogger(__name__)

_EVALUATION_FNS = (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING)


class QuantizationCallback(L.Callback):
    """Swaps the model's linear layers for fake-quantized ones (:func:`adls_lightning.quant.quantize_model`).

    * ``mode="qat"``: quantizes in :meth:`setup`, before checkpoint restore and optimizer creation, so
      training sees quantized forward passes, a resumed run comes back quantized, and the optimizer
      holds the right parameters. With LoRA the adapters train over the quantized, frozen base
      layers; ``train_base=True`` also unfreezes the quantized layers' weights and biases (full QAT).
      Without LoRA every parameter trains anyway.
    * ``mode="ptq"``: training runs at full precision; the model is quantized in :meth:`setup` of the
      first validation/test run after fitting (``trainer.validate(ckpt_path="best")``), or of an
      evaluation-only run. Full-precision checkpoints load into the quantized layers.
      ``ptq/val_acc_before`` is the full-precision ``monitor`` score of the evaluated weights: the
      score recorded in the loaded checkpoint when it is a ``ModelCheckpoint`` best checkpoint
      monitoring it, or the last validation during fit when the in-memory weights are evaluated
      (otherwise it is not reported). ``ptq/val_acc_after`` is the quantized validation score.

    The method is a strategy chosen from the settings (:func:`~adls_lightning.callbacks.quant_methods.choose_method`:
    round to nearest, SmoothQuant, GPTQ or LSQ, in :attr:`method`); this class owns the hooks and their timing.

    :meth:`report` returns ``quant/avg_weight_bits``, ``quant/avg_act_bits``, ``quant/weight_bytes``,
    ``quant/layers`` and, for PTQ, ``ptq/val_acc_before``/``ptq/val_acc_after``.

    Args:
        config: a typed recipe (:class:`~adls_lightning.quant.QuantRecipe`, or a
            :class:`~adls_lightning.quant.LayerRecipe` for every layer, e.g. built by Hydra from ``_target_``
            leaves), a MASE-style dict, or the path of a lab config file (``.toml``/``.yaml``/``.json``; a whole
            MASE config gives its ``[passes.quantize]``), converted by :func:`adls_lightning.quant.to_recipe`.
        mode: ``"qat"`` or ``"ptq"``.
        train_base: QAT only: train the quantized layers' weights too, not just LoRA adapters.
        monitor: the validation metric reported as PTQ accuracy.
        plugins: modules imported first so that the formats they register can be named in ``config``
            (``docs/extending.md``); they must be allowed by ``$ADLS_EXTRA_TARGETS``.
        calibration: ``{batches: N}``: before evaluation (PTQ) or training (QAT), run N training batches through
            the model so that static activation scales (``scaled_integer`` with ``granularity: tensor`` or
            ``embedding``) observe their ranges; 0 = none (they measure each tensor instead). A resumed run keeps
            its ranges.
        smoothquant: ``{alpha: A, scope: norm_fed|all}``: before calibration, SmoothQuant's per-channel factors
            with migration strength A from the calibration batches, for the layers a LayerNorm feeds (the paper's)
            or for all (:mod:`adls_lightning.quant.smoothquant`); alpha null = off.
        gptq: PTQ only: ``{batches, damp, act_order, block_size}`` (:class:`~adls_lightning.quant.gptq.GPTQConfig`)
            to choose the quantized weights by GPTQ from that many training batches, before evaluation; null (or
            false) = round to nearest.

    Raises:
        ConfigError: bad mode or config (checked here, before training starts).

    Example:
        .. code-block:: python

            cb = QuantizationCallback({"by": "type", "linear": {"config": {"name": "integer",
                "data_in_width": 8, "data_in_frac_width": 4, "weight_width": 8, "weight_frac_width": 4}}})
            L.Trainer(callbacks=[cb]).fit(module)
    """

    def __init__(
        self,
        config: QuantRecipe | Mapping[str, Any] | str | None = None,
        mode: str = "qat",
        train_base: bool = False,
        monitor: str = DEFAULT_MAIN_METRIC,
        plugins: Sequence[str] | None = None,
        calibration: CalibrationSettings | None = None,
        gptq: GPTQConfig | None = None,
        smoothquant: SmoothQuantSettings | None = None,
    ) -> None:
        # each setting's type is checked in the pre-flight against these annotations (adls_lightning.typed_settings)
        import_plugins(plugins, "quant.plugins")
        settings = read_method_settings(mode, calibration, gptq, smoothquant)
        if not isinstance(train_base, bool):
            raise ConfigError(f"quant.train_base={train_base!r}: must be true or false")
        if train_base and mode != "qat":
            raise ConfigError("quant.train_base=true: only applies to quant.mode=qat (PTQ does not train)")
        self.recipe: QuantRecipe = to_recipe(config, key="quant.config")
        #: the method's strategy (:func:`~adls_lightning.callbacks.quant_methods.choose_method`)
        self.method: QuantMethod = choose_method(settings, self.recipe)
        self.calibrated = False
        self.mode = mode
        self.train_base = train_base
        self.monitor = monitor
        self.quantized = False
        self.val_acc_before: float | None = None
        self.val_acc_after: float | None = None
        self._in_memory_score: float | None = None
        self._report: dict[str, float] = {}
        #: QAT after structured pruning: quantized at fit start, once the heads and neurons are gone
        self._after_structure: list[StructuredPruning] = []
        self._reload_refusal: Any = None

    # the method's settings, read by the sensitivity tool (adls_lightning.quant.sensitivity)
    @property
    def calibration_batches(self) -> int:
        return self.method.settings.calibration_batches

    @property
    def gptq(self) -> GPTQConfig | None:
        return self.method.settings.gptq

    @property
    def smoothquant_alpha(self) -> float | None:
        return self.method.settings.smoothquant_alpha

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.quantized:
            return
        if self.mode == "ptq" and trainer.state.fn not in _EVALUATION_FNS:
            # quantized after the fit: a recipe that cannot fit the model's layers (a group size that does not
            # divide a layer's input size) is refused now, before any training step or checkpoint
            check_recipe_fits(getattr(pl_module, "model", pl_module), self.recipe, key=self.recipe.key)
            return
        if self.mode == "ptq":
            # The in-memory weights' full-precision score, in case no checkpoint is loaded (the
            # checkpoint path is only known after setup).
            self._in_memory_score = _as_float(trainer.callback_metrics.get(self.monitor))
        structured = [cb for cb in trainer.callbacks if isinstance(cb, StructuredPruning) and not cb.applied]
        if structured and self.mode == "qat":
            if trainer.state.fn != TrainerFn.FITTING:
                raise ConfigError(_STRUCTURED_QAT_RELOAD)
            # structured pruning slices plain linear layers at fit start: the quantized layers come after. A
            # resumed checkpoint (known only after setup) would hold them already: refused when it loads
            self._after_structure = structured
            self._reload_refusal = pl_module.register_load_state_dict_pre_hook(_refuse_quantized_state)
            return
        self.quantize(pl_module)

    def quantize(self, pl_module: L.LightningModule) -> None:
        """Swap the layers of ``pl_module.model`` (or ``pl_module`` itself) now."""
        merge_before_compression(pl_module)
        model = getattr(pl_module, "model", pl_module)
        names = quantize_model(model, self.recipe)
        self.method.check_quantized(model)
        if self.train_base:
            for layer in quantized_layers(model):
                layer.linear.requires_grad_(True)
        self.quantized = True
        self._report = quantization_report(model)
        log.info(
            "Quantized %d linear layers (%s): %.2f weight bits, %.2f activation bits on average",
            len(names),
            self.mode,
            self._report["quant/avg_weight_bits"],
            self._report["quant/avg_act_bits"],
        )

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._after_structure:
            for pruning in self._after_structure:
                pruning.apply_at_start(trainer, pl_module)
            self._after_structure = []
            if self._reload_refusal is not None:
                self._reload_refusal.remove()
                self._reload_refusal = None
            self.quantize(pl_module)
            # the optimizer (rebuilt by the pruning for the sliced weights) takes the quantizers' parameters (LSQ)
            trainer.strategy.setup_optimizers(trainer)
        self._prepare(trainer, pl_module)  # QAT: ranges from the weights training starts from

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prepare(trainer, pl_module)  # a test-only evaluation

    def _prepare(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Once, with the evaluated (PTQ) or starting (QAT) weights in place: the method's preparation from training
        batches (:meth:`~adls_lightning.callbacks.quant_methods.QuantMethod.prepare`)."""
        if self.calibrated or not self.quantized:
            return
        self.calibrated = True
        datamodule = trainer.datamodule
        if self.method.needs_data and datamodule is None:
            log.warning(
                "quant.calibration / quant.gptq: no datamodule to draw training batches from; skipped"
            )
            return
        batches = datamodule.train_dataloader if self.method.needs_data else None
        # Lightning evaluates under inference mode: state made there (factors, fixed grids) would be inference
        # tensors that a later checkpoint load cannot write into
        with torch.inference_mode(False), torch.no_grad():
            self.method.prepare(pl_module, batches, model_forward(pl_module))

    @override
    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """PTQ: the checkpoint's own ``ModelCheckpoint`` state holds its full-precision score when it is the best one."""
        if self.mode != "ptq" or trainer.state.fn != TrainerFn.VALIDATING or self.val_acc_before is not None:
            return
        path = Path(str(trainer.ckpt_path))
        for state in (checkpoint.get("callbacks") or {}).values():
            if (
                isinstance(state, dict)
                and state.get("monitor") == self.monitor
                and state.get("best_model_score") is not None
                and Path(str(state.get("best_model_path"))).name == path.name
            ):
                self.val_acc_before = _as_float(state["best_model_score"])
                return

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prepare(trainer, pl_module)  # PTQ: the evaluated weights are loaded by now
        if self.mode != "ptq" or trainer.state.fn != TrainerFn.VALIDATING or self.val_acc_before is not None:
            return
        if not trainer.ckpt_path:  # the in-memory weights, last validated at full precision during fit
            self.val_acc_before = self._in_memory_score
        if self.val_acc_before is None:
            log.warning(
                "PTQ: the full-precision %s of these weights is unknown; ptq/val_acc_before not reported",
                self.monitor,
            )

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (
            self.mode == "ptq"
            and self.quantized
            and trainer.state.fn == TrainerFn.VALIDATING
            and self.monitor in trainer.callback_metrics
        ):
            self.val_acc_after = float(trainer.callback_metrics[self.monitor])

    @override
    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """The quantization record (:mod:`adls_lightning.compression_record`): what a reader of the checkpoint
        needs to rebuild the quantized layers the state belongs to."""
        model = getattr(pl_module, "model", pl_module)
        record = quantization_record(model, self.recipe, self.mode, **self.method.record())
        merge_into(checkpoint, quantization=record)

    def compressed_at_evaluation(self, trainer: L.Trainer) -> str | None:
        """PTQ: the evaluated model (quantized, calibrated, GPTQ's weights, SmoothQuant's factors: all made at
        evaluation, after the fit's checkpoints) is made here (:mod:`~adls_lightning.callbacks.evaluated_model`)."""
        return "PTQ" if self.mode == "ptq" and self.quantized else None

    @override
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """PTQ: the evaluated model saved with its record beside the fit's checkpoints, the checkpoint to export."""
        save_evaluated_model(trainer, self)

    def report(self) -> dict[str, float]:
        """Bit widths and storage of the quantized model, and for PTQ the accuracy before/after."""
        out = dict(self._report)
        # named after the monitored metric: ptq/val_acc_before on IMDb, ptq/val_pearson_before on STS-B
        name = self.monitor.replace("/", "_")
        if self.val_acc_before is not None:
            out[f"ptq/{name}_before"] = self.val_acc_before
        if self.val_acc_after is not None:
            out[f"ptq/{name}_after"] = self.val_acc_after
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "quantized": self.quantized,
            "val_acc_before": self.val_acc_before,
            "val_acc_after": self.val_acc_after,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("mode", self.mode) != self.mode:
            log.warning(
                "Checkpoint was made with quant.mode=%s; continuing with %s", state_dict["mode"], self.mode
            )
        # Evaluating a checkpoint also restores callback state: keep what this run has measured.
        for key in ("val_acc_before", "val_acc_after"):
            if state_dict.get(key) is not None and getattr(self, key) is None:
                setattr(self, key, state_dict[key])


_STRUCTURED_QAT_RELOAD = (
    "prune.structured with quant.mode=qat: a checkpoint of such a run is not loaded into train.py again (resume or "
    "ckpt_path=): its quantized layers have the pruned sizes, which no model has before it loads; export it "
    "(python -m adls_lightning.export ckpt=...), or fine-tune it with init_ckpt= and without quant="
)


def _refuse_quantized_state(
    module: torch.nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any
) -> None:
    if any("_quantizer." in key for key in state_dict):
        raise ConfigError(_STRUCTURED_QAT_RELOAD)


def _as_float(value: Any) -> float | None:
    return None if value is None else float(value)
