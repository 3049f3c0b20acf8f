"""The pruner: which layers (:func:`find_prune_targets`), masks put on them from a config (:class:`Pruner`: once,
or step by step on a schedule), lab configs (:func:`lab_pruning_specs`) and baking masks into plain weights
(:func:`make_pruning_permanent`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from adls_lightning.errors import ConfigError
from adls_lightning.lab_config import load_lab_config
from adls_lightning.layers import name_filter, target_layers
from adls_lightning.obs import input_statistics
from adls_lightning.prune.activations import ActivationSparsifier
from adls_lightning.prune.masks import (
    MaskSpec,
    WeightMask,
    _accept_unpruned_state,
    check_pattern,
    compute_weight_masks,
    is_weight_pruned,
    masks_from_scores,
)
from adls_lightning.prune.movement import CubicSchedule, MovementMask, clip_score_gradients
from adls_lightning.prune.oneshot import SparseGPTConfig, check_block_size, solve
from adls_lightning.prune.scores import LEARNED_METHODS, ONESHOT_METHODS, PRUNE_METHODS, rank_scores

ACTIVATION_SCOPES = ("local",)
DEFAULT_EXCLUDE = ("classifier",)


@dataclass
class PruneTarget:
    """A prunable layer.

    Attributes:
        name: The layer's canonical name (:mod:`adls_lightning.layers`), used for display, metrics and
            include/exclude matching.
        module: The module that receives the layer input (the outermost wrapper), where the activation hook goes.
        linear_name: Path of the ``nn.Linear`` whose weight is pruned.
        linear: The ``nn.Linear`` itself.
    """

    name: str
    module: nn.Module
    linear_name: str
    linear: nn.Linear


def find_prune_targets(
    model: nn.Module, include: Sequence[str] | None = None, exclude: Sequence[str] | None = DEFAULT_EXCLUDE
) -> list[PruneTarget]:
    """Finds the linear layers to prune, in ``named_modules`` order (:func:`adls_lightning.layers.target_layers`).

    Args:
        model: Any module tree (plain HF model, PEFT model, quantized model, LightningModule).
        include: Regexes (``re.search``) on the canonical layer name; when given, only matching layers are pruned.
        exclude: Regexes on the canonical layer name; matching layers are skipped (default: the classifier).

    Returns:
        One target per pruned linear.
    """
    return [
        PruneTarget(layer.name, layer.module, layer.linear_path, layer.linear)
        for layer in target_layers(model, name_filter(include, exclude))
    ]


def make_pruning_permanent(model: nn.Module) -> int:
    """Replaces every :class:`WeightMask` parametrization by a plain ``weight`` that holds the zeros.

    Needed before exporting or before PEFT's ``merge_and_unload`` (which writes into ``weight.data`` and would
    otherwise write into a temporary tensor). The new ``weight`` is a new ``nn.Parameter``: do this after
    training, not between optimizer steps. Activation hooks are left in place (they are runtime behaviour).

    Returns:
        The number of layers made permanent.
    """
    count = 0
    for module in list(model.modules()):
        if is_weight_pruned(module):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
            count += 1
    return count


def lab_pruning_specs(config: Mapping[str, Any] | str, key: str) -> tuple[Any, Any]:
    """The ``(weight, activation)`` specs of a lab pruning config (MASE's ``{weight: {...}, activation: {...}}``, a
    mapping or a ``.toml``/``.yaml``/``.json`` file whose ``[passes.prune]`` is read).

    Raises:
        ConfigError: an unreadable file, or a key other than weight and activation (named under ``key``).
    """
    lab = load_lab_config(config, "prune", key)
    unknown = sorted(set(lab) - {"weight", "activation"})
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown key; a lab pruning config has weight, activation")
    return lab.get("weight"), lab.get("activation")


class Pruner:
    """Prunes a model's linear layers according to a config; shared by the pruning and compression callbacks.

    Args:
        weight: Weight pruning config ``{sparsity, method, scope, pattern}`` or ``None``/``{}`` for none; the
            one-shot methods (``wanda``, ``sparsegpt``) need calibration batches given to :meth:`prune`.
        activation: Activation pruning config ``{sparsity, method, scope: local}`` or ``None``/``{}``.
        include: Regexes selecting layers by name (default: all).
        exclude: Regexes removing layers by name (default: ``["classifier"]``).
        seed: Seed for ``random`` weight and activation masks.
        key: Config key prefix for error messages.
        sparsegpt: ``{damp, block_size}`` of ``method: sparsegpt`` (:class:`~adls_lightning.prune.oneshot.SparseGPTConfig`).
        schedule: ``{initial_sparsity, warmup, cooldown}``: prune the weights step by step while training, on the
            cubic schedule (:class:`~adls_lightning.prune.movement.CubicSchedule`) up to ``weight.sparsity``, through
            :meth:`prune_scheduled`; ``None``: prune once with :meth:`prune`. A learned method (``movement``) always
            prunes on a schedule (the defaults when ``None``).

    Raises:
        ConfigError: On any invalid value, before a model is touched.

    Example:
        .. code-block:: python

            pruner = Pruner(weight={"sparsity": 0.5, "method": "l1"}, activation=None)
            pruner.prune(model)
            print(pruner.weight_sparsity(model))
    """

    def __init__(
        self,
        weight: Mapping[str, Any] | None = None,
        activation: Mapping[str, Any] | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = DEFAULT_EXCLUDE,
        seed: int = 0,
        key: str = "prune",
        sparsegpt: Mapping[str, Any] | None = None,
        schedule: Mapping[str, Any] | None = None,
    ) -> None:
        self.key = key
        self.weight = MaskSpec.from_config(weight, f"{key}.weight")
        self.schedule = self._schedule(schedule)
        self.activation = MaskSpec.from_config(activation, f"{key}.activation")
        if self.activation is not None and self.activation.method not in PRUNE_METHODS:
            raise ConfigError(
                f"{key}.activation.method={self.activation.method!r}: must be one of {', '.join(PRUNE_METHODS)} "
                "(one-shot methods prune weights only)"
            )
        if self.activation is not None and self.activation.pattern is not None:
            raise ConfigError(f"{key}.activation.pattern: N:M patterns are for weights only; remove it")
        unknown = sorted(set(sparsegpt or {}) - {f.name for f in dataclasses.fields(SparseGPTConfig)})
        if unknown:
            raise ConfigError(f"{key}.sparsegpt.{unknown[0]}: unknown key; valid: damp, block_size")
        self.sparsegpt = SparseGPTConfig(**(sparsegpt or {}))
        check_block_size(self.weight, self.sparsegpt)
        #: layer name -> weights a one-shot method solved (SparseGPT), kept to put back after a reload of the
        #: dense state they were solved from (:meth:`put_solved`)
        self.solved: dict[str, torch.Tensor] = {}
        #: calibration batches the last one-shot pruning read (the loader may hold fewer than asked)
        self.calibration_run = 0
        if self.activation is not None and self.activation.scope not in ACTIVATION_SCOPES:
            raise ConfigError(
                f"{key}.activation.scope={self.activation.scope!r}: must be local (activation masks are "
                "recomputed per sample from the live input, so there is no fixed set to rank globally)"
            )
        for list_key, patterns in (("include", include), ("exclude", exclude)):
            for pattern in patterns or ():
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as err:
                    raise ConfigError(f"{key}.{list_key}: {pattern!r} is not a valid regex ({err})") from None
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"{key}.seed={seed!r}: must be an integer")
        self.include = list(include) if include else None
        self.exclude = list(exclude) if exclude else None
        self.seed = seed
        self.sparsifiers: dict[str, ActivationSparsifier] = {}
        self._hooks: dict[str, tuple[nn.Module, Any]] = {}

    def _schedule(self, schedule: Mapping[str, Any] | None) -> CubicSchedule | None:
        """The weights' schedule: the given one, the defaults for a learned method, else none (prune once)."""
        spec = self.weight
        if schedule is None and (spec is None or spec.method not in LEARNED_METHODS):
            return None
        if spec is None:
            raise ConfigError(f"{self.key}.schedule: schedules weight pruning, but {self.key}.weight is null")
        if spec.method in ONESHOT_METHODS:
            raise ConfigError(
                f"{self.key}.schedule: {spec.key}.method={spec.method} prunes once from calibration data, not on a "
                f"schedule; set {self.key}.schedule=null"
            )
        if spec.pattern is not None:
            raise ConfigError(
                f"{spec.key}.pattern={spec.pattern!r}: a pattern has one sparsity, a schedule rises to it; set "
                f"{spec.key}.pattern=null or {self.key}.schedule=null"
            )
        return CubicSchedule.from_config(schedule, spec.sparsity, f"{self.key}.schedule")

    def targets(self, model: nn.Module) -> list[PruneTarget]:
        """The layers this pruner acts on in ``model`` (see :func:`find_prune_targets`)."""
        targets = find_prune_targets(model, self.include, self.exclude)
        if not targets:
            raise ConfigError(
                f"prune.include={self.include} / prune.exclude={self.exclude}: no nn.Linear layer is left to prune"
            )
        return targets

    @property
    def learns_scores(self) -> bool:
        """True when the weight method learns its scores while training (``movement``)."""
        return self.weight is not None and self.weight.method in LEARNED_METHODS

    @property
    def needs_calibration(self) -> bool:
        """True when the weight method is a one-shot method (it prunes from calibration batches)."""
        return self.weight is not None and self.weight.method in ONESHOT_METHODS

    def register_placeholders(self, model: nn.Module) -> None:
        """Registers all-ones (no-op) weight masks on every target that has none yet.

        Doing this in ``setup``, before the optimizer is built, fixes the module structure for the whole fit:
        ``parametrize`` moves ``weight`` behind ``bias`` in the parameter order, and Lightning restores optimizer
        state by position, so the structure must not change between the run that saved a checkpoint and the run
        that resumes it. It also gives ``load_state_dict`` the mask buffers that a checkpoint fills in.
        """
        if self.weight is None:
            return
        targets = self.targets(model)
        check_pattern(self.weight, {t.name: t.linear.in_features for t in targets})
        # a learned method's mask also accumulates its scores (same state keys)
        mask_type = LEARNED_METHODS.get(self.weight.method, WeightMask)
        for target in targets:
            if not is_weight_pruned(target.linear):
                mask = torch.ones_like(target.linear.weight, dtype=torch.bool)
                parametrize.register_parametrization(target.linear, "weight", mask_type(mask))
            if not getattr(target.linear, "_accepts_unpruned_state", False):
                target.linear.register_load_state_dict_pre_hook(_accept_unpruned_state)
                target.linear._accepts_unpruned_state = True

    def prune(
        self,
        model: nn.Module,
        batches: Iterable[Any] | None = None,
        forward: Callable[[Any], Any] | None = None,
        count: int = 0,
    ) -> dict[str, float]:
        """Computes weight masks from the current (effective) weights and starts activation pruning.

        Masks are fixed from then on: call once per model. A one-shot method first runs ``count`` of ``batches``
        through ``forward`` (which calls ``model``) to read every pruned layer's inputs; SparseGPT also writes its
        compensated weights into the layers (and keeps them in :attr:`solved`).

        Returns:
            Layer name → realised weight sparsity (counted zeros).

        Raises:
            ConfigError: a one-shot method without calibration batches, or a layer they never reached; a learned
                method (it prunes while training, :meth:`prune_scheduled`).
        """
        if self.learns_scores:
            raise ConfigError(
                f"{self.key}.weight.method={self.weight.method}: learns its scores while training and prunes on "
                f"{self.key}.schedule, not at once"
            )
        targets = self.targets(model)
        if self.weight is not None:
            self.register_placeholders(model)
            if self.needs_calibration:
                masks, self.solved = self._one_shot(model, targets, batches, forward, count)
            else:
                generator = torch.Generator().manual_seed(self.seed)
                weights = {t.name: t.linear.weight for t in targets}
                masks = compute_weight_masks(weights, self.weight, generator)
            with torch.no_grad():
                for target in targets:
                    target.linear.parametrizations.weight[0].mask.copy_(masks[target.name])
            self.put_solved(model)
        self.attach_activation(model)
        return self.layer_sparsity(model)

    @torch.no_grad()
    def prune_scheduled(
        self,
        model: nn.Module,
        sparsity: float,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        lr_scale: float = 1.0,
    ) -> None:
        """Recomputes the weight masks at ``sparsity`` (one step of the schedule; masks from :meth:`register_placeholders`).

        A learned method keeps the highest of the scores its layers accumulated (every layer stays dense until they
        hold any); a score method ranks the current masked weights, so what is pruned stays pruned (``l1``: Zhu &
        Gupta's gradual magnitude pruning) and ``random`` draws the same noise each time.

        Args:
            model: The model whose placeholders were registered.
            sparsity: The sparsity of this step, in ``[0, weight.sparsity]``.
            reduce: Averages a tensor over the processes of a distributed fit: each process accumulates the scores of
                its own batches, and the masks must agree. The averaged scores (Adam-learned scores: the averaged
                step gradient) replace each process's own.
            lr_scale: The training schedule's learning-rate multiplier of the step just taken (scores learned with
                a learning rate follow it, as the paper's do).
        """
        assert self.weight is not None and self.schedule is not None
        targets = self.targets(model)
        if self.learns_scores:
            learners = _learners(targets)
            for learner in learners.values():
                learner.learn(reduce, lr_scale)
            scores = {name: learner.scores for name, learner in learners.items()}
            if not any(bool(value.any()) for value in scores.values()):
                return  # nothing learned yet (before the first backward): a ranking by position would be arbitrary
        else:
            generator = torch.Generator().manual_seed(self.seed)
            scores = {t.name: rank_scores(t.linear.weight, self.weight.method, generator) for t in targets}
        masks = masks_from_scores(scores, dataclasses.replace(self.weight, sparsity=sparsity))
        for target in targets:
            target.linear.parametrizations.weight[0].mask.copy_(masks[target.name])

    def finish_score_step(
        self,
        model: nn.Module,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        scale: float = 1.0,
        clip_val: float | None = None,
        clip_algorithm: str = "norm",
        parameter_norm: float | torch.Tensor = 0.0,
    ) -> float:
        """Readies a learned method's score gradients of this optimizer step, between the backward passes and the
        optimizer step, as the trainer readies the weights' (the next :meth:`prune_scheduled` learns from them):
        averaged over processes (``reduce``), multiplied by ``scale`` (a loss scaler's ``1 / scale``; the weights'
        gradients are unscaled by now) and clipped with the weights' gradients (:func:`clip_score_gradients`; their
        norm: ``parameter_norm``). Returns the clipping factor (1.0 for other methods)."""
        learners = [
            learner for learner in self.learners(model).values() if learner.finish_gradient(reduce, scale)
        ]
        return clip_score_gradients(learners, clip_val, clip_algorithm, parameter_norm)

    def learners(self, model: nn.Module) -> dict[str, MovementMask]:
        """Layer name -> the mask that learns its scores; empty for methods that learn none."""
        return _learners(self.targets(model)) if self.learns_scores else {}

    def scores(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Layer name -> a copy of the scores a learned method accumulated (empty for other methods)."""
        return {name: learner.scores.clone() for name, learner in self.learners(model).items()}

    def score_optimizer_state(self, model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
        """Layer name -> what learning the scores needs besides them (Adam's moments; empty for summed scores)."""
        states = {name: learner.optimizer_state() for name, learner in self.learners(model).items()}
        return {name: state for name, state in states.items() if state}

    def score_consistency_state(self, model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
        """Layer name -> what :meth:`score_consistency` needs to continue after a resume (empty for other methods)."""
        return {name: learner.consistency_state() for name, learner in self.learners(model).items()}

    def load_scores(self, model: nn.Module, scores: Mapping[str, torch.Tensor]) -> None:
        """Puts saved :meth:`scores` back into the layers (a resumed fit)."""
        self.load_learner_states(model, {name: {"scores": value} for name, value in scores.items()})

    def load_learner_states(self, model: nn.Module, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Puts saved per-layer buffers back (:meth:`scores`, :meth:`score_optimizer_state` or
        :meth:`score_consistency_state`: a resumed fit); layers absent from ``states`` are left as they are."""
        for name, learner in self.learners(model).items():
            if name in states:
                learner.load_state(states[name])

    def score_consistency(self, model: nn.Module) -> float | None:
        """The mean over layers of :meth:`~adls_lightning.prune.movement.MovementMask.consistency` (how far a learned
        method's ranking is a property of the weights, 1, rather than gradient noise, 0); ``None`` for other methods
        and until two steps are measured."""
        values = [learner.consistency() for learner in self.learners(model).values()]
        measured = [value for value in values if value is not None]
        return sum(measured) / len(measured) if measured else None

    def frozen_layer(self, model: nn.Module) -> str | None:
        """The first target whose weight gets no gradient (frozen: e.g. a LoRA base layer left unmerged), if any."""
        for target in self.targets(model):
            if not target.linear.parametrizations.weight.original.requires_grad:
                return target.name
        return None

    def _one_shot(
        self,
        model: nn.Module,
        targets: list[PruneTarget],
        batches: Iterable[Any] | None,
        forward: Callable[[Any], Any] | None,
        count: int,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Keep-masks and solved weights (the methods that change them) of a one-shot method."""
        spec = self.weight
        assert spec is not None
        if batches is None or forward is None or count < 1:
            raise ConfigError(
                f"{spec.key}.method={spec.method!r}: prunes from calibration data; give "
                f"{self.key}.calibration.batches=N (N >= 1)"
            )
        # the input each layer receives, seen where the activation hook would sit (the outermost wrapper)
        inputs, run = input_statistics(model, {t.name: t.module for t in targets}, batches, forward, count)
        self.calibration_run = run
        masks, solved = {}, {}
        for target in targets:
            if inputs[target.name].tokens == 0:
                raise ConfigError(
                    f"{spec.key}.method={spec.method!r}: layer {target.name} received no input in the {run} "
                    "calibration batches"
                )
            weight = target.linear.weight
            keep, new_weight = solve(weight, inputs[target.name], spec, self.sparsegpt)
            masks[target.name] = keep.to(weight.device)
            if new_weight is not None:
                solved[target.name] = new_weight.detach().cpu()
        return masks, solved

    @torch.no_grad()
    def put_solved(self, model: nn.Module) -> None:
        """Writes the one-shot solved weights (:attr:`solved`) into ``model``'s layers (behind their masks)."""
        if not self.solved:
            return
        for target in self.targets(model):
            if target.name in self.solved:
                original = target.linear.parametrizations.weight.original
                original.copy_(self.solved[target.name].to(device=original.device, dtype=original.dtype))

    def loads_dense_state(self, model: nn.Module, state_dict: Mapping[str, Any], prefix: str = "") -> bool:
        """True when ``state_dict`` (about to be loaded into ``model`` at ``prefix``) has no masks for the layers
        whose weights were solved: a dense state (the checkpoint they were solved from, reloaded by an evaluation
        stage), after which :meth:`put_solved` must put them back. A pruned state holds its own solved weights."""
        if not self.solved:
            return False
        return not any(
            f"{prefix}{target.linear_name}.parametrizations.weight.0.mask" in state_dict
            for target in self.targets(model)
            if target.name in self.solved
        )

    def has_pruned_weights(self, model: nn.Module) -> bool:
        """True if any target's weight mask removes an entry (e.g. after loading a pruned checkpoint)."""
        return any(
            is_weight_pruned(t.linear) and not bool(t.linear.parametrizations.weight[0].mask.all())
            for t in self.targets(model)
        )

    def attach_activation(self, model: nn.Module) -> None:
        """Puts an :class:`ActivationSparsifier` pre-hook on every target (once; idempotent).

        The hook prunes when an activation config is given and counts zeros when asked. It belongs on the module
        that receives the layer input (the outermost wrapper); when a module swap (e.g. post-training
        quantization wrapping a pruned ``nn.Linear`` in ``QuantLinear``) has replaced that module, calling this
        again moves the hook to the new one, so activation pruning never silently stops.
        """
        for target in self.targets(model):
            hooked = self._hooks.get(target.name)
            if hooked is not None and hooked[0] is target.module:
                continue
            if hooked is not None:
                hooked[1].remove()
            sparsifier = self.sparsifiers.setdefault(
                target.name, ActivationSparsifier(self.activation, self.seed)
            )
            self._hooks[target.name] = (target.module, target.module.register_forward_pre_hook(sparsifier))

    def layer_sparsity(self, model: nn.Module) -> dict[str, float]:
        """Layer name → fraction of zeros counted in the layer's effective (masked) weight."""
        with torch.no_grad():
            return {
                t.name: float((t.linear.weight == 0).sum()) / t.linear.weight.numel()
                for t in self.targets(model)
            }

    def weight_sparsity(self, model: nn.Module) -> float:
        """Fraction of zeros over the weights of all target layers together, counted in the effective weights."""
        zeros = total = 0
        with torch.no_grad():
            for target in self.targets(model):
                weight = target.linear.weight
                zeros += int((weight == 0).sum())
                total += weight.numel()
        return zeros / total

    def start_activation_count(self) -> None:
        """Starts counting zeros of the (pruned) inputs of every pruned layer."""
        for sparsifier in self.sparsifiers.values():
            sparsifier.start_count()

    def stop_activation_count(self) -> float | None:
        """Stops counting; returns the fraction of zeros seen since :meth:`start_activation_count`, if any."""
        zeros = total = 0
        for sparsifier in self.sparsifiers.values():
            sparsifier.counting = False
            if sparsifier.zeros is not None:
                zeros += int(sparsifier.zeros)
                total += sparsifier.numel
        return zeros / total if total else None


def _learners(targets: Sequence[PruneTarget]) -> dict[str, MovementMask]:
    """Layer name -> the score-learning mask of each target (a learned method's placeholders)."""
    return {t.name: t.linear.parametrizations.weight[0] for t in targets}
