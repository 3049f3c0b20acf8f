"""Weight and activation pruning of linear layers with exact, deterministic sparsity.

Weight pruning puts a :class:`WeightMask` parametrization (``torch.nn.utils.parametrize``) on each pruned
``nn.Linear``: the layer keeps its dense ``original`` parameter (same ``nn.Parameter`` object, so optimizers keep
working) and its forward sees ``where(mask, original, 0)``. The mask is a persistent buffer, so it is part of the
model's ``state_dict`` and comes back with a checkpoint. Pruned entries get zero gradient, so fine-tuning never
revives them. :func:`make_pruning_permanent` bakes the zeros into a plain ``weight`` parameter for export.

Activation pruning is a forward pre-hook (:class:`ActivationSparsifier`) that zeroes the smallest (``l1``) or
random inputs of a layer, recomputed on every forward from the live input, separately for each sample.

Exactness: a layer of ``n`` weights pruned at sparsity ``s`` gets exactly ``round_half_up(s * n)`` zeros
(:func:`num_to_prune`), and a global scope gets exactly that many over all pruned weights together. Entries are
ranked by score (``|w|`` for ``l1``, seeded uniform noise for ``random``) and ties are broken by position (the
lower flat index is pruned first). Selection is exact (``torch.kthvalue``, on long CPU rows within a sampled
bracket: :func:`kth_smallest`), so there is no ``torch.quantile`` size limit.

Which layers: every linear layer :func:`adls_lightning.layers.target_layers` lists (canonical names), except PEFT LoRA adapters
(``lora_A``/``lora_B``), PEFT's inactive ``original_module`` copies and, by default, the classifier. In a PEFT LoRA
model the pruned weight is ``lora.Linear.base_layer``; LoRA then adds ``B @ A`` on top, so the effective merged
weight is not sparse and :meth:`Pruner.weight_sparsity` counts the base weights only. In a quantized model
(``QuantLinear`` with a ``.linear`` child) the inner linear is pruned, so the quantizer sees the masked weight:
prune first, then quantize the pruned weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from adls_lightning.errors import ConfigError, require_fraction
from adls_lightning.lab_config import load_lab_config
from adls_lightning.layers import name_filter, target_layers
from adls_lightning.registry import Registry, named_decorator

#: A pruning method: ``scores(tensor, generator) -> Tensor`` of the same shape; the lowest scores are pruned
#: (ties by position). ``generator`` is a seeded ``torch.Generator`` for methods that draw random numbers.
ScoreFn = Callable[[Tensor, torch.Generator], Tensor]
#: Method name (``prune.weight.method``) -> scoring function, filled by :func:`register_method`.
PRUNE_METHODS: Registry[ScoreFn] = Registry("pruning method")


def register_method(name: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator: make a scoring function available as ``method: <name>`` (``docs/extending.md``)."""
    return named_decorator(PRUNE_METHODS, name)


@register_method("l1")
def l1_scores(tensor: Tensor, generator: torch.Generator) -> Tensor:
    """Magnitude: the smallest ``|x|`` are pruned."""
    return tensor.detach().abs()


@register_method("random")
def random_scores(tensor: Tensor, generator: torch.Generator) -> Tensor:
    """Seeded uniform noise (drawn on the generator's device): a random ranking."""
    noise = torch.rand(tensor.shape, generator=generator, device=generator.device)
    return noise.to(tensor.device)


SCOPES = ("local", "global")
ACTIVATION_SCOPES = ("local",)
#: The labs' (MASE's) method names, mapped where a config is read.
MASE_METHODS = {"l1-norm": "l1"}
#: What one pruning decision covers; MASE also validates "channel" but has no criterion for it.
GRANULARITIES = ("elementwise",)
DEFAULT_EXCLUDE = ("classifier",)


