"""Weight masks with exact, deterministic counts: what to prune (:class:`MaskSpec`), how many
(:func:`num_to_prune`), which entries (:func:`smallest_k`, :func:`compute_weight_masks`) and how a mask sits on a layer
(:class:`WeightMask`, a ``torch.nn.utils.parametrize`` parametrization whose mask is a persistent buffer)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, TypedDict

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from adls_lightning.errors import ConfigError, require_fraction
from adls_lightning.prune.scores import ONESHOT_METHODS, rank_scores, weight_methods

SCOPES = ("local", "global")
#: The labs' (MASE's) method names, mapped where a config is read.
MASE_METHODS = {"l1-norm": "l1"}
#: What one pruning decision covers; MASE also validates "channel" but has no criterion for it.
GRANULARITIES = ("elementwise",)


class MaskSettings(TypedDict, total=False):
    """``prune.weight`` / ``prune.activation`` as a config gives them (read by :meth:`MaskSpec.from_config`; ``null``
    is chop's ``"NA"``: the default)."""

    sparsity: float | None
    method: str | None
    scope: str | None
    granularity: str | None
    pattern: str | None


@dataclass(frozen=True)
class MaskSpec:
    """What to prune in one kind of tensor (weights or activations).

    Args:
        sparsity: Fraction of entries set to zero, in [0, 1).
        method: ``"l1"`` (smallest magnitude; MASE's ``"l1-norm"`` is read as ``"l1"``) or ``"random"`` (seeded
            uniform ranking), or a method registered with :func:`register_method`; for weights also the one-shot
            methods ``"wanda"`` and ``"sparsegpt"`` (:mod:`adls_lightning.prune.oneshot`) and ``"movement"``, whose
            scores are learned while training (:mod:`adls_lightning.prune.movement`).
        scope: ``"local"`` (per layer) or ``"global"`` (one ranking over all pruned layers; weights only, not with
            a pattern or a one-shot method).
        key: Config key prefix used in error messages, e.g. ``"prune.weight"``.
        pattern: ``None`` (unstructured) or ``"N:M"``: in every group of ``M`` consecutive input weights of an
            output row keep the ``N`` with the highest scores (``"2:4"``, the pattern sparse tensor cores run);
            the sparsity is then ``(M - N) / M``.

    Raises:
        ConfigError: If a field is out of range or unknown.
    """

    sparsity: float
    method: str = "l1"
    scope: str = "local"
    key: str = "prune.weight"
    pattern: str | None = None

    def __post_init__(self) -> None:
        require_fraction(f"{self.key}.sparsity", self.sparsity)
        if self.method not in weight_methods():
            raise ConfigError(
                f"{self.key}.method={self.method!r}: must be one of {', '.join(weight_methods())}"
            )
        if self.scope not in SCOPES:
            raise ConfigError(f"{self.key}.scope={self.scope!r}: must be one of {', '.join(SCOPES)}")
        if self.pattern is not None:
            n, m = parse_pattern(self.pattern, f"{self.key}.pattern")
            if abs(self.sparsity - (m - n) / m) > 1e-6:
                raise ConfigError(
                    f"{self.key}.sparsity={self.sparsity}: {self.key}.pattern={self.pattern!r} prunes {m - n} of "
                    f"every {m} weights; set {self.key}.sparsity={(m - n) / m:g} or null"
                )
        if self.scope == "global" and (self.pattern is not None or self.method in ONESHOT_METHODS):
            what = f"pattern {self.pattern!r}" if self.pattern is not None else f"method {self.method!r}"
            raise ConfigError(
                f"{self.key}.scope='global': the {what} chooses within each layer (its rows or groups); use local"
            )

    @property
    def nm(self) -> tuple[int, int] | None:
        """``(N, M)`` of the pattern (keep ``N`` of every ``M``), or ``None`` when unstructured."""
        return None if self.pattern is None else parse_pattern(self.pattern, f"{self.key}.pattern")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, key: str) -> MaskSpec | None:
        """Builds a spec from a config mapping; ``None`` or an empty mapping means "do not prune".

        The labs' spellings are read too: ``method: l1-norm`` and ``granularity: elementwise`` (the only one).
        With a ``pattern`` the sparsity may be left out: it is the pattern's.

        Raises:
            ConfigError: On unknown keys or invalid values.
        """
        if config is None or len(config) == 0:
            return None
        # a key set to None (chop's "NA") takes its default, as in chop
        config = {k: v for k, v in config.items() if v is not None}
        unknown = sorted(set(config) - {"sparsity", "method", "scope", "granularity", "pattern"})
        if unknown:
            raise ConfigError(
                f"{key}.{unknown[0]}: unknown key; valid keys are sparsity, method, scope, granularity, pattern"
            )
        if "pattern" in config and "sparsity" not in config:
            n, m = parse_pattern(config["pattern"], f"{key}.pattern")
            config["sparsity"] = (m - n) / m
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


def parse_pattern(pattern: Any, key: str) -> tuple[int, int]:
    """``(N, M)`` of an ``"N:M"`` pattern string (keep ``N`` of every ``M``).

    Raises:
        ConfigError: anything but ``"N:M"`` with ``0 < N < M``, named ``key``.
    """
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", pattern) if isinstance(pattern, str) else None
    if match is not None and 0 < int(match[1]) < int(match[2]):
        return int(match[1]), int(match[2])
    raise ConfigError(
        f"{key}={pattern!r}: must be a string 'N:M' with 0 < N < M (keep N of every M consecutive input weights "
        "of a row), e.g. '2:4'"
    )


