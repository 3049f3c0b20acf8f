"""Pruning callbacks, one per mode, over a small shared base (:class:`PruningCallback`): weight/activation
pruning of linear layers that survives checkpoint resume.

- :class:`OncePruning`: masks computed once, at fit start or after N epochs (``l1``, ``random``);
- :class:`OneShotPruning`: once, from calibration batches (``wanda``, ``sparsegpt``);
- :class:`ScheduledPruning`: masks recomputed every step on a cubic schedule (gradual ``l1``; ``movement``,
  whose scores are learned);
- :class:`StructuredPruning`: whole heads and FFN neurons removed at fit start, optionally with distillation.

The settings choose the mode: ``PruningCallback(**settings)`` (and each mode class) builds the class of the mode
they describe, so ``prune=l1_0.5 'prune.schedule={warmup: 0.1}'`` is gradual pruning whatever class the preset names.
Like Lightning's ``ModelPruning``, each class has one purpose and the hooks a variant overrides
(:meth:`PruningCallback._prune_at_start`, :meth:`PruningCallback._configure`).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from adls_lightning.callbacks.calibration import (
    CalibrationSettings,
    calibration_batches,
    model_forward,
)
from adls_lightning.callbacks.evaluated_model import save_evaluated_model
from adls_lightning.callbacks.trainer_control import forget_best_checkpoints
from adls_lightning.compression_record import merge_into, pruning_record, structured_sizes
from adls_lightning.data.inputs import model_inputs
from adls_lightning.distill import Distiller, attach_distiller, check_distillation, student_model
from adls_lightning.errors import ConfigError
from adls_lightning.lora import merge_before_compression
from adls_lightning.prune import (
    DEFAULT_EXCLUDE,
    LEARNED_METHODS,
    ONESHOT_METHODS,
    Pruner,
    StructuredPruner,
    fit_structure_to_state,
    lab_pruning_specs,
    make_pruning_permanent,
    structured_layer_sparsity,
    structured_weight_sparsity,
)
from adls_lightning.prune.masks import MaskSettings
from adls_lightning.prune.movement import ScheduleSettings
from adls_lightning.prune.oneshot import SparseGPTConfig
from adls_lightning.prune.structured import StructuredSettings
from adls_lightning.typed_settings import section


def _process_mean(trainer: L.Trainer) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The mean of a tensor over the processes of a distributed fit (None in a single process)."""
    return partial(trainer.strategy.reduce, reduce_op="mean") if trainer.world_size > 1 else None


def log_sparsity(trainer: L.Trainer, pruner: Pruner, model: torch.nn.Module, prefix: str = "prune") -> float:
    """Logs realised weight sparsity, overall and per layer, to the console and the trainer's loggers.

    Returns:
        The overall weight sparsity.
    """
    per_layer = pruner.layer_sparsity(model)
    overall = pruner.weight_sparsity(model)
    lines = [f"{prefix}: {len(per_layer)} layers, weight sparsity {overall:.4f} (counted zeros)"]
    lines += [f"  {name}: {value:.4f}" for name, value in per_layer.items()]
    rank_zero_info("\n".join(lines))
    metrics = {f"{prefix}/weight_sparsity": overall}
    metrics.update({f"{prefix}/layer/{name}": value for name, value in per_layer.items()})
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
    return overall


def pruning_mode(
    weight: Any = None,
    config: Any = None,
    schedule: Any = None,
    structured: Any = None,
) -> type[PruningCallback]:
    """The class of the pruning mode these settings (:class:`PruningCallback`'s arguments of the same names)
    describe: structured when ``structured`` is set, scheduled with a ``schedule`` or a learned method, one-shot
    with a calibrated method, else once. Settings that do not fit the mode are refused by its constructor."""
    if structured:
        return StructuredPruning
    if config is not None and config is not False:
        weight, _ = lab_pruning_specs(config, "prune.config")
    method = weight.get("method") if isinstance(weight, Mapping) else getattr(weight, "method", None)
    if (schedule is not None and schedule is not False) or method in LEARNED_METHODS:
        return ScheduledPruning
    if method in ONESHOT_METHODS:
        return OneShotPruning
    return OncePruning