@dataclass(frozen=True)
class MaskSpec:
    """What to prune in one kind of tensor (weights or activations).

    Args:
        sparsity: Fraction of entries set to zero, in [0, 1).
        method: ``"l1"`` (smallest magnitude; MASE's ``"l1-norm"`` is read as ``"l1"``) or ``"random"`` (seeded
            uniform ranking), or a method registered with :func:`register_method`.
        scope: ``"local"`` (per layer) or ``"global"`` (one ranking over all pruned layers; weights only).
        key: Config key prefix used in error messages, e.g. ``"prune.weight"``.

    Raises:
        ConfigError: If a field is out of range or unknown.
    """

    sparsity: float
    method: str = "l1"
    scope: str = "local"
    key: str = "prune.weight"

    def __post_init__(self) -> None:
        require_fraction(f"{self.key}.sparsity", self.sparsity)
        if self.method not in PRUNE_METHODS:
            raise ConfigError(f"{self.key}.method={self.method!r}: must be one of {', '.join(PRUNE_METHODS)}")
        if self.scope not in SCOPES:
            raise ConfigError(f"{self.key}.scope={self.scope!r}: must be one of {', '.join(SCOPES)}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, key: str) -> MaskSpec | None:
        """Builds a spec from a config mapping; ``None`` or an empty mapping means "do not prune".

        The labs' spellings are read too: ``method: l1-norm`` and ``granularity: elementwise`` (the only one).

        Raises:
            ConfigError: On unknown keys or invalid values.
        """
        if config is None or len(config) == 0:
            return None
        # a key set to None (chop's "NA") takes its default, as in chop
        config = {k: v for k, v in config.items() if v is not None}
        unknown = sorted(set(config) - {"sparsity", "method", "scope", "granularity"})
        if unknown:
            raise ConfigError(
                f"{key}.{unknown[0]}: unknown key; valid keys are sparsity, method, scope, granularity"
            )
        if "sparsity" not in config:
            raise ConfigError(f"{key}.sparsity: missing; give a number in [0, 1)")
        if isinstance(config["sparsity"], Mapping):
            raise ConfigError(
                f"{key}.sparsity: a per-layer mapping is not supported; give one number and choose layers "
                "with include/exclude"
            )
        granularity = config.pop("granularity", GRANULARITIES[0])
        if granularity not in GRANULARITIES:
            raise ConfigError(
                f"{key}.granularity={granularity!r}: only elementwise is implemented (structured pruning is not)"
            )
        if isinstance(config.get("method"), str):
            config["method"] = MASE_METHODS.get(config["method"], config["method"])
        return cls(key=key, **config)


def num_to_prune(numel: int, sparsity: float) -> int:
    """Number of entries to zero: ``sparsity * numel`` rounded half up, computed in decimal (no float drift)."""
    exact = Decimal(repr(float(sparsity))) * numel
    return int(exact.to_integral_value(rounding=ROUND_HALF_UP))


def count_true(mask: Tensor, keepdim: bool = False) -> Tensor:
    """True entries per row of a 2-D bool tensor, as int32 (summing bool directly goes through int64 and is
    several times slower on CPU)."""
    return mask.view(torch.uint8).sum(dim=1, keepdim=keepdim, dtype=torch.int32)


# Rows at least this long (on CPU) find their k-th value through a sampled bracket (see kth_smallest).
BRACKETED_SELECT_MIN = 1 << 16
_BRACKET_SAMPLE = 4096  # entries sampled per row to place the bracket
_BRACKET_SIGMAS = 4.0  # bracket half-width in binomial standard deviations of the sample rank
# a prime: positions i * step mod n scatter over the row in a fixed order (they repeat only when n is a multiple
# of it, which costs speed, not exactness)
_SAMPLE_STEP = 1_000_003


def kth_smallest(scores: Tensor, k: int) -> Tensor:
    """The ``k``-th smallest value (1-based) of each row of a 2-D ``scores``, exactly as ``kthvalue`` gives it.

    ``kthvalue`` reads and copies the whole row, and costs most of activation pruning on CPU. Long rows instead
    take a fixed scattered sample, bracket the k-th value between two of its order statistics, count the entries
    below the bracket and select within it (a few percent of the row). A row whose bracket misses the k-th value
    (rare: a 4-sigma event, or NaNs) falls back to ``kthvalue``, so the result is exact either way.

    Returns:
        A ``(rows, 1)`` tensor of the k-th smallest values.
    """
    rows, n = scores.shape
    if n < BRACKETED_SELECT_MIN or scores.device.type != "cpu":
        return scores.kthvalue(k, dim=1, keepdim=True).values
    positions = (torch.arange(_BRACKET_SAMPLE, dtype=torch.int64) * _SAMPLE_STEP) % n
    sample = scores[:, positions]
    centre = k / n * _BRACKET_SAMPLE
    half_width = _BRACKET_SIGMAS * (centre * (1 - k / n)) ** 0.5 + 1
    low_rank = max(1, int(centre - half_width))
    high_rank = min(_BRACKET_SAMPLE, int(centre + half_width) + 1)
    low = sample.kthvalue(low_rank, dim=1, keepdim=True).values
    high = sample.kthvalue(high_rank, dim=1, keepdim=True).values
    below = count_true(scores < low)
    inside = (scores >= low) & (scores <= high)
    in_bracket = count_true(inside)
    result = torch.empty(rows, 1, dtype=scores.dtype)
    for row in range(rows):
        rank = k - int(below[row])
        if 1 <= rank <= int(in_bracket[row]):
            result[row] = scores[row][inside[row]].kthvalue(rank).values
        else:
            result[row] = scores[row].kthvalue(k).values
    return result


def smallest_k(scores: Tensor, k: int) -> Tensor:
    """Marks the ``k`` smallest entries of each row of ``scores``.

    Ties at the threshold are resolved by position (lower index first), so exactly ``k`` entries per row are
    marked and the result is deterministic.

    Args:
        scores: A 2-D tensor ``(rows, n)``.
        k: Entries to mark per row, ``0 <= k <= n``.

    Returns:
        A bool tensor shaped like ``scores``, True where an entry is among the ``k`` smallest of its row.
    """
    if k <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    threshold = kth_smallest(scores, k)
    below = scores < threshold
    ties = scores == threshold
    ties_needed = k - count_true(below, keepdim=True)
    if scores.device.type == "cpu" and bool((count_true(ties, keepdim=True) == ties_needed).all()):
        return below | ties  # every tie is needed (the usual case): skip the position ranking
    return below | (ties & (ties.view(torch.uint8).cumsum(dim=1, dtype=torch.int32) <= ties_needed))


def _scores(tensor: Tensor, method: str, generator: torch.Generator) -> Tensor:
    """Ranking scores of ``tensor`` by the registered ``method`` (lowest pruned first)."""
    return PRUNE_METHODS[method](tensor, generator)


def compute_weight_masks(
    weights: Mapping[str, Tensor], spec: MaskSpec, generator: torch.Generator | None = None
) -> dict[str, Tensor]:
    """Keep-masks (True = keep) for a set of weights at ``spec.sparsity``.

    With ``local`` scope each weight gets exactly :func:`num_to_prune` zeros; with ``global`` scope the weights
    are ranked together and exactly ``num_to_prune(total)`` are zeroed across them, ties broken by position in
    the concatenation (mapping order, then flat index).

    Args:
        weights: Name → weight tensor, in a fixed order.
        spec: Sparsity, method and scope.
        generator: Seeded generator for ``random``; its stream is consumed in mapping order.

    Returns:
        Name → bool keep-mask shaped like the weight, on the weight's device.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    scores = {name: _scores(w, spec.method, generator).reshape(1, -1) for name, w in weights.items()}
    if spec.scope == "local":
        return {
            name: ~smallest_k(s, num_to_prune(s.numel(), spec.sparsity)).view_as(weights[name])
            for name, s in scores.items()
        }
    devices = {s.device for s in scores.values()}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    flat = torch.cat([s.to(device=device, dtype=torch.float32) for s in scores.values()], dim=1)
    pruned = smallest_k(flat, num_to_prune(flat.numel(), spec.sparsity)).squeeze(0)
    masks, start = {}, 0
    for name, w in weights.items():
        masks[name] = ~pruned[start : start + w.numel()].view_as(w).to(w.device)
        start += w.numel()
    return masks


class WeightMask(nn.Module):
    """Parametrization ``weight -> where(mask, weight, 0)`` with the mask as a persistent buffer.

    Being a buffer of the parametrization module, the mask is saved as ``<layer>.parametrizations.weight.0.mask``
    and restored by ``load_state_dict``. The zeros are exact ``+0.0``, which every quantizer maps to 0.
    """

    def __init__(self, mask: Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask.to(torch.bool))

    def forward(self, weight: Tensor) -> Tensor:
        return torch.where(self.mask, weight, weight.new_zeros(()))

    def right_inverse(self, weight: Tensor) -> Tensor:
        """Assigning ``layer.weight = w`` stores ``w`` as the original; the mask still applies on read."""
        return weight


def _accept_unpruned_state(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    """Load-state-dict pre-hook of a masked linear: a state saved before pruning loads into it.

    Such a state names the weight ``weight`` (a wrapping ``QuantLinear`` may already have renamed it) and has no
    mask: the weight goes to ``parametrizations.weight.original`` and the layer keeps its current mask (all ones
    until pruning is applied). States saved with masks load as they are.
    """
    original, plain = prefix + "parametrizations.weight.original", prefix + "weight"
    if not is_weight_pruned(module):
        return
    if original not in state_dict:
        if plain not in state_dict:
            return
        state_dict[original] = state_dict.pop(plain)
    for index, parametrization in enumerate(module.parametrizations.weight):
        if isinstance(parametrization, WeightMask):
            state_dict.setdefault(
                f"{prefix}parametrizations.weight.{index}.mask", parametrization.mask.clone()
            )


class ActivationSparsifier:
    """Forward pre-hook that prunes a layer's input per sample and counts zeros of what it passes on.

    Each sample (first dimension; a 1-D input is one sample) gets exactly ``num_to_prune(sample numel)`` zeros,
    chosen by ``|x|`` (``l1``) or by seeded noise (``random``), ties by position. Only the first positional
    argument is pruned. Zero counting is off until :meth:`start_count`, so its cost is paid only in the pass
    being measured.

    Args:
        spec: Sparsity and method, or ``None`` to only count zeros.
        seed: Seed of the per-device generators used by ``random``.
    """

    def __init__(self, spec: MaskSpec | None, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        self.counting = False
        self.zeros: Tensor | None = None
        self.numel = 0
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def prune(self, x: Tensor) -> Tensor:
        """Returns ``x`` with its per-sample lowest-ranked entries set to zero."""
        if self.spec is None or self.spec.sparsity == 0:
            return x
        rows = x.reshape(1, -1) if x.dim() < 2 else x.reshape(x.shape[0], -1)
        generator = self._generator(x.device)
        pruned = smallest_k(
            _scores(rows, self.spec.method, generator), num_to_prune(rows.shape[1], self.spec.sparsity)
        )
        pruned = pruned.view_as(x)
        if x.device.type == "cpu" and bool(torch.isfinite(x).all()):
            # same values (a pruned negative becomes -0.0) and gradient as masked_fill, several times faster on
            # CPU; with inf or NaN in x the product would give NaN where masked_fill gives 0
            return x * (~pruned).to(x.dtype)
        return x.masked_fill(pruned, 0)

    def start_count(self) -> None:
        """Resets the zero counters and starts counting."""
        self.counting, self.zeros, self.numel = True, None, 0

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], Tensor):
            return None
        x = self.prune(args[0])
        if self.counting:
            zeros = (x == 0).sum()
            self.zeros = zeros if self.zeros is None else self.zeros + zeros
            self.numel += x.numel()
        return (x, *args[1:])


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


def is_weight_pruned(linear: nn.Module) -> bool:
    """True if ``linear.weight`` carries a :class:`WeightMask` parametrization."""
    return parametrize.is_parametrized(linear, "weight") and any(
        isinstance(p, WeightMask) for p in linear.parametrizations.weight
    )


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
        weight: Weight pruning config ``{sparsity, method, scope}`` or ``None``/``{}`` for none.
        activation: Activation pruning config ``{sparsity, method, scope: local}`` or ``None``/``{}``.
        include: Regexes selecting layers by name (default: all).
        exclude: Regexes removing layers by name (default: ``["classifier"]``).
        seed: Seed for ``random`` weight and activation masks.
        key: Config key prefix for error messages.

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
    ) -> None:
        self.weight = MaskSpec.from_config(weight, f"{key}.weight")
        self.activation = MaskSpec.from_config(activation, f"{key}.activation")
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

    def targets(self, model: nn.Module) -> list[PruneTarget]:
        """The layers this pruner acts on in ``model`` (see :func:`find_prune_targets`)."""
        targets = find_prune_targets(model, self.include, self.exclude)
        if not targets:
            raise ConfigError(
                f"prune.include={self.include} / prune.exclude={self.exclude}: no nn.Linear layer is left to prune"
            )
        return targets

    def register_placeholders(self, model: nn.Module) -> None:
        """Registers all-ones (no-op) weight masks on every target that has none yet.

        Doing this in ``setup``, before the optimizer is built, fixes the module structure for the whole fit:
        ``parametrize`` moves ``weight`` behind ``bias`` in the parameter order, and Lightning restores optimizer
        state by position, so the structure must not change between the run that saved a checkpoint and the run
        that resumes it. It also gives ``load_state_dict`` the mask buffers that a checkpoint fills in.
        """
        if self.weight is None:
            return
        for target in self.targets(model):
            if not is_weight_pruned(target.linear):
                mask = torch.ones_like(target.linear.weight, dtype=torch.bool)
                parametrize.register_parametrization(target.linear, "weight", WeightMask(mask))
            if not getattr(target.linear, "_accepts_unpruned_state", False):
                target.linear.register_load_state_dict_pre_hook(_accept_unpruned_state)
                target.linear._accepts_unpruned_state = True

    def prune(self, model: nn.Module) -> dict[str, float]:
        """Computes weight masks from the current (effective) weights and starts activation pruning.

        Masks are fixed from then on: call once per model.

        Returns:
            Layer name → realised weight sparsity (counted zeros).
        """
        targets = self.targets(model)
        if self.weight is not None:
            generator = torch.Generator().manual_seed(self.seed)
            weights = {t.name: t.linear.weight for t in targets}
            masks = compute_weight_masks(weights, self.weight, generator)
            self.register_placeholders(model)
            for target in targets:
                target.linear.parametrizations.weight[0].mask.copy_(masks[target.name])
        self.attach_activation(model)
        return self.layer_sparsity(model)

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
