"""CompressionCallback: compression-aware fine-tuning (the labs' CompressionPipeline) inside one fit."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from adls_lightning.callbacks.pruning import PruningCallback, log_sparsity
from adls_lightning.callbacks.quantization import QuantizationCallback
from adls_lightning.callbacks.trainer_control import forget_best_checkpoints, set_max_epochs, validate_mid_fit
from adls_lightning.compression_record import merge_into, pruning_record, quantization_record
from adls_lightning.data.tasks import DEFAULT_MAIN_METRIC
from adls_lightning.distill import Distiller, attach_distiller, check_distillation, student_model
from adls_lightning.errors import ConfigError
from adls_lightning.lora import merge_before_compression
from adls_lightning.prune import Pruner
from adls_lightning.prune.masks import MaskSettings
from adls_lightning.quant import (
    QuantRecipe,
    check_recipe_fits,
    quantization_report,
    quantize_model,
    to_recipe,
)
from adls_lightning.typed_settings import section

PRUNE_KEYS = ("weight", "activation", "include", "exclude", "seed")


class CompressPruneSettings(TypedDict, total=False):
    """``compress.prune``: as :class:`~adls_lightning.callbacks.pruning.PruningCallback`'s arguments of the same names."""

    weight: MaskSettings | None
    activation: MaskSettings | None
    include: Sequence[str] | None
    exclude: Sequence[str] | None
    seed: int


def _plain(config: Any) -> Any:
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config)) if config else None
    return config  # a lab config file's path or a typed recipe (quant)