class PruningCallback(L.Callback):
    """The shared base of the pruning callbacks: settings, masks that survive a resume, the pruning record, the
    report. ``PruningCallback(**settings)`` builds the mode's class (:func:`pruning_mode`); so does each mode class.

    Masks live in the model's ``state_dict`` (as ``...parametrizations.weight.0.mask`` buffers). ``setup`` registers
    the mask parametrizations (all-ones placeholders until pruning is applied) before Lightning restores a checkpoint
    and builds the optimizer, so a resumed fit, or a validate/test of a saved checkpoint, gets exactly the saved
    masks and the same parameter order. Whether pruning was applied is callback state. Lightning's ``ModelPruning``
    keeps no such state and loses its masks on resume.

    Args:
        weight: Weight pruning ``{sparsity, method: l1|random|wanda|sparsegpt|movement, scope: local|global,
            pattern: N:M}``; ``None``/``{}`` = none.
        activation: Activation pruning ``{sparsity, method: l1|random, scope: local}``; ``None``/``{}`` = none.
        at: ``"fit_start"`` (prune in ``on_fit_start``, after checkpoints and ``init_ckpt`` load) or ``N >= 1``
            (prune after ``N`` epochs, at the start of epoch ``N``; earlier best checkpoints are then forgotten,
            see :func:`forget_best_checkpoints`).
        include: Regexes on layer names; when given, only matching layers are pruned.
        exclude: Regexes on layer names to skip (default ``["classifier"]``).
        seed: Seed for ``random`` masks.
        make_permanent: Bake the zeros into plain weights at the end of each stage (for export or LoRA merging);
            the next stage's ``setup`` re-creates the structure, so it can still load checkpoints with masks.
        config: A lab pruning config, MASE's ``{weight: {...}, activation: {...}}`` as a mapping or the path of a
            ``.toml``/``.yaml``/``.json`` file (a whole MASE config gives its ``[passes.prune]``); when set, its
            ``weight`` and ``activation`` replace the two arguments above (``method: l1-norm`` is read as l1).
        calibration: ``{batches: N}``: training batches the one-shot methods read (N >= 1 for them; 0 otherwise).
        sparsegpt: ``{damp, block_size}`` of ``method: sparsegpt``.
        schedule: ``{initial_sparsity, warmup, cooldown}``: prune while training on the cubic schedule
            (:class:`~adls_lightning.prune.movement.CubicSchedule`) up to ``weight.sparsity``; ``None`` = prune once
            at ``at`` (``movement``: the schedule's defaults).
        train: Whether the run trains (the root ``train``); a schedule prunes during training and refuses a run that
            does not.
        structured: ``{heads, neurons, method: l1|random|gradient}``: see :class:`StructuredPruning`.
        distill: With ``structured``: the fit learns from the model as it was just before the structured pruning.
        distill_temperature: The distillation temperature T.
        distill_weight: The distillation term's share of the loss, in [0, 1].

    Raises:
        ConfigError: On invalid settings, at construction time.

    Example:
        .. code-block:: python

            trainer = L.Trainer(callbacks=[PruningCallback(weight={"sparsity": 0.5, "method": "l1"})])
    """

    #: calling the class builds the subclass its settings choose (read when a study's recorded settings are compared)
    settings_choose_the_class: ClassVar[bool] = True

    def __new__(cls, *args: Any, **kwargs: Any) -> PruningCallback:
        if not args and not kwargs:  # copy and pickle make an empty instance of the class they copy
            return super().__new__(cls)
        bound = inspect.signature(PruningCallback.__init__).bind(None, *args, **kwargs).arguments
        mode = pruning_mode(*(bound.get(name) for name in ("weight", "config", "schedule", "structured")))
        instance = super().__new__(mode)
        if not issubclass(mode, cls):  # Python initialises only an instance of the class called
            instance.__init__(*args, **kwargs)
        return instance

    def __init__(
        self,
        weight: MaskSettings | None = None,
        activation: MaskSettings | None = None,
        at: str | int = "fit_start",
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = DEFAULT_EXCLUDE,
        seed: int = 0,
        make_permanent: bool = False,
        config: Mapping[str, Any] | str | None = None,
        calibration: CalibrationSettings | None = None,
        sparsegpt: SparseGPTConfig | None = None,
        schedule: ScheduleSettings | None = None,
        train: bool = True,
        structured: StructuredSettings | None = None,
        distill: bool = False,
        distill_temperature: float = 2.0,
        distill_weight: float = 0.5,
    ) -> None:
        # each setting's type is checked in the pre-flight against these annotations (adls_lightning.typed_settings);
        # a section given false is off, as null
        weight, activation = section(weight, "prune.weight"), section(activation, "prune.activation")
        schedule, structured = section(schedule, "prune.schedule"), section(structured, "prune.structured")
        if not isinstance(sparsegpt, SparseGPTConfig):
            sparsegpt = section(sparsegpt, "prune.sparsegpt")
        elif sparsegpt is not None:
            sparsegpt = dataclasses.asdict(sparsegpt)
        if config is False:
            config = None
        #: the structured pruner (:class:`StructuredPruning` only)
        self.structured: StructuredPruner | None = self._structure(
            structured, weight, activation, config, at, schedule, seed
        )
        if not isinstance(distill, bool):
            raise ConfigError(f"prune.distill={distill!r}: must be true or false")
        if distill and self.structured is None:
            raise ConfigError(
                "prune.distill=true: distils into a structurally pruned model (prune=structured_0.5); for masks "
                "use compress=l1_0.5 compress.distill=true"
            )
        if distill and not train:
            raise ConfigError("prune.distill=true: distillation trains, and train=false trains nothing")
        check_distillation(distill_temperature, distill_weight, key="prune")
        self.distill, self.distill_temperature, self.distill_weight = (
            distill,
            distill_temperature,
            distill_weight,
        )
        self.distiller: Distiller | None = None  # the teacher of a distilled fit (StructuredPruning's)
        if config is not None:
            weight, activation = lab_pruning_specs(config, "prune.config")
        if at != "fit_start" and (isinstance(at, bool) or not isinstance(at, int) or at < 1):
            raise ConfigError(f"prune.at={at!r}: must be fit_start or a number of epochs >= 1")
        self.calibration_batches = calibration_batches(calibration, "prune.calibration")
        self.pruner = Pruner(
            weight,
            activation,
            include=include,
            exclude=exclude,
            seed=seed,
            key="prune",
            sparsegpt=sparsegpt,
            schedule=schedule,
        )
        if self.pruner.needs_calibration and self.calibration_batches < 1:
            raise ConfigError(
                f"prune.calibration.batches={self.calibration_batches}: prune.weight.method="
                f"{self.pruner.weight.method} prunes from calibration data; give N >= 1 training batches"
            )
        self.at = at
        #: whether the run trains: an evaluation-only run's pruned model is saved after its test (compressed.ckpt)
        self.train = bool(train)
        self.make_permanent = bool(make_permanent)
        self.applied = False
        self.act_sparsity: float | None = None
        self._module: L.LightningModule | None = None
        self._load_hook: Any = None
        self._configure(at, train)

    # -- the hooks a mode overrides ------------------------------------------------------------------------------

    def _structure(self, structured: Mapping[str, Any] | None, *others: Any) -> StructuredPruner | None:
        """The structured pruner of ``prune.structured`` (:class:`StructuredPruning`); None for the masks' modes."""
        return None

    def _configure(self, at: str | int, train: bool) -> None:
        """The mode's own checks of its settings and its state, at the end of construction."""

    def _prune_at_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Prune now what the mode prunes before the weights train or are evaluated (idempotent)."""

    # -- shared ----------------------------------------------------------------------------------------------------

    @property
    @override
    def state_key(self) -> str:
        # every mode keys its state as the one class of earlier releases, so their checkpoints restore it
        return PruningCallback.__qualname__

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._module = pl_module
        merge_before_compression(pl_module)
        self.pruner.register_placeholders(pl_module)
        if self._load_hook is None:
            pl_module.register_load_state_dict_pre_hook(self._before_model_load)
            self._load_hook = pl_module.register_load_state_dict_post_hook(self._after_model_load)
        if self.applied and self.structured is None:  # structured pruning has no activation hooks
            # Moves the activation hooks to layers swapped in since (post-training quantization).
            self.pruner.attach_activation(pl_module)

    # `at: fit_start` prunes once the weights are final, not in setup: a resumed or evaluated checkpoint and the
    # module's init_ckpt load after setup, and the masks must come from the weights that are trained or scored.
    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_epochs(trainer)
        self._prune_at_start(trainer, pl_module)

    def _check_epochs(self, trainer: L.Trainer) -> None:
        """``at: N`` prunes at the start of epoch N: a fit of N epochs or fewer would end dense, reported as pruned
        (weight sparsity 0). Checked at fit start, when ``trainer.max_epochs`` is final (``compress=`` sets it)."""
        epochs = trainer.max_epochs
        if self.at == "fit_start" or epochs is None or epochs < 0:  # -1: no epoch limit
            return
        if self.at >= epochs:
            raise ConfigError(
                f"prune.at={self.at}: the fit has {epochs} epoch(s) (trainer.max_epochs={epochs}), so epoch "
                f"{self.at} never starts and nothing would be pruned; valid: prune.at < trainer.max_epochs, "
                "or prune.at=fit_start"
            )

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prune_at_start(trainer, pl_module)  # evaluation-only runs (train=false)

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prune_at_start(trainer, pl_module)

    def apply_at_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Prune now what is pruned at fit start (idempotent): QAT after structured pruning calls it first."""
        self._prune_at_start(trainer, pl_module)

    @override
    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """The pruning record (:mod:`adls_lightning.compression_record`): specs, and the kept sizes of a
        structured run."""
        sizes = structured_sizes(pl_module) if self.structured is not None and self.applied else None
        merge_into(checkpoint, pruning=pruning_record(self.pruner, sizes))

    def _before_model_load(
        self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        pass

    def _after_model_load(self, module: torch.nn.Module, incompatible_keys: Any) -> None:
        # A validate/test run that loads a checkpoint pruned after N epochs: callback state is only restored when
        # fitting, so learn from the loaded masks that pruning was applied and switch on activation pruning.
        if not self.applied and self.pruner.has_pruned_weights(module):
            self.pruner.attach_activation(module)
            self.applied = True

    def _apply(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning evaluates under inference mode: masks and weights written there would be inference tensors
        # that a later checkpoint load cannot write into
        with torch.inference_mode(False), torch.no_grad():
            self._prune(trainer, pl_module)
        self.applied = True
        log_sparsity(trainer, self.pruner, pl_module)

    def _prune(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.pruner.prune(pl_module)

    @override
    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.pruner.start_activation_count()

    @override
    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.act_sparsity = self.pruner.stop_activation_count()

    def compressed_at_evaluation(self, trainer: L.Trainer) -> str | None:
        """An evaluation-only run (train=false) prunes the evaluated model at evaluation: no fit checkpoint holds its
        masks (or SparseGPT's solved weights), so it is saved after the test
        (:mod:`~adls_lightning.callbacks.evaluated_model`)."""
        return "prune" if not self.train and self.applied else None

    @override
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        save_evaluated_model(trainer, self)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.make_permanent:
            count = make_pruning_permanent(pl_module)
            if count:
                rank_zero_info(f"prune: made {count} pruned weights permanent")

    def report(self) -> dict[str, float]:
        """``prune/weight_sparsity`` (zeros counted in the pruned layers' effective weights) and
        ``prune/act_sparsity`` (zeros counted in their inputs during the last test pass, if one ran)."""
        if self._module is None:
            return {}
        metrics = {"prune/weight_sparsity": self.pruner.weight_sparsity(self._module)}
        if self.act_sparsity is not None:
            metrics["prune/act_sparsity"] = self.act_sparsity
        return metrics

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"applied": self.applied, "act_sparsity": self.act_sparsity}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.act_sparsity = state_dict.get("act_sparsity", self.act_sparsity)
        if state_dict.get("applied", False) and not self.applied and self.structured is None:
            # Activation-only pruning leaves no mask in the model state: re-enable the hooks from callback state.
            assert self._module is not None
            self.pruner.attach_activation(self._module)
            self.applied = True


# what the settings' checks and the pre-flight read (adls_lightning.typed_settings): the constructor's arguments, not
# __new__'s (*args, **kwargs), for the base and every mode class
PruningCallback.__signature__ = inspect.signature(PruningCallback.__init__).replace(
    parameters=list(inspect.signature(PruningCallback.__init__).parameters.values())[1:]
)


class OncePruning(PruningCallback):
    """Masks computed once (``l1``, ``random``): at fit start, or after ``at`` epochs (earlier best checkpoints
    are then forgotten)."""

    @override
    def _prune_at_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at == "fit_start" and not self.applied:
            self._apply(trainer, pl_module)
        elif not self.train and not self.applied:
            # the loaded weights hold no masks (a checkpoint pruned at epoch N would have set applied), and an
            # evaluation-only run has no epoch N: it would evaluate the dense model as the pruned one
            raise ConfigError(
                f"prune.at={self.at}: train=false trains no epoch, so nothing prunes after {self.at} epoch(s) and "
                "the evaluated weights hold no masks; valid: prune.at=fit_start (prune the evaluated weights), or "
                f"ckpt_path= a checkpoint pruned at epoch {self.at}"
            )

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at != "fit_start" and not self.applied and trainer.current_epoch >= self.at:
            self._apply(trainer, pl_module)
            forget_best_checkpoints(trainer)


class OneShotPruning(OncePruning):
    """Once, from ``calibration.batches`` training batches (``wanda``, ``sparsegpt``).

    SparseGPT also changes the kept weights; they are saved in checkpoints like any weight, and when an evaluation
    stage reloads the dense checkpoint they were solved from (``train=false ckpt_path=...``), a load hook puts them
    back, so validation and test both score the solved weights.
    """

    @override
    def _configure(self, at: str | int, train: bool) -> None:
        self._dense_reload = False

    @override
    def _prune(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        if datamodule is None:
            raise ConfigError(
                f"prune.weight.method={self.pruner.weight.method}: no datamodule to draw the "
                "prune.calibration.batches from"
            )
        batches = datamodule.train_dataloader()
        self.pruner.prune(pl_module, batches, model_forward(pl_module), self.calibration_batches)
        rank_zero_info(
            f"prune: {self.pruner.weight.method} masks from {self.pruner.calibration_run} calibration batches"
            + (f", {len(self.pruner.solved)} layers' weights solved" if self.pruner.solved else "")
        )

    @override
    def _before_model_load(
        self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        assert self._module is not None
        self._dense_reload = self.pruner.loads_dense_state(self._module, state_dict, prefix)

    @override
    def _after_model_load(self, module: torch.nn.Module, incompatible_keys: Any) -> None:
        super()._after_model_load(module, incompatible_keys)
        # trainer.test(ckpt_path=...) of an evaluation-only run reloads the dense weights SparseGPT solved from (the
        # masks survive the reload, the weights would not): its solved weights go back in
        if self._dense_reload:
            with torch.inference_mode(False), torch.no_grad():
                self.pruner.put_solved(module)
            self._dense_reload = False


class ScheduledPruning(PruningCallback):
    """Masks recomputed after every optimizer step at the cubic schedule's sparsity for the next step, from the
    fit's first step to its last (always for ``method: movement``, whose scores are learned from the training
    gradients); the learned scores are callback state (saved in checkpoints, restored on resume), and the "best"
    checkpoint is chosen among those at the final sparsity."""

    @override
    def _configure(self, at: str | int, train: bool) -> None:
        method = self.pruner.weight.method
        if at != "fit_start":
            raise ConfigError(
                f"prune.at={at!r}: prune.schedule prunes from the fit's first step; delay it with "
                "prune.schedule.warmup instead"
            )
        if not train:
            what = (
                f"prune.weight.method={method}: learns its scores from the training gradients"
                if self.pruner.learns_scores
                else "prune.schedule: prunes while training"
            )
            raise ConfigError(
                f"{what}, and train=false trains nothing; evaluate a checkpoint it pruned with "
                "prune.weight.method=l1 prune.schedule=null (the checkpoint's masks load)"
            )
        self._total_steps = 0  # optimizer steps of the fit, known at its start
        self._lr_scale = 1.0  # the learning-rate schedule's multiplier of the step being taken
        self._scheduled_step: int | None = None  # the global step the masks were last computed for

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        total = trainer.estimated_stepping_batches
        if not math.isfinite(total) or total < 1:
            what = "an unbounded number of" if total == math.inf else "no"
            raise ConfigError(
                f"prune.schedule: the fit has {what} training steps; the sparsity rises over a known number of "
                "them (check trainer.max_epochs, trainer.max_steps, trainer.limit_train_batches, data.train_size)"
            )
        frozen = self.pruner.frozen_layer(pl_module) if self.pruner.learns_scores else None
        if frozen is not None:
            raise ConfigError(
                f"prune.weight.method={self.pruner.weight.method}: layer {frozen}'s weight is frozen, so it has no "
                "gradient to score (LoRA left unmerged?); use model.merge_lora_before_compress=true or model/lora=none"
            )
        self._total_steps = int(total)
        self.pruner.attach_activation(pl_module)
        self.applied = True

    # after the training state (the global step) is restored: a resumed fit recomputes the masks of its step
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._schedule_step(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # once per optimizer step (accumulated batches share one), before the checkpoint callbacks save (Lightning
        # runs them last), so a checkpoint holds the masks its step trains with
        if trainer.global_step == self._scheduled_step:
            return
        sparsity = self._schedule_step(trainer, pl_module)
        pl_module.log("prune/scheduled_sparsity", sparsity, on_step=True, on_epoch=False, prog_bar=True)
        if self.pruner.learns_scores:
            self._log_consistency(trainer, pl_module)
        _, end = self.pruner.schedule.bounds(self._total_steps)
        if trainer.global_step == end:
            forget_best_checkpoints(trainer)  # "best" is chosen among checkpoints at the final sparsity

    def _log_consistency(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the rank correlations take about 1.5 ms per layer: only on the steps that write logs (Lightning writes
        # on_step values when global_step is a multiple of log_every_n_steps, here). A diagnostic, not a verdict:
        # runs at 0.10 have beaten gradual L1 and runs at 0.49 collapsed (docs/pruning.md, "Clipped like the weights")
        if trainer.log_every_n_steps <= 0 or trainer.global_step % trainer.log_every_n_steps:
            return
        consistency = self.pruner.score_consistency(pl_module)
        if consistency is not None:  # None: not yet two steps measured
            pl_module.log("prune/score_consistency", consistency, on_step=True, on_epoch=False, prog_bar=True)

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.pruner.learns_scores:
            return
        # the schedule's multiplier of this step's learning rate (current over initial lr), which learned scores follow
        group = optimizer.param_groups[0]
        initial = group.get("initial_lr", group["lr"])
        self._lr_scale = group["lr"] / initial if initial else 1.0
        # the scores' gradients get what the weights' got before this hook (averaged over processes, unscaled) and
        # what the trainer does to them after it (clipping), as the paper's scores, parameters of the same optimizer
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = 1.0 / float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        clip_val = trainer.gradient_clip_val  # Lightning clips by norm unless told "value"
        algorithm = "value" if trainer.gradient_clip_algorithm == "value" else "norm"
        gradients = [
            p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        norm = (
            torch.nn.utils.get_total_norm(gradients)
            if clip_val and algorithm == "norm" and gradients
            else 0.0
        )
        self.pruner.finish_score_step(pl_module, _process_mean(trainer), scale, clip_val, algorithm, norm)

    def _schedule_step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float:
        """Masks for the step about to train, at the schedule's sparsity for it (returned)."""
        assert self.pruner.schedule is not None
        sparsity = self.pruner.schedule.sparsity(trainer.global_step, self._total_steps)
        # each process scores its own batches: the masks must come from the scores of all of them
        self.pruner.prune_scheduled(pl_module, sparsity, _process_mean(trainer), lr_scale=self._lr_scale)
        self._scheduled_step = trainer.global_step
        return sparsity

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_sparsity(trainer, self.pruner, pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.pruner.learns_scores and self._module is not None:
            # learned scores are not model state (the model's keys stay those of any pruned model): saved here
            state["scores"] = self.pruner.scores(self._module)
            moments = self.pruner.score_optimizer_state(self._module)
            if moments:
                state["score_optimizer"] = moments
            state["score_consistency"] = self.pruner.score_consistency_state(self._module)
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.pruner.learns_scores and "scores" in state_dict:
            assert self._module is not None
            self.pruner.load_scores(self._module, state_dict["scores"])
            for key in ("score_optimizer", "score_consistency"):
                self.pruner.load_learner_states(self._module, state_dict.get(key, {}))
        super().load_state_dict(state_dict)


class StructuredPruning(PruningCallback):
    """Removes ``structured: {heads, neurons, method: l1|random|gradient}`` fractions of every layer's attention
    heads and FFN neurons physically (:mod:`adls_lightning.prune.structured`), at fit start (before training, after
    ``init_ckpt`` loads; the optimizer is then rebuilt on the smaller parameters); needs ``weight`` and
    ``activation`` null; ``gradient`` reads ``calibration.batches``. A checkpoint of such a run reloads at its own
    sizes (read from its shapes).

    With ``distill`` the fit learns from the model as it was just before the structured pruning (the dense
    ``init_ckpt`` model) as well as from the labels (:func:`~adls_lightning.distill.attach_distiller`); the
    teacher's weights are callback state, so a resumed fit distills from the same teacher.
    """

    @override
    def _structure(
        self,
        structured: Mapping[str, Any] | None,
        weight: Any,
        activation: Any,
        config: Any,
        at: str | int,
        schedule: Any,
        seed: int,
    ) -> StructuredPruner | None:
        unknown = sorted(set(structured or {}) - {"heads", "neurons", "method"})
        if unknown:
            raise ConfigError(f"prune.structured.{unknown[0]}: unknown key; valid: heads, neurons, method")
        clash = [
            name
            for name, value in (("weight", weight), ("activation", activation), ("config", config))
            if value
        ]
        if clash or schedule is not None:
            what = f"prune.{clash[0]}" if clash else "prune.schedule"
            raise ConfigError(
                f"{what} and prune.structured are both set: structured pruning removes whole heads and neurons "
                f"alone; set {what}=null"
            )
        if at != "fit_start":
            raise ConfigError(
                f"prune.at={at!r}: structured pruning replaces parameters the optimizer holds, so it prunes at "
                "fit_start; prune a trained model with init_ckpt=<its checkpoint> instead"
            )
        return StructuredPruner(**(structured or {}), seed=seed, key="prune.structured")

    @override
    def _configure(self, at: str | int, train: bool) -> None:
        assert self.structured is not None
        if self.structured.needs_calibration and self.calibration_batches < 1:
            raise ConfigError(
                f"prune.calibration.batches={self.calibration_batches}: prune.structured.method=gradient scores "
                "heads and neurons from calibration data; give N >= 1 training batches"
            )
        self._teacher_model: torch.nn.Module | None = None  # a resumed fit's teacher skeleton (dense sizes)
        #: per layer, the head and FFN-neuron indices structured pruning kept (callback state, for the record)
        self.kept: dict[str, list[list[int]]] | None = None

    @override
    def _prune_at_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.applied:
            return
        assert self.structured is not None
        fitting = trainer.state.fn == "fit"
        if fitting and trainer.world_size > 1:
            raise ConfigError(
                "prune.structured: a distributed fit has wrapped the parameters it would replace; structure-prune "
                "in one process (train.py trainer.devices=1), then fine-tune that checkpoint with init_ckpt="
            )
        if fitting and self.distill:
            # the teacher: the model just before its heads and neurons go (the dense init_ckpt model)
            self._start_distilling(pl_module, student_model(pl_module), None)
        with torch.inference_mode(False):
            self.kept = self.structured.prune(pl_module, *self._gradient_data(trainer, pl_module))
        self.applied = True
        if fitting:
            # the optimizer (built before on_fit_start) holds the replaced, larger parameters
            trainer.strategy.setup_optimizers(trainer)
        sizes = f"{len(self.kept['heads'][0])} heads and {len(self.kept['neurons'][0])} FFN neurons"
        rank_zero_info(f"prune: structured ({self.structured.method}), {sizes} kept in each layer")
        self._log_structured(trainer, pl_module)

    def _gradient_data(self, trainer: L.Trainer, pl_module: L.LightningModule) -> tuple[Any, Any, int]:
        """``(batches, loss, count)`` of ``prune.structured.method=gradient``: training batches and the task loss."""
        assert self.structured is not None
        if not self.structured.needs_calibration:
            return None, None, 0
        if trainer.datamodule is None:
            raise ConfigError(
                "prune.structured.method=gradient: no datamodule to draw prune.calibration.batches from"
            )

        def loss(batch: Mapping[str, Any]) -> torch.Tensor:
            batch = pl_module.transfer_batch_to_device(batch, pl_module.device, 0)
            return pl_module(**model_inputs(batch, labels=True)).loss

        return trainer.datamodule.train_dataloader(), loss, self.calibration_batches

    def _start_distilling(
        self, pl_module: torch.nn.Module, teacher: torch.nn.Module, state: Mapping[str, Any] | None
    ) -> None:
        self.distiller = attach_distiller(
            pl_module, teacher, self.distill_temperature, self.distill_weight, state, key="prune"
        )
        rank_zero_info("prune: distilling from the model as it was before structured pruning")

    # a resumed fit rebuilt its teacher before Lightning moved the model
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.distiller is not None:
            self.distiller.teacher.to(pl_module.device)

    def _layers(self, model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
        return {target.name: target.linear for target in self.pruner.targets(model)}

    def _log_structured(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layers = self._layers(pl_module)
        metrics = {"prune/weight_sparsity": structured_weight_sparsity(pl_module, layers)}
        per_layer = structured_layer_sparsity(pl_module, layers)
        metrics.update({f"prune/layer/{name}": value for name, value in per_layer.items()})
        rank_zero_info(
            f"prune: {len(per_layer)} layers, weight sparsity {metrics['prune/weight_sparsity']:.4f} "
            "(removed or zero, of the dense weights)"
        )
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def _before_model_load(
        self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        assert self._module is not None
        # a checkpoint of a structured run (resume, best, init_ckpt): the layers take its sizes before it loads;
        # callback state comes after the model's, so the sizes are read from the state's shapes
        with torch.inference_mode(False), torch.no_grad():
            dense = copy.deepcopy(student_model(self._module)) if self.distill else None
            if fit_structure_to_state(self._module, state_dict, prefix):
                self._teacher_model = (
                    dense  # the teacher's skeleton; its weights come with the callback state
                )
                self.applied = True
                rank_zero_info("prune: the checkpoint is structurally pruned; the layers take its sizes")

    @override
    def _after_model_load(self, module: torch.nn.Module, incompatible_keys: Any) -> None:
        pass

    @override
    def report(self) -> dict[str, float]:
        if self._module is None:
            return {}
        # removed weights count as zeros of the dense layers: the fraction of the dense weights gone or zero
        return {"prune/weight_sparsity": structured_weight_sparsity(self._module, self._layers(self._module))}

    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.kept is not None:
            state["structured_kept"] = (
                self.kept
            )  # which heads and neurons of the dense model remain (a record)
        if self.distiller is not None:
            state["teacher"] = self.distiller.teacher.state_dict()  # no model state; a resumed fit needs it
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.kept = state_dict.get("structured_kept", self.kept)
        teacher = state_dict.get("teacher")
        if self.distill and teacher is not None:
            assert self._module is not None
            if self.distiller is not None:
                self.distiller.teacher.load_state_dict(teacher)
            elif (
                self._teacher_model is not None
            ):  # resumed: the dense skeleton copied before the checkpoint loaded
                self._start_distilling(self._module, self._teacher_model, teacher)
                self._teacher_model = None
