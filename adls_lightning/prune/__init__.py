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

One-shot weight pruning from calibration data (``wanda``, ``sparsegpt``) and ``N:M`` patterns (``pattern: "2:4"``,
for any method) are in :mod:`~adls_lightning.prune.oneshot` and :func:`~adls_lightning.prune.masks.pattern_pruned`;
movement pruning (scores learned while training) and the cubic sparsity schedule in
:mod:`~adls_lightning.prune.movement`; structured pruning, which physically removes whole attention heads and FFN
neurons (smaller linears, faster on CPU), in :mod:`~adls_lightning.prune.structured`.

Modules, one per family: :mod:`~adls_lightning.prune.scores` (the method registries, ``l1``, ``random``),
:mod:`~adls_lightning.prune.masks` (specs, exact counts, patterns, :class:`WeightMask`),
:mod:`~adls_lightning.prune.activations` (:class:`ActivationSparsifier`), :mod:`~adls_lightning.prune.oneshot`
(Wanda, SparseGPT), :mod:`~adls_lightning.prune.movement` (:class:`MovementMask`, :class:`CubicSchedule`),
:mod:`~adls_lightning.prune.pruner` (:class:`Pruner`, layer selection) and :mod:`~adls_lightning.prune.structured`
(:class:`StructuredPruner`, reloading at the pruned sizes). Every public name is
re-exported here.
"""

from __future__ import annotations

from adls_lightning.prune.activations import ActivationSparsifier
from adls_lightning.prune.masks import (
    BRACKETED_SELECT_MIN,
    GRANULARITIES,
    MASE_METHODS,
    SCOPES,
    MaskSpec,
    WeightMask,
    check_pattern,
    compute_weight_masks,
    count_true,
    is_weight_pruned,
    kth_smallest,
    masks_from_scores,
    num_to_prune,
    parse_pattern,
    pattern_pruned,
    smallest_k,
    smallest_k_by_sort,
)
from adls_lightning.prune.movement import (
    SCHEDULE_KEYS,
    AdamMovementMask,
    CubicSchedule,
    MovementMask,
    clip_score_gradients,
    register_learned,
)
from adls_lightning.prune.oneshot import OneShotFn, SparseGPTConfig, register_oneshot, sparsegpt, wanda
from adls_lightning.prune.pruner import (
    ACTIVATION_SCOPES,
    DEFAULT_EXCLUDE,
    Pruner,
    PruneTarget,
    find_prune_targets,
    lab_pruning_specs,
    make_pruning_permanent,
)
from adls_lightning.prune.scores import (
    LEARNED_METHODS,
    ONESHOT_METHODS,
    PRUNE_METHODS,
    ScoreFn,
    l1_scores,
    random_scores,
    rank_scores,
    register_method,
    weight_methods,
)
from adls_lightning.prune.structured import (
    STRUCTURED_METHODS,
    StructuredPruner,
    fit_structure_to_state,
    load_pretrained_structured,
)
from adls_lightning.prune.structured import layer_sparsity as structured_layer_sparsity
from adls_lightning.prune.structured import weight_sparsity as structured_weight_sparsity

__all__ = [
    "ACTIVATION_SCOPES",
    "BRACKETED_SELECT_MIN",
    "DEFAULT_EXCLUDE",
    "GRANULARITIES",
    "LEARNED_METHODS",
    "MASE_METHODS",
    "ONESHOT_METHODS",
    "PRUNE_METHODS",
    "SCHEDULE_KEYS",
    "SCOPES",
    "STRUCTURED_METHODS",
    "ActivationSparsifier",
    "AdamMovementMask",
    "CubicSchedule",
    "MaskSpec",
    "MovementMask",
    "OneShotFn",
    "PruneTarget",
    "Pruner",
    "ScoreFn",
    "SparseGPTConfig",
    "StructuredPruner",
    "WeightMask",
    "check_pattern",
    "clip_score_gradients",
    "compute_weight_masks",
    "count_true",
    "find_prune_targets",
    "fit_structure_to_state",
    "is_weight_pruned",
    "kth_smallest",
    "l1_scores",
    "lab_pruning_specs",
    "load_pretrained_structured",
    "make_pruning_permanent",
    "masks_from_scores",
    "num_to_prune",
    "parse_pattern",
    "pattern_pruned",
    "random_scores",
    "rank_scores",
    "register_learned",
    "register_method",
    "register_oneshot",
    "smallest_k",
    "smallest_k_by_sort",
    "sparsegpt",
    "structured_layer_sparsity",
    "structured_weight_sparsity",
    "wanda",
    "weight_methods",
]
