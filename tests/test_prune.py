"""Pruning library: exact counts, tie-breaking, thresholds, masks under training, activation hooks, PEFT models."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.prune import (
    BRACKETED_SELECT_MIN,
    ActivationSparsifier,
    MaskSpec,
    Pruner,
    compute_weight_masks,
    find_prune_targets,
    is_weight_pruned,
    kth_smallest,
    make_pruning_permanent,
    masks_from_scores,
    num_to_prune,
    smallest_k,
    smallest_k_by_sort,
)
from tests.helpers import requires

ODD_SHAPES = [(7, 13), (5, 3), (1, 11), (17, 1), (3, 3)]
SPARSITIES = [0.0, 0.1, 0.25, 0.5, 0.7, 0.9, 0.99]


def expected_zeros(n: int, sparsity: float) -> int:
    """round(sparsity * n), half up, in exact rational arithmetic (independent of the library's Decimal)."""
    exact = Fraction(str(sparsity)) * n
    return int(exact + Fraction(1, 2)) if exact >= 0 else 0


def tied_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights with many exact ties (small integer magnitudes, both signs) to exercise tie-breaking."""
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randint(-3, 4, shape, generator=g).float() for i, shape in enumerate(ODD_SHAPES)}


def test_num_to_prune_rounds_half_up_exactly():
    cases = {(10, 0.25): 3, (5, 0.1): 1, (3, 0.5): 2, (7, 0.5): 4, (10, 0.7): 7, (1, 0.49): 0, (1, 0.5): 1}
    for (n, s), want in cases.items():
        assert num_to_prune(n, s) == want == expected_zeros(n, s)
    for n in range(0, 60):
        for s in SPARSITIES:
            assert num_to_prune(n, s) == expected_zeros(n, s)


@pytest.mark.parametrize("method", ["l1", "random"])
@pytest.mark.parametrize("scope", ["local", "global"])
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_weight_masks_have_exact_zero_counts(method, scope, sparsity):
    weights = tied_weights()
    masks = compute_weight_masks(weights, MaskSpec(sparsity, method, scope), torch.Generator().manual_seed(1))
    assert list(masks) == list(weights)
    for name, w in weights.items():
        assert masks[name].shape == w.shape and masks[name].dtype == torch.bool
    if scope == "local":
        for name, w in weights.items():
            assert int((~masks[name]).sum()) == expected_zeros(w.numel(), sparsity), name
    else:
        total = sum(w.numel() for w in weights.values())
        assert sum(int((~m).sum()) for m in masks.values()) == expected_zeros(total, sparsity)


def test_local_l1_prunes_smallest_magnitudes_ties_by_index():
    # |w| = [1, 3, 1, 2, 1, 0, 3]: ranking by (|w|, index) gives indices 5, 0, 2, 4, 3, 1, 6.
    w = torch.tensor([[1.0, -3.0, -1.0, 2.0, 1.0, 0.0, 3.0]])
    order = [5, 0, 2, 4, 3, 1, 6]
    for k in range(8):
        mask = compute_weight_masks({"w": w}, MaskSpec(k / 7 if k < 7 else 0.99, "l1", "local"))["w"]
        k_eff = expected_zeros(7, k / 7 if k < 7 else 0.99)
        assert sorted(torch.nonzero(~mask.flatten()).flatten().tolist()) == sorted(order[:k_eff])


def test_global_l1_threshold_matches_independent_sort():
    g = torch.Generator().manual_seed(3)
    weights = {f"l{i}": torch.randn(shape, generator=g) * (i + 1) for i, shape in enumerate(ODD_SHAPES)}
    sparsity = 0.37
    masks = compute_weight_masks(weights, MaskSpec(sparsity, "l1", "global"))
    # Independent: sort every magnitude in plain Python and take the k-th smallest.
    magnitudes = sorted(abs(v) for w in weights.values() for v in w.flatten().tolist())
    k = expected_zeros(len(magnitudes), sparsity)
    threshold = magnitudes[k - 1]
    pruned = torch.cat([w[~masks[n]].abs() for n, w in weights.items()])
    kept = torch.cat([w[masks[n]].abs() for n, w in weights.items()])
    assert pruned.numel() == k
    assert pruned.max().item() == pytest.approx(threshold, abs=0)
    assert kept.min().item() >= threshold
    # global differs from local here: layers are scaled differently, so per-layer sparsity is uneven.
    per_layer = [(~m).float().mean().item() for m in masks.values()]
    assert per_layer[0] > sparsity > per_layer[-1]


def test_global_ties_broken_by_concatenation_order():
    weights = {"a": torch.ones(2, 3), "b": torch.ones(3, 1)}
    masks = compute_weight_masks(weights, MaskSpec(4 / 9, "l1", "global"))
    assert (~masks["a"]).flatten().tolist() == [True, True, True, True, False, False]
    assert (~masks["b"]).flatten().tolist() == [False, False, False]


def test_random_masks_follow_the_seed():
    weights = tied_weights()
    spec = MaskSpec(0.5, "random", "local")
    a = compute_weight_masks(weights, spec, torch.Generator().manual_seed(7))
    b = compute_weight_masks(weights, spec, torch.Generator().manual_seed(7))
    c = compute_weight_masks(weights, spec, torch.Generator().manual_seed(8))
    assert all(torch.equal(a[n], b[n]) for n in weights)
    assert not all(torch.equal(a[n], c[n]) for n in weights)
    # random ignores magnitudes: it is not the l1 mask
    l1 = compute_weight_masks({"w0": torch.randn(7, 13)}, MaskSpec(0.5, "l1"))
    rnd = compute_weight_masks({"w0": torch.randn(7, 13)}, spec, torch.Generator().manual_seed(7))
    assert not torch.equal(l1["w0"], rnd["w0"])


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))


@pytest.mark.parametrize("scope", ["local", "global"])
def test_masked_weights_stay_zero_through_optimizer_steps(scope):
    model = mlp()
    params_before = list(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    pruner = Pruner(weight={"sparsity": 0.6, "method": "l1", "scope": scope}, exclude=None)
    pruner.prune(model)
    # The optimizer built before pruning still owns the (same) parameters that training updates.
    assert {id(p) for p in model.parameters()} == {id(p) for p in params_before}
    masks = {t.name: t.linear.parametrizations.weight[0].mask.clone() for t in pruner.targets(model)}
    originals = {
        t.name: t.linear.parametrizations.weight.original.detach().clone() for t in pruner.targets(model)
    }
    for _ in range(20):
        loss = F.cross_entropy(model(torch.randn(16, 9)), torch.randint(0, 3, (16,)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for t in pruner.targets(model):
        assert torch.equal(t.linear.parametrizations.weight[0].mask, masks[t.name])
        assert torch.all(t.linear.weight[~masks[t.name]] == 0)
        # kept weights did train
        assert not torch.equal(
            t.linear.parametrizations.weight.original[masks[t.name]], originals[t.name][masks[t.name]]
        )
    sizes = [63, 35, 15]
    zeros = (
        expected_zeros(sum(sizes), 0.6) if scope == "global" else sum(expected_zeros(n, 0.6) for n in sizes)
    )
    assert pruner.weight_sparsity(model) == zeros / sum(sizes)


def test_pruned_gradient_is_zero_and_permanent_export_keeps_zeros():
    model = mlp()
    pruner = Pruner(weight={"sparsity": 0.5}, exclude=None)
    pruner.prune(model)
    model(torch.randn(4, 9)).sum().backward()
    first = model[0]
    mask = first.parametrizations.weight[0].mask
    assert torch.all(first.parametrizations.weight.original.grad[~mask] == 0)
    dense = {n: t.linear.weight.detach().clone() for n, t in ((t.name, t) for t in pruner.targets(model))}
    assert make_pruning_permanent(model) == 3
    for t in pruner.targets(model):
        assert not is_weight_pruned(t.linear)
        assert isinstance(t.linear.weight, nn.Parameter)
        assert torch.equal(t.linear.weight, dense[t.name])
    assert set(model.state_dict()) == set(mlp().state_dict())


def test_placeholders_receive_saved_masks_and_keep_parameter_order():
    source = mlp()
    Pruner(weight={"sparsity": 0.4, "method": "l1"}, exclude=None).prune(source)
    state = source.state_dict()
    target = mlp()
    for p in target.parameters():
        nn.init.normal_(p)  # different weights: recomputed l1 masks would differ
    pruner = Pruner(weight={"sparsity": 0.4, "method": "l1"}, exclude=None)
    pruner.register_placeholders(target)
    assert not pruner.has_pruned_weights(target)
    assert torch.equal(target[0].weight, target[0].parametrizations.weight.original)  # all-ones: a no-op
    target.load_state_dict(state)
    assert pruner.has_pruned_weights(target)
    for (name, a), b in zip(source.named_modules(), target.modules()):
        if isinstance(a, nn.Linear):
            assert torch.equal(a.parametrizations.weight[0].mask, b.parametrizations.weight[0].mask), name
            assert torch.equal(a.weight, b.weight)
    # placeholders and real masks give the same parameter order (optimizer state is restored by position)
    assert [n for n, _ in source.named_parameters()] == [n for n, _ in target.named_parameters()]


# 16-bit fixed point on every linear's input and weight: fine enough not to zero the small test weights
INT16_LINEARS = {
    "by": "type",
    "linear": {
        "config": {
            "name": "integer",
            "weight_width": 16,
            "weight_frac_width": 8,
            "data_in_width": 16,
            "data_in_frac_width": 8,
        }
    },
}


@pytest.mark.parametrize("quantized", [False, True])
def test_state_saved_before_pruning_loads_into_placeholders_and_real_masks(quantized):
    """init_ckpt of a dense (optionally quantized) model into a model whose pruning structure exists already."""
    quant = pytest.importorskip("adls_lightning.quant")

    def build(seed: int, quantize: bool) -> nn.Sequential:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(9, 7), nn.ReLU(), nn.Linear(7, 5))
        if quantize:
            quant.quantize_model(model, INT16_LINEARS)
        return model

    dense = build(1, quantize=False)
    plain_state = {k: v.clone() for k, v in dense.state_dict().items()}  # keys "0.weight", "0.bias", ...
    # the source may be the plain model or a quantized one ("0.linear.weight"): both load
    source_state = build(1, quantize=quantized).state_dict() if quantized else plain_state
    for already_pruned in (False, True):
        target = build(2, quantize=True)
        pruner = Pruner(weight={"sparsity": 0.4, "method": "l1"}, exclude=None)
        (pruner.prune if already_pruned else pruner.register_placeholders)(target)
        masks = [m.linear.parametrizations.weight[0].mask.clone() for m in quant.quantized_layers(target)]
        target.load_state_dict(source_state, strict=True)
        for index, layer in zip((0, 2), quant.quantized_layers(target)):
            assert torch.equal(layer.linear.parametrizations.weight.original, plain_state[f"{index}.weight"])
            assert torch.equal(layer.linear.bias, plain_state[f"{index}.bias"])
        # the layers keep their own masks: all ones before pruning, the computed ones after
        kept = [m.linear.parametrizations.weight[0].mask for m in quant.quantized_layers(target)]
        assert all(torch.equal(a, b) for a, b in zip(masks, kept))
        assert pruner.has_pruned_weights(target) == already_pruned
    plain_target = mlp()
    Pruner(weight={"sparsity": 0.5, "method": "l1"}, exclude=None).register_placeholders(plain_target)
    plain_target.load_state_dict(mlp().state_dict(), strict=True)  # an unquantized dense model too


def test_state_of_a_pruned_plain_model_loads_into_a_quantized_pruned_one():
    """init_ckpt of a pruned full-precision run into the same pruning with quantization added: masks carry over."""
    quant = pytest.importorskip("adls_lightning.quant")
    torch.manual_seed(3)
    source = nn.Sequential(nn.Linear(9, 7), nn.ReLU(), nn.Linear(7, 5))
    Pruner(weight={"sparsity": 0.4, "method": "l1"}, exclude=None).prune(source)
    target = nn.Sequential(nn.Linear(9, 7), nn.ReLU(), nn.Linear(7, 5))
    quant.quantize_model(target, INT16_LINEARS)
    Pruner(weight={"sparsity": 0.4, "method": "l1"}, exclude=None).register_placeholders(target)
    target.load_state_dict(source.state_dict(), strict=True)
    for plain, layer in zip((source[0], source[2]), quant.quantized_layers(target)):
        assert torch.equal(
            layer.linear.parametrizations.weight[0].mask, plain.parametrizations.weight[0].mask
        )
        assert torch.equal(
            layer.linear.parametrizations.weight.original, plain.parametrizations.weight.original
        )
        assert int((layer.linear.weight == 0).sum()) == expected_zeros(plain.weight.numel(), 0.4)


def independent_activation_mask(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep-mask per sample from a stable argsort of |x| (ties: lower index pruned first)."""
    rows = x.reshape(x.shape[0], -1)
    k = expected_zeros(rows.shape[1], sparsity)
    keep = torch.ones_like(rows, dtype=torch.bool)
    for r in range(rows.shape[0]):
        order = sorted(range(rows.shape[1]), key=lambda i: (abs(rows[r, i].item()), i))
        keep[r, order[:k]] = False
    return keep.view_as(x)


def capture_inputs(module: nn.Module) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    return seen


def test_activation_masks_follow_the_live_input_per_sample():
    layer = nn.Linear(5, 2)
    pruner = Pruner(activation={"sparsity": 0.5, "method": "l1"}, exclude=None)
    pruner.prune(layer)
    seen = capture_inputs(layer)  # registered after the sparsifier: sees the pruned input
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(3, 4, 5, generator=g)
    x2 = torch.randint(-2, 3, (3, 4, 5), generator=g).float()  # many ties
    for x in (x1, x2):
        layer(x)
        keep = independent_activation_mask(x, 0.5)
        assert torch.equal(seen[-1], torch.where(keep, x, torch.zeros(())))
        assert ((seen[-1] == 0) & keep).sum() == (x == 0)[keep].sum()
    assert not torch.equal(seen[0] == 0, (seen[1] == 0))
    # per sample, not over the batch: scaling one sample does not move another sample's mask
    x3 = x1.clone()
    x3[0] *= 100
    layer(x3)
    assert torch.equal(seen[-1][1:] == 0, seen[0][1:] == 0)


def long_rows() -> dict[str, torch.Tensor]:
    """Rows long enough for the sampled-bracket selection, with the distributions that could trip it."""
    g = torch.Generator().manual_seed(5)
    n = BRACKETED_SELECT_MIN + 4099  # odd length, not a multiple of the sample size
    heavy = torch.randn(3, n, generator=g).abs()
    heavy[:, :50] = 1e6  # outliers
    return {
        "continuous": torch.randn(4, n, generator=g).abs(),
        "grid (many ties)": (torch.randn(4, n, generator=g) * 16).round().abs() / 16,
        "constant": torch.full((2, n), 0.25),
        "heavy tail": heavy,
        "sorted": torch.arange(2 * n, dtype=torch.float32).view(2, n),
        "with NaN": torch.cat(
            [torch.rand(2, n // 2, generator=g), torch.full((2, n - n // 2), float("nan"))], 1
        ),
    }


@pytest.mark.parametrize("sparsity", [1e-5, 0.1, 0.5, 0.9, 0.99999])
def test_bracketed_selection_is_exact_on_long_rows(sparsity):
    for name, scores in long_rows().items():
        k = max(1, num_to_prune(scores.shape[1], sparsity))
        expected = scores.kthvalue(k, dim=1, keepdim=True).values
        assert torch.equal(kth_smallest(scores, k), expected) or name == "with NaN", name
        if name == "with NaN":
            assert torch.equal(kth_smallest(scores, k).isnan(), expected.isnan())
            continue
        # the mask: exactly k per row, the k first of a stable argsort (ties by position)
        order = scores.argsort(dim=1, stable=True)
        independent = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, order[:, :k], True)
        assert torch.equal(smallest_k(scores, k), independent), name


@pytest.mark.parametrize("sparsity", [1e-5, 0.1, 0.5, 0.9, 0.99999])
def test_sort_route_marks_what_the_cpu_selection_marks(sparsity):
    """The route taken off the CPU (one stable sort per row) gives the CPU's selection (bracket or kthvalue, then
    ties by position) on every row kind, short rows and patterns' 4-wide rows too."""
    g = torch.Generator().manual_seed(6)
    short = {
        "short continuous": torch.randn(5, 777, generator=g),
        "short ties": (torch.randn(5, 777, generator=g) * 4).round(),
        "2:4 groups": (torch.randn(3000, 4, generator=g) * 2).round(),
    }
    for name, scores in {**long_rows(), **short}.items():
        if name == "with NaN":
            continue  # kthvalue's NaN threshold marks nothing past it; the sort ranks NaN last (checked below)
        k = max(1, num_to_prune(scores.shape[1], sparsity))
        by_sort = smallest_k_by_sort(scores, k)
        assert torch.equal(by_sort, smallest_k(scores, k)), name
        assert (by_sort.sum(dim=1) == k).all(), name
    with_nan = long_rows()["with NaN"]
    finite = with_nan[0].isfinite().sum().item()
    marked = smallest_k_by_sort(with_nan, finite)
    assert torch.equal(marked, with_nan.isfinite())  # the finite entries first, every NaN last


@requires("gpu")
def test_masks_on_the_gpu_equal_the_cpu_masks():
    """Weight masks computed on a CUDA device (the sort route) are the CPU's, local and global, with a pattern too."""
    g = torch.Generator().manual_seed(7)
    scores = {
        "wide": (torch.randn(384, 1536, generator=g) * 8).round(),
        "tall": torch.randn(1536, 384, generator=g),
        "square": torch.randn(384, 384, generator=g),
    }
    for spec in (MaskSpec(0.9), MaskSpec(0.5, scope="global"), MaskSpec(0.5, pattern="2:4")):
        on_cpu = masks_from_scores(scores, spec)
        on_gpu = masks_from_scores({name: s.cuda() for name, s in scores.items()}, spec)
        for name in scores:
            assert on_gpu[name].is_cuda
            assert torch.equal(on_gpu[name].cpu(), on_cpu[name]), (spec, name)


def test_activation_pruning_zeroes_inf_and_nan_inputs_too():
    """The fast multiply path is for finite inputs; a pruned inf or NaN still becomes an exact 0."""
    sparsifier = ActivationSparsifier(MaskSpec(0.5, "random", key="prune.activation"), seed=0)
    x = torch.rand(3, 40) + 1
    x[:, ::4] = float("inf")
    x[:, 1::4] = float("nan")
    finite = torch.rand(3, 40) + 1
    for tensor in (x, finite):
        out = sparsifier.prune(tensor)
        assert ((out == 0).sum(dim=1) == expected_zeros(40, 0.5)).all()
        kept = out != 0  # NaN != 0, so kept NaNs are compared too
        torch.testing.assert_close(out[kept], tensor[kept], rtol=0, atol=0, equal_nan=True)


def test_random_activation_pruning_counts_and_zero_counter():
    sparsifier = ActivationSparsifier(MaskSpec(0.3, "random", key="prune.activation"), seed=0)
    layer = nn.Linear(7, 2)
    layer.register_forward_pre_hook(sparsifier)
    seen = capture_inputs(layer)
    sparsifier.start_count()
    x = torch.rand(6, 7) + 1  # no natural zeros
    layer(x)
    layer(x)
    per_row = (seen[0] == 0).sum(dim=1)
    assert per_row.tolist() == [expected_zeros(7, 0.3)] * 6
    assert not torch.equal(seen[0], seen[1])  # fresh random mask each forward
    assert int(sparsifier.zeros) == 2 * 6 * expected_zeros(7, 0.3) and sparsifier.numel == 2 * 42


def test_gradient_flows_only_through_kept_activations():
    layer = nn.Linear(6, 1, bias=False)
    Pruner(activation={"sparsity": 0.5}, exclude=None).prune(layer)
    x = torch.tensor([[0.1, -5.0, 0.2, 4.0, -0.3, 3.0]], requires_grad=True)
    layer(x).sum().backward()
    assert (x.grad[0] != 0).tolist() == [False, True, False, True, False, True]


class WrappedLinear(nn.Module):
    """Mimics the quantization helper's QuantLinear: holds `.linear` and calls F.linear itself."""

    wrapped_child = "linear"  # declared as QuantLinear declares it (adls_lightning.layers)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return F.linear(x.round(), self.linear.weight.round(), self.linear.bias)


def test_wrapped_linear_hook_goes_on_wrapper_and_weights_on_inner():
    model = nn.Sequential(WrappedLinear(nn.Linear(8, 4)), nn.Linear(4, 2))
    pruner = Pruner(weight={"sparsity": 0.5}, activation={"sparsity": 0.25}, exclude=None)
    pruner.prune(model)
    targets = {t.name: t.linear_name for t in pruner.targets(model)}
    assert targets == {"0": "0.linear", "1": "1"}
    pruner.start_activation_count()
    model(torch.rand(3, 8) + 1)
    # both layers saw pruned inputs: the wrapper's hook fired although the inner linear's forward never runs
    assert pruner.sparsifiers["0"].zeros == 3 * 2
    assert pruner.sparsifiers["1"].numel == 3 * 4
    assert int((model[0].linear.weight == 0).sum()) == 16


def with_lora(model, lora: bool):
    """``model`` itself, or (``lora``) PEFT's LoRA model over it, with adapters on every linear but the head."""
    if not lora:
        return model
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(
        model,
        peft.LoraConfig(
            task_type="SEQ_CLS",
            r=4,
            target_modules=["query", "key", "value", "output.dense", "intermediate.dense"],
            modules_to_save=["classifier", "pooler"],
        ),
    )


@pytest.mark.parametrize("lora", [False, True])
def test_bert_targets_and_counted_sparsity(lora, tiny_bert):
    model = with_lora(tiny_bert(), lora)
    targets = find_prune_targets(model)
    names = [t.name for t in targets]
    # 6 linears per layer x 2 layers + pooler; never the classifier, LoRA adapters or PEFT's unused copies
    assert len(targets) == 13
    assert not any(("classifier" in n or "lora_" in n or "original_module" in n) for n in names)
    if lora:
        # canonical names (adls_lightning.layers): PEFT's prefix dropped; the weight is the LoRA layer's base layer
        assert all(
            t.linear_name == "base_model.model." + t.name + ".base_layer"
            for t in targets
            if "encoder" in t.name
        )
        assert type(targets[0].module).__name__ == "Linear" and targets[0].module is not targets[0].linear
    pruner = Pruner(weight={"sparsity": 0.5, "method": "l1"}, activation={"sparsity": 0.5})
    per_layer = pruner.prune(model)
    total = sum(t.linear.weight.numel() for t in targets)
    zeros = sum(expected_zeros(t.linear.weight.numel(), 0.5) for t in targets)
    assert pruner.weight_sparsity(model) == zeros / total
    assert all(v == 0.5 for v in per_layer.values())
    pruner.start_activation_count()
    model(input_ids=torch.randint(0, 100, (2, 9)))
    assert pruner.stop_activation_count() >= 0.5
    if lora:  # LoRA adds B @ A on top of the pruned base: once B is non-zero, the merged weight is dense
        layer = targets[0].module
        nn.init.normal_(layer.lora_B["default"].weight)
        merged = layer.base_layer.weight + layer.get_delta_weight("default")
        assert int((merged == 0).sum()) == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight": {"sparsity": 1.0}}, "prune.weight.sparsity=1.0: must be a number in [0.0, 1.0)"),
        ({"weight": {"sparsity": -0.1}}, "prune.weight.sparsity=-0.1: must be a number in [0.0, 1.0)"),
        ({"weight": {"sparsity": "half"}}, "prune.weight.sparsity='half'"),
        (
            {"weight": {"sparsity": 0.5, "method": "l2"}},
            "prune.weight.method='l2': must be one of l1, random",
        ),
        (
            {"weight": {"sparsity": 0.5, "scope": "layer"}},
            "prune.weight.scope='layer': must be one of local, global",
        ),
        ({"activation": {"sparsity": 1.5}}, "prune.activation.sparsity=1.5"),
        ({"activation": {"sparsity": 0.5, "method": "l2-norm"}}, "prune.activation.method='l2-norm'"),
        (
            {"activation": {"sparsity": 0.5, "scope": "global"}},
            "prune.activation.scope='global': must be local",
        ),
        (
            {"weight": {"sparsity": 0.5, "granularity": "channel"}},
            "prune.weight.granularity='channel': only elementwise",
        ),
        ({"weight": {"method": "l1"}}, "prune.weight.sparsity: missing"),
        ({"weight": {"sparsity": 0.5}, "exclude": ["("]}, "prune.exclude: '(' is not a valid regex"),
    ],
)
def test_bad_configs_fail_with_one_clear_line(kwargs, message):
    with pytest.raises(ConfigError) as err:
        Pruner(**kwargs)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_no_layer_left_is_an_error():
    with pytest.raises(ConfigError, match="no nn.Linear layer is left"):
        Pruner(weight={"sparsity": 0.5}, include=["nothing_matches"]).prune(mlp())