def check_pattern(spec: MaskSpec | None, in_features: Mapping[str, int]) -> None:
    """Every layer's rows (``in_features`` by layer name) split into whole groups of the spec's ``M``.

    Raises:
        ConfigError: the first layer whose input size is not a multiple of ``M``.
    """
    if spec is None or spec.nm is None:
        return
    m = spec.nm[1]
    for name, size in in_features.items():
        if size % m:
            raise ConfigError(
                f"{spec.key}.pattern={spec.pattern!r}: layer {name} has {size} input features, not a multiple of "
                f"{m}; exclude it (prune.exclude) or choose another M"
            )


def pattern_pruned(scores: Tensor, n: int, m: int) -> Tensor:
    """True where an entry of ``scores`` (out × in, ``in`` a multiple of ``m``) is pruned: the ``m - n`` lowest of
    every group of ``m`` consecutive entries of a row, ties by position (the lower index is pruned first)."""
    return smallest_k(scores.reshape(-1, m), m - n).view(scores.shape)


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
    if scores.device.type != "cpu":
        return smallest_k_by_sort(scores, k)
    threshold = kth_smallest(scores, k)
    below = scores < threshold
    ties = scores == threshold
    ties_needed = k - count_true(below, keepdim=True)
    if bool((count_true(ties, keepdim=True) == ties_needed).all()):
        return below | ties  # every tie is needed (the usual case): skip the position ranking
    return below | (ties & (ties.view(torch.uint8).cumsum(dim=1, dtype=torch.int32) <= ties_needed))


def smallest_k_by_sort(scores: Tensor, k: int) -> Tensor:
    """:func:`smallest_k` through a stable sort of each row: its first ``k`` positions are the ``k`` smallest entries,
    ties by position. The route off the CPU: CUDA's ``kthvalue`` selects each row inside one thread block, and a
    whole layer's weights is one row (0.59 M scores in each of MiniLM's FFN layers), while a sort spreads a row over
    the whole GPU (``benchmarks/bench_masks.py`` times both)."""
    first = scores.sort(dim=1, stable=True).indices[:, :k]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, first, True)


def compute_weight_masks(
    weights: Mapping[str, Tensor], spec: MaskSpec, generator: torch.Generator | None = None
) -> dict[str, Tensor]:
    """Keep-masks (True = keep) for a set of weights at ``spec.sparsity``.

    With ``local`` scope each weight gets exactly :func:`num_to_prune` zeros; with ``global`` scope the weights
    are ranked together and exactly ``num_to_prune(total)`` are zeroed across them, ties broken by position in
    the concatenation (mapping order, then flat index). With a ``pattern`` (local only) every group of ``M``
    consecutive entries of a row (2-D weights, ``out × in``) keeps its ``N`` highest scores (:func:`pattern_pruned`).

    Args:
        weights: Name → weight tensor, in a fixed order.
        spec: Sparsity, method and scope.
        generator: Seeded generator for ``random``; its stream is consumed in mapping order.

    Returns:
        Name → bool keep-mask shaped like the weight, on the weight's device.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    return masks_from_scores(
        {name: rank_scores(w, spec.method, generator) for name, w in weights.items()}, spec
    )


def masks_from_scores(scores: Mapping[str, Tensor], spec: MaskSpec) -> dict[str, Tensor]:
    """Keep-masks (True = keep) from ranking scores (the lowest pruned first, ties by position) at
    ``spec.sparsity``, in ``spec``'s scope or pattern, as :func:`compute_weight_masks` describes.

    Args:
        scores: Name → scores shaped like the weight (2-D ``out × in`` for a pattern), in a fixed order.
        spec: Sparsity, scope and pattern (its method is not read: the scores are given).

    Returns:
        Name → bool keep-mask shaped like the scores, on their device.
    """
    if spec.nm is not None:
        check_pattern(spec, {name: s.shape[-1] for name, s in scores.items()})
        return {name: ~pattern_pruned(s.reshape(s.shape[0], -1), *spec.nm) for name, s in scores.items()}
    rows = {name: s.reshape(1, -1) for name, s in scores.items()}
    if spec.scope == "local":
        return {
            name: ~smallest_k(row, num_to_prune(row.numel(), spec.sparsity)).view_as(scores[name])
            for name, row in rows.items()
        }
    devices = {row.device for row in rows.values()}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    flat = torch.cat([row.to(device=device, dtype=torch.float32) for row in rows.values()], dim=1)
    pruned = smallest_k(flat, num_to_prune(flat.numel(), spec.sparsity)).squeeze(0)
    masks, start = {}, 0
    for name, s in scores.items():
        masks[name] = ~pruned[start : start + s.numel()].view_as(s).to(s.device)
        start += s.numel()
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


def is_weight_pruned(linear: nn.Module) -> bool:
    """True if ``linear.weight`` carries a :class:`WeightMask` parametrization."""
    return parametrize.is_parametrized(linear, "weight") and any(
        isinstance(p, WeightMask) for p in linear.parametrizations.weight
    )