class CompressionCallback(L.Callback):
    """Train, compress (prune, then quantize the pruned weights), then keep training: all in one ``trainer.fit``.

    After ``at_epoch`` training epochs (at the end of epoch ``at_epoch - 1``), the callback records the monitored
    validation metric, applies the configured pruning and quantization, validates again right away, and lets the
    fit continue for ``post_epochs`` more epochs. It sets ``trainer.max_epochs = at_epoch + post_epochs`` in
    ``setup`` (before the optimizer and LR schedule are built), so ``compress.post_epochs=0`` on the command line
    means no post-compression training.

    Order: quantization wraps each ``nn.Linear`` in a ``QuantLinear`` that keeps the same layer (and the same
    ``nn.Parameter`` objects, so the optimizer carries on), then the pruning masks go on the wrapped layers.
    Masks are chosen from the full-precision weights and the forward computes ``quantize(mask * w)``: prune,
    then quantize the pruned weights (zeros stay exactly zero). Checkpoints saved before compression hold a
    different model, so the "best" checkpoint is forgotten at compression time and chosen among compressed ones.

    With ``distill`` the post-compression epochs learn from the model as it was just before compression (LoRA
    merged): a frozen copy in eval mode, the teacher of :class:`~adls_lightning.distill.Distiller`, which the module's
    ``training_step`` asks for its loss. The teacher is no model state and in no optimizer; its weights are this
    callback's state, so a fit resumed after the compression step distills from the same teacher.

    Args:
        at_epoch: Epochs of training before compressing (>= 1).
        post_epochs: Epochs of training after compressing (>= 0).
        quant: A quantization config for ``adls_lightning.quant.quantize_model`` (MASE style: ``by``,
            ``default``, ``linear: {config: {name: integer, ...}}``; a lab config file's path; or a typed
            :class:`~adls_lightning.quant.QuantRecipe`), or ``None`` for no quantization.
        prune: ``{weight, activation, include, exclude, seed}`` as for :class:`~adls_lightning.callbacks.pruning.PruningCallback`,
            or ``None`` for no pruning.
        monitor: The validation metric reported before/after compression and at the end.
        distill: Distil the post-compression epochs from the model before compression.
        distill_temperature: ``T`` of the softened distributions (> 0).
        distill_weight: The distillation term's share of the loss, in [0, 1] (0: the task loss alone).

    Raises:
        ConfigError: On invalid settings, at construction time.
    """

    def __init__(
        self,
        at_epoch: int = 1,
        post_epochs: int = 1,
        quant: Mapping[str, Any] | str | QuantRecipe | None = None,
        prune: CompressPruneSettings | None = None,
        monitor: str = DEFAULT_MAIN_METRIC,
        distill: bool = False,
        distill_temperature: float = 2.0,
        distill_weight: float = 0.5,
    ) -> None:
        if isinstance(at_epoch, bool) or not isinstance(at_epoch, int) or at_epoch < 1:
            raise ConfigError(
                f"compress.at_epoch={at_epoch!r}: must be an integer >= 1 (to compress before training use the "
                "quant= and prune= groups)"
            )
        if isinstance(post_epochs, bool) or not isinstance(post_epochs, int) or post_epochs < 0:
            raise ConfigError(f"compress.post_epochs={post_epochs!r}: must be an integer >= 0")
        # each setting's type is checked in the pre-flight against these annotations (adls_lightning.typed_settings);
        # a section given false is off, as null
        quant, prune = _plain(None if quant is False else quant), _plain(section(prune, "compress.prune"))
        if not quant and not prune:
            raise ConfigError(
                "compress.quant and compress.prune are both empty: nothing to compress (use compress=none)"
            )
        self.pruner = None
        if prune:
            unknown = sorted(set(prune) - set(PRUNE_KEYS))
            if unknown:
                raise ConfigError(
                    f"compress.prune.{unknown[0]}: unknown key; valid keys are {', '.join(PRUNE_KEYS)}"
                )
            for part in ("weight", "activation"):
                if part in prune:
                    prune[part] = section(prune[part], f"compress.prune.{part}")
            self.pruner = Pruner(**prune, key="compress.prune")
            if self.pruner.learns_scores:
                # compress= prunes once, at_epoch epochs in; movement learns its masks over the training steps
                raise ConfigError(
                    f"compress.prune.weight.method={self.pruner.weight.method}: learns its masks while training, "
                    "compress= prunes once; prune with prune= instead (e.g. prune=movement_0.9)"
                )
            if self.pruner.needs_calibration:
                # the compression step draws no calibration batches (yet): refuse before training, not at_epoch later
                raise ConfigError(
                    f"compress.prune.weight.method={self.pruner.weight.method}: one-shot methods need calibration "
                    "batches, which compress= does not draw; prune with prune= instead (e.g. prune=wanda_0.5)"
                )
        if not isinstance(distill, bool):
            raise ConfigError(f"compress.distill={distill!r}: must be true or false")
        check_distillation(distill_temperature, distill_weight)
        if distill and post_epochs == 0:
            raise ConfigError(
                "compress.distill=true: compress.post_epochs=0 trains nothing after compression to distill into"
            )
        self.distill = distill
        self.distill_temperature = distill_temperature
        self.distill_weight = distill_weight
        # Parse now (no model needed) so a bad config fails before training, not after at_epoch epochs.
        self.quant = to_recipe(quant, key="compress.quant") if quant else None
        self.at_epoch = at_epoch
        self.post_epochs = post_epochs
        self.monitor = monitor
        self.compressed = False
        self.before: float | None = None
        self.after: float | None = None
        self.final: float | None = None
        self.act_sparsity: float | None = None
        self._module: L.LightningModule | None = None
        self._load_hooks: list[Any] = []
        self.distiller: Distiller | None = None
        self._teacher_model: torch.nn.Module | None = (
            None  # the uncompressed model a resumed teacher loads into
        )

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.pruner is not None and any(isinstance(cb, PruningCallback) for cb in trainer.callbacks):
            raise ConfigError(
                "compress.prune and prune= are both set: prune either before training or in compress"
            )
        if self.quant is not None and any(isinstance(cb, QuantizationCallback) for cb in trainer.callbacks):
            # compress would quantize the layers quant= quantized (or will) again, with its own recipe
            raise ConfigError(
                "compress.quant and quant= are both set: quantize either from the start (quant=) or in compress"
            )
        self._module = pl_module
        merge_before_compression(pl_module)
        if self.quant is not None and not self.compressed:
            # quantized at_epoch epochs in: a recipe that cannot fit the layers is refused before the first step
            check_recipe_fits(student_model(pl_module), self.quant, key=self.quant.key)
        if self.pruner is not None:
            # Fixed structure (placeholder masks) before the optimizer is built: see Pruner.register_placeholders.
            self.pruner.register_placeholders(pl_module)
        if not self._load_hooks:
            self._load_hooks = [
                pl_module.register_load_state_dict_pre_hook(self._before_model_load),
                pl_module.register_load_state_dict_post_hook(self._after_model_load),
            ]
        if stage == "fit":
            epochs = self.at_epoch + self.post_epochs
            previous = set_max_epochs(trainer, epochs)
            if previous != epochs:
                rank_zero_info(
                    f"compress: trainer.max_epochs {previous} -> {epochs} "
                    f"(at_epoch {self.at_epoch} + post_epochs {self.post_epochs})"
                )

    def _compress(self, pl_module: L.LightningModule) -> None:
        """Applies quantization (module swap) and then pruning masks on the wrapped layers."""
        if self.distill:
            # the model as it is now, before any compression: the teacher, or the structure a saved one loads into
            self._teacher_model = copy.deepcopy(student_model(pl_module))
        if self.quant is not None:
            quantize_model(student_model(pl_module), self.quant)
        if self.pruner is not None:
            self.pruner.prune(pl_module)
        self.compressed = True

    @override
    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """The quantization and pruning records (:mod:`adls_lightning.compression_record`); before ``at_epoch``
        the quantization is recorded as not applied yet (the checkpoint holds plain layers)."""
        parts: dict[str, Any] = {}
        if self.quant is not None:
            parts["quantization"] = quantization_record(student_model(pl_module), self.quant, "qat")
        if self.pruner is not None:
            parts["pruning"] = pruning_record(self.pruner)
        merge_into(checkpoint, **parts)

    def _before_model_load(
        self, module: torch.nn.Module, state_dict: Mapping, prefix: str, *args: Any
    ) -> None:
        """A checkpoint with keys the uncompressed model lacks (quantized layers) is compressed: compress first.

        Read from the weights because no public hook comes earlier: Lightning restores the model's weights before
        any callback's state (``restore_model`` then ``restore_callbacks``) and calls ``Callback.on_load_checkpoint``
        with the callbacks, so this callback's own ``compressed`` flag arrives after the weights must have fit. A
        ``load_state_dict`` pre-hook (public torch API) is the last point before they are loaded.
        """
        if self.compressed:
            return
        own = {prefix + key for key in module.state_dict(keep_vars=True)}

        def placeholder_pruned(key: str) -> bool:
            # the plain weight of a layer the pruning placeholders already wrap (an uncompressed checkpoint, e.g. an
            # init_ckpt of a fine-tuned run): the layer's own load hook takes it
            stem, _, leaf = key.rpartition(".")
            return f"{stem}.parametrizations.{leaf}.original" in own

        if all(key in own or placeholder_pruned(key) for key in state_dict):
            return
        self._compress(module)  # masks computed here are overwritten by the checkpoint's
        rank_zero_info(
            "compress: the checkpoint holds a compressed model; re-applied compression before loading"
        )

    def _after_model_load(self, module: torch.nn.Module, incompatible_keys: Any) -> None:
        """A prune-only compressed checkpoint has the same keys; its masks show that compression was applied."""
        if not self.compressed and self.pruner is not None and self.pruner.has_pruned_weights(module):
            if self.distill:
                # the structure a saved teacher loads into, copied before the activation hooks go on
                self._teacher_model = copy.deepcopy(student_model(module))
            self.pruner.attach_activation(module)
            self.compressed = True

    def _metric(self, trainer: L.Trainer) -> float | None:
        value = trainer.callback_metrics.get(self.monitor)
        return float(value) if value is not None else None

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.compressed or trainer.current_epoch + 1 != self.at_epoch:
            return
        self.before = self._metric(trainer)
        self._compress(pl_module)
        if self.pruner is not None:
            log_sparsity(trainer, self.pruner, pl_module, prefix="compress")
        if self.distill:
            self._start_distilling(pl_module, None)
        forget_best_checkpoints(trainer)
        validate_mid_fit(trainer)
        self.after = self._metric(trainer)
        rank_zero_info(
            f"compress: {self.monitor} before {self.before} -> right after compression {self.after}"
        )
        for logger in trainer.loggers:
            logger.log_metrics(self._accuracies(), step=trainer.global_step)

    def _start_distilling(
        self, pl_module: L.LightningModule, teacher_state: Mapping[str, Any] | None
    ) -> None:
        """The distiller of the post-compression epochs, its teacher the copy taken before compression (with the
        weights a checkpoint saved, on resume), handed to the module's training step."""
        assert self._teacher_model is not None
        self.distiller = attach_distiller(
            pl_module, self._teacher_model, self.distill_temperature, self.distill_weight, teacher_state
        )
        self._teacher_model = None  # Distiller keeps its own frozen copy

    # a resumed fit rebuilt its teacher while the checkpoint loaded, before Lightning moved the model to its device
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.distiller is not None:
            self.distiller.teacher.to(pl_module.device)
        elif self.distill and self.compressed:
            rank_zero_warn(
                "compress.distill=true: the checkpoint holds no teacher (saved without distillation); the epochs "
                "after it train on the task loss alone"
            )

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.compressed:
            self.final = self._metric(trainer)

    @override
    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.pruner is not None:
            self.pruner.start_activation_count()

    @override
    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.pruner is not None:
            self.act_sparsity = self.pruner.stop_activation_count()

    def _accuracies(self) -> dict[str, float]:
        values = {
            f"compress/{self.monitor.replace('/', '_')}_before": self.before,
            f"compress/{self.monitor.replace('/', '_')}_after_compression": self.after,
            f"compress/{self.monitor.replace('/', '_')}_final": self.final,
        }
        return {key: value for key, value in values.items() if value is not None}

    def report(self) -> dict[str, float]:
        """The monitored metric before compression, right after it, and at the end of the fit; the pruning
        sparsity (``prune/...``) and quantization bit widths (``quant/...``) of the compressed model."""
        metrics = self._accuracies()
        if self.quant is not None and self._module is not None and self.compressed:
            metrics.update(quantization_report(student_model(self._module)))
        if self.pruner is not None and self._module is not None and self.compressed:
            metrics["prune/weight_sparsity"] = self.pruner.weight_sparsity(self._module)
            if self.act_sparsity is not None:
                metrics["prune/act_sparsity"] = self.act_sparsity
        return metrics

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {"compressed": self.compressed, "before": self.before, "after": self.after}
        if self.distiller is not None:
            # the teacher is no model state; a fit resumed after the compression step needs the same one
            state["teacher"] = self.distiller.teacher.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = state_dict.get("before", self.before)
        self.after = state_dict.get("after", self.after)
        teacher = state_dict.get("teacher")
        if self.distill and teacher is not None:
            assert self._module is not None
            if self.distiller is not None:
                self.distiller.teacher.load_state_dict(teacher)
            elif self._teacher_model is not None:  # resumed: the checkpoint's compressed model was rebuilt
                self._start_distilling(self._module, teacher)
        if state_dict.get("compressed", False) and not self.compressed:
            # Only activation pruning leaves no trace in the model state: restore it from callback state.
            assert self._module is not None and self.pruner is not None
            self.pruner.attach_activation(self._module)
            self.compressed = True