def test_int8_quantization_keeps_pruned_weights_exactly_zero(tiny_bert):
    quant = pytest.importorskip("adls_lightning.quant")
    model = with_lora(tiny_bert(), lora=True)
    int8 = {
        "name": "integer",
        "data_in_width": 8,
        "data_in_frac_width": 4,
        "weight_width": 8,
        "weight_frac_width": 4,
    }
    quant.quantize_model(
        model, {"by": "type", "linear": {"config": int8}}
    )  # quant first, as the callbacks run
    pruner = Pruner(weight={"sparsity": 0.5, "method": "l1"}, activation={"sparsity": 0.5})
    pruner.prune(model)
    targets = pruner.targets(model)
    layers = quant.quantized_layers(model)
    assert len(targets) == 13 and {id(t.linear) for t in targets} <= {id(q.linear) for q in layers}
    assert all(
        type(t.module).__name__ == "Linear" for t in targets if "encoder" in t.name
    )  # the LoRA wrapper
    for layer in layers:
        if not is_weight_pruned(layer.linear):
            continue
        mask = layer.linear.parametrizations.weight[0].mask
        quantized = layer.weight_quantizer(layer.linear.weight)
        assert torch.all(quantized[~mask] == 0)
        assert not torch.signbit(quantized[~mask]).any()  # +0.0, not -0.0
        # prune, then quantize: the quantized weight is the quantizer applied to the masked float weight
        dense = layer.linear.parametrizations.weight.original
        assert torch.equal(quantized, layer.weight_quantizer(torch.where(mask, dense, torch.zeros(()))))
    # the layer's forward uses exactly q_in(pruned x) and q_w(masked w)
    layer, target = layers[0], targets[0]
    assert layer is target.module.base_layer
    seen = capture_inputs(layer)
    x = torch.randn(2, 5, 32)
    out = target.module.base_layer(pruner.sparsifiers[target.name].prune(x))
    expected = F.linear(
        layer.data_in_quantizer(seen[-1]), layer.weight_quantizer(layer.linear.weight), layer.bias
    )
    assert torch.equal(out, expected)


def test_activation_hook_follows_a_later_module_swap():
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    pruner = Pruner(weight={"sparsity": 0.5}, activation={"sparsity": 0.5}, exclude=None)
    pruner.prune(model)
    plain = model[0]
    model[0] = WrappedLinear(plain)  # as post-training quantization does after fitting
    pruner.start_activation_count()
    model(torch.rand(3, 8) + 1)
    assert pruner.sparsifiers["0"].zeros is None  # the old hook sits on a module whose forward no longer runs
    pruner.attach_activation(model)
    assert len(plain._forward_pre_hooks) == 0 and len(model[0]._forward_pre_hooks) == 1
    pruner.start_activation_count()
    model(torch.rand(3, 8) + 1)
    assert int(pruner.sparsifiers["0"].zeros) == 3 * 4
    assert is_weight_pruned(model[0].linear)  # the mask moved along with the wrapped layer
