"""Movement pruning and the cubic sparsity schedule: scores against -Σ W·∂L/∂W' computed by hand, exact top-k masks,
the schedule against its formula, ``train.py prune=movement_0.9`` end to end, kill-and-resume, one-line errors."""

from __future__ import annotations

import csv
import json
import re
from fractions import Fraction
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from adls_lightning.app.training import run
from adls_lightning.build import build
from adls_lightning.callbacks.pruning import PruningCallback
from adls_lightning.errors import ConfigError
from adls_lightning.prune import (
    AdamMovementMask,
    CubicSchedule,
    MovementMask,
    Pruner,
    WeightMask,
)
from tests.helpers import assert_one_line_error, kill_and_resume, recording, run_train

SMALL = ["data.train_size=64", "data.val_size=16", "data.test_size=16", "data.max_length=32"]
MASK_SUFFIX = ".parametrizations.weight.0.mask"
# tiny_random: 2 layers x (q, k, v, attention.output 32x32; intermediate 64x32; output 32x64) + pooler 32x32
TINY_LAYER_SIZES = [32 * 32] * 4 + [64 * 32] * 2
TINY_SIZES = TINY_LAYER_SIZES * 2 + [32 * 32]


def zeros_at(n: int, sparsity: float) -> int:
    """round(sparsity * n), half up, in exact rational arithmetic (independent of the library's Decimal)."""
    return int(Fraction(str(sparsity)) * n + Fraction(1, 2))


class TwoLinears(nn.Module):
    """A tiny model of two prunable linears (none named like the default-excluded classifier)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 5)
        self.second = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def test_scores_are_minus_weight_times_masked_weight_gradient_summed_over_steps():
    """Scores after a few SGD steps equal -Σ_t W_t ⊙ (∂L/∂W'_t) with the gradient of y = x W'ᵀ + b under an MSE loss
    written out by hand; after half the weights are masked, the pruned entries keep scoring (straight-through)."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    pruner = Pruner(weight={"method": "movement", "sparsity": 0.5})
    pruner.register_placeholders(layer)
    assert isinstance(layer.parametrizations.weight[0], MovementMask)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    expected = torch.zeros(4, 6, dtype=torch.float64)
    for step in range(5):
        x, target = torch.randn(8, 6), torch.randn(8, 4)
        weight = layer.parametrizations.weight.original.detach().double().clone()
        mask = layer.parametrizations.weight[0].mask.double()
        # by hand: y = x (M ⊙ W)ᵀ + b, L = mean((y - t)²), ∂L/∂y = 2 (y - t) / numel, ∂L/∂W' = (∂L/∂y)ᵀ x
        y = x.double() @ (mask * weight).T + layer.bias.detach().double()
        grad_masked = (2 * (y - target.double()) / y.numel()).T @ x.double()
        expected -= weight * grad_masked
        optimizer.zero_grad()
        nn.functional.mse_loss(layer(x), target).backward()
        optimizer.step()
        pruner.prune_scheduled(
            layer, 0.5 if step >= 2 else 0.0
        )  # from step 3 on, half of the weights are masked
        scores = layer.parametrizations.weight[0].scores
        torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-6)
    assert not bool(mask.all())  # the last steps had masked entries ...
    assert bool((expected[mask == 0] != 0).all())  # ... and those kept being scored
    # the weights' own gradient is still masked: pruned weights are not trained
    assert bool((layer.parametrizations.weight.original.grad[mask == 0] == 0).all())


def test_adam_scores_are_what_torch_adam_learns_on_the_straight_through_gradient():
    """``movement_adam``'s scores after a few steps (two micro-batches each, half the weights masked from step 3,
    the schedule's lr multiplier changing) equal a score parameter S trained by ``torch.optim.Adam`` (lr = the
    multiplier) on ∂L/∂S = ∂L/∂W' ⊙ W, W' = M ⊙ W, the paper's straight-through gradient, written out by hand."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    pruner = Pruner(weight={"method": "movement_adam", "sparsity": 0.5})
    pruner.register_placeholders(layer)
    learner = layer.parametrizations.weight[0]
    assert isinstance(learner, AdamMovementMask)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    reference = torch.zeros(4, 6, dtype=torch.float64, requires_grad=True)
    adam = torch.optim.Adam([reference], lr=1.0, betas=learner.betas, eps=learner.eps)
    pruner.prune_scheduled(layer, 0.0)  # no backward yet: nothing learned, Adam's state untouched
    assert int(learner.step) == 0 and not bool(learner.scores.any())
    for step, lr_scale in enumerate([0.5, 1.0, 0.9, 0.6, 0.3]):
        weight = layer.parametrizations.weight.original.detach().double().clone()
        mask = learner.mask.double()
        gradient = torch.zeros(4, 6, dtype=torch.float64)
        optimizer.zero_grad()
        for _ in range(2):  # gradient accumulation: one score update per optimizer step
            x, target = torch.randn(8, 6), torch.randn(8, 4)
            y = x.double() @ (mask * weight).T + layer.bias.detach().double()
            gradient += weight * ((2 * (y - target.double()) / y.numel()).T @ x.double())  # ∂L/∂W' ⊙ W
            nn.functional.mse_loss(layer(x), target).backward()
        optimizer.step()
        pruner.prune_scheduled(layer, 0.5 if step >= 2 else 0.0, lr_scale=lr_scale)
        reference.grad = gradient
        adam.param_groups[0]["lr"] = lr_scale
        adam.step()
        torch.testing.assert_close(learner.scores.double(), reference.detach(), rtol=1e-4, atol=1e-6)
    assert int(learner.step) == 5
    kept = learner.scores.flatten().argsort(descending=True)[:12]  # the masks keep the highest learned scores
    assert set(learner.mask.flatten().nonzero().flatten().tolist()) == set(kept.tolist())


class PaperMovement(nn.Module):
    """The paper's formulation, as a reference: a linear layer whose scores S are a parameter, the mask M the top
    half of S, and W' = W ⊙ (M + S - S.detach()): numerically M ⊙ W, with ∂L/∂S = ∂L/∂W' ⊙ W (straight-through)
    and ∂L/∂W = ∂L/∂W' ⊙ M. Its parameters, S among them, are clipped together by torch's own clipping."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().double().clone())
        self.bias = nn.Parameter(bias.detach().double().clone())
        self.scores = nn.Parameter(torch.zeros_like(self.weight))
        self.register_buffer("mask", torch.ones_like(self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        straight_through = self.mask + self.scores - self.scores.detach()
        return x.double() @ (self.weight * straight_through).T + self.bias

    def keep_highest(self, sparsity: float) -> None:
        kept = (
            self.scores.detach()
            .flatten()
            .argsort(descending=True)[: self.mask.numel() - zeros_at(self.mask.numel(), sparsity)]
        )
        self.mask.zero_().view(-1)[kept] = 1.0


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_adam_scores_learn_from_gradients_clipped_with_the_weights(algorithm):
    """With the trainer clipping gradients, ``movement_adam``'s scores are those of the paper's code: S a parameter
    beside W and b, all three clipped by one ``clip_grad_norm_`` (or ``clip_grad_value_``), then Adam on S. The
    threshold is chosen so that some steps are clipped and some are not, and the unclipped scores differ. The
    weights are the trainer's (clipped without the scores, which are not its parameters: on MiniLM they add about
    0.1 % to the norm), copied into the reference before each step."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    paper = PaperMovement(layer.weight, layer.bias)
    pruner = Pruner(weight={"method": "movement_adam", "sparsity": 0.5})
    pruner.register_placeholders(layer)
    learner = layer.parametrizations.weight[0]
    sgd = torch.optim.SGD(layer.parameters(), lr=0.05)
    adam = torch.optim.Adam([paper.scores], lr=1.0, betas=learner.betas, eps=learner.eps)
    unclipped = torch.zeros(4, 6, dtype=torch.float64, requires_grad=True)
    unclipped_adam = torch.optim.Adam([unclipped], lr=1.0, betas=learner.betas, eps=learner.eps)
    clip_val = {"norm": 0.5, "value": 0.05}[algorithm]
    clipped_steps = 0
    for step, input_scale in enumerate([0.2, 3.0, 0.5, 4.0, 0.1, 2.0]):
        x, target = input_scale * torch.randn(8, 6), torch.randn(8, 4)
        with torch.no_grad():
            paper.weight.copy_(layer.parametrizations.weight.original)
            paper.bias.copy_(layer.bias)
        sgd.zero_grad()
        nn.functional.mse_loss(layer(x), target).backward()
        paper.zero_grad()
        nn.functional.mse_loss(paper(x), target.double()).backward()
        unclipped.grad = paper.scores.grad.clone()
        # the trainer: clip the weights' gradients; the callback: clip the scores' with them
        weight_grads = [p.grad for p in layer.parameters()]
        norm = torch.nn.utils.get_total_norm(weight_grads)
        factor = pruner.finish_score_step(
            layer, clip_val=clip_val, clip_algorithm=algorithm, parameter_norm=norm
        )
        if algorithm == "norm":
            total = torch.nn.utils.clip_grad_norm_(list(paper.parameters()), clip_val)
            torch.nn.utils.clip_grad_norm_(list(layer.parameters()), clip_val)
            assert factor == pytest.approx(min(1.0, clip_val / (float(total) + 1e-6)), rel=1e-5)
            clipped_steps += factor < 1.0
        else:
            torch.nn.utils.clip_grad_value_(list(paper.parameters()), clip_val)
            torch.nn.utils.clip_grad_value_(list(layer.parameters()), clip_val)
            clipped_steps += bool((unclipped.grad.abs() > clip_val).any())
        sgd.step()
        adam.step()
        unclipped_adam.step()
        sparsity = 0.5 if step >= 2 else 0.0
        pruner.prune_scheduled(layer, sparsity)
        paper.keep_highest(sparsity)
        torch.testing.assert_close(learner.scores.double(), paper.scores.detach(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(learner.mask.double(), paper.mask)
    assert 0 < clipped_steps < 6
    assert not torch.allclose(paper.scores.detach(), unclipped.detach(), rtol=1e-2, atol=1e-3)


class _OneLinear(L.LightningModule):
    """The smallest module the pruning callback can sit under: one prunable linear, SGD, an MSE loss."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.layer = layer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.layer(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_the_callback_clips_the_scores_gradients_with_the_trainers_clipping():
    """``PruningCallback`` under ``L.Trainer(gradient_clip_val=0.5)``: after six steps (two dense, then a ramp to 50 %)
    the scores, masks and weights are those of a loop written out by hand, where the scores' gradient is multiplied by
    clip_grad_norm_'s factor over the weights' and scores' gradients together and the trainer clips the weights."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    paper = PaperMovement(layer.weight, layer.bias)
    generator = torch.Generator().manual_seed(3)
    scales = [0.2, 3.0, 0.5, 4.0, 0.1, 2.0]
    batches = [
        (s * torch.randn(8, 6, generator=generator), torch.randn(8, 4, generator=generator)) for s in scales
    ]
    schedule = {"initial_sparsity": 0.0, "warmup": 0.34, "cooldown": 0.0}
    callback = PruningCallback(weight={"method": "movement_adam", "sparsity": 0.5}, schedule=schedule)
    trainer = L.Trainer(
        max_epochs=1,
        gradient_clip_val=0.5,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(_OneLinear(layer), train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    learner = layer.parametrizations.weight[0]

    sgd = torch.optim.SGD([paper.weight, paper.bias], lr=0.05)
    adam = torch.optim.Adam([paper.scores], lr=1.0, betas=learner.betas, eps=learner.eps)
    ramp = CubicSchedule(0.5, **schedule)
    clipped = 0
    for step, (inputs, targets) in enumerate(batches):
        paper.zero_grad()
        nn.functional.mse_loss(paper(inputs), targets.double()).backward()
        total = torch.nn.utils.get_total_norm([paper.weight.grad, paper.bias.grad, paper.scores.grad])
        factor = min(1.0, 0.5 / (float(total) + 1e-6))
        clipped += factor < 1.0
        paper.scores.grad.mul_(factor)
        torch.nn.utils.clip_grad_norm_([paper.weight, paper.bias], 0.5)
        sgd.step()
        adam.step()
        if step > 0 or bool(paper.scores.detach().any()):
            paper.keep_highest(ramp.sparsity(step + 1, len(batches)))
    assert 0 < clipped < len(batches) and 0 < learner.mask.sum() < learner.mask.numel()
    torch.testing.assert_close(learner.scores.double(), paper.scores.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(learner.mask.double(), paper.mask)
    torch.testing.assert_close(
        layer.parametrizations.weight.original.double(), paper.weight.detach(), rtol=1e-5, atol=1e-6
    )


def test_a_step_with_non_finite_score_gradients_teaches_the_scores_nothing():
    """A float16 loss scaler's overflow step (skipped by the optimizer): its score gradient is dropped, Adam's state
    and the consistency sums are untouched; the next finite step learns as usual."""
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    pruner = Pruner(weight={"method": "movement_adam", "sparsity": 0.5})
    pruner.register_placeholders(layer)
    learner = layer.parametrizations.weight[0]
    nn.functional.mse_loss(layer(torch.randn(8, 6)), torch.randn(8, 4)).backward()
    pruner.finish_score_step(layer, clip_val=1.0, parameter_norm=1.0)
    pruner.prune_scheduled(layer, 0.0)
    before = {name: getattr(learner, name).clone() for name in ("scores", "exp_avg", "exp_avg_sq", "step")}
    nn.functional.mse_loss(layer(torch.full((8, 6), float("inf"))), torch.randn(8, 4)).backward()
    assert pruner.finish_score_step(layer, scale=1 / 65536, clip_val=1.0, parameter_norm=float("inf")) == 0.0
    pruner.prune_scheduled(layer, 0.5)
    for name, value in before.items():
        assert torch.equal(getattr(learner, name), value), name
    assert int(learner.sample_steps) == 1
    nn.functional.mse_loss(layer(torch.randn(8, 6)), torch.randn(8, 4)).backward()
    pruner.finish_score_step(layer, clip_val=1.0, parameter_norm=1.0)
    pruner.prune_scheduled(layer, 0.5)
    assert int(learner.step) == 2 and not torch.equal(learner.scores, before["scores"])


def test_adam_scores_of_two_processes_agree_by_learning_from_their_averaged_gradient():
    """A distributed fit: each process accumulates the gradients of its own batches; ``reduce`` (the strategy's
    mean) gives both the average, so both learn the same scores and masks, those of Adam on the averaged gradient."""
    ranks = []
    for _ in range(2):
        torch.manual_seed(0)  # DDP starts every process from the same weights
        layer = nn.Linear(6, 4)
        Pruner(weight={"method": "movement_adam", "sparsity": 0.5}).register_placeholders(layer)
        ranks.append(layer)
    learners = [layer.parametrizations.weight[0] for layer in ranks]
    reference = torch.zeros(4, 6, requires_grad=True)
    adam = torch.optim.Adam([reference], lr=1.0, betas=learners[0].betas, eps=learners[0].eps)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for layer in ranks:  # each process its own batch
            x, target = torch.randn(8, 6, generator=generator), torch.randn(8, 4, generator=generator)
            nn.functional.mse_loss(layer(x), target).backward()
        # what all-reduce(mean) gives each process: the step gradient is the only buffer it is called on
        mean = (learners[0].step_gradient + learners[1].step_gradient) / 2
        assert not torch.equal(learners[0].step_gradient, learners[1].step_gradient)
        for layer, learner in zip(ranks, learners, strict=True):

            def all_reduce_mean(tensor, learner=learner, mean=mean):
                assert tensor is learner.step_gradient
                return mean.clone()

            Pruner(weight={"method": "movement_adam", "sparsity": 0.5}).prune_scheduled(
                layer, 0.5, reduce=all_reduce_mean
            )
        reference.grad = -mean  # step_gradient holds -∂L/∂S
        adam.step()
        torch.testing.assert_close(learners[0].scores, reference.detach())
        assert torch.equal(learners[0].scores, learners[1].scores)
        assert torch.equal(learners[0].mask, learners[1].mask) and not bool(learners[0].mask.all())
        # the consistency check follows the averaged movement too, so both processes report the same
        assert torch.equal(learners[0].sample_halves, learners[1].sample_halves)


def _spearman_by_hand(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of the ranks (continuous values: no ties), in float64."""
    ranks = [value.double().argsort().argsort().double() for value in (a, b)]
    ranks = [rank - rank.mean() for rank in ranks]
    return float((ranks[0] * ranks[1]).sum() / (ranks[0].norm() * ranks[1].norm()))


@pytest.mark.parametrize("method", ["movement", "movement_adam"])
@pytest.mark.parametrize("shape", [(40, 30), (120, 100)])  # all 1,200 entries; a sample of 4,096 of 12,000
def test_score_consistency_is_the_rank_correlation_of_even_and_odd_step_movement(method, shape):
    """``consistency()`` against the movement -W ⊙ ∂L/∂W' of the sampled entries summed over even and odd steps by
    hand: near 1 for a steady gradient, near 0 for independent noise, -1 for steps that undo each other."""
    rows, cols = shape
    torch.manual_seed(0)
    layer = nn.Linear(cols, rows, bias=False)
    pruner = Pruner(weight={"method": method, "sparsity": 0.5})
    pruner.register_placeholders(layer)
    learner = layer.parametrizations.weight[0]
    assert len(learner.sample) == min(rows * cols, 4096) and len(set(learner.sample.tolist())) == len(
        learner.sample
    )
    assert learner.consistency() is None and pruner.score_consistency(layer) is None  # nothing measured yet
    steady = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    noise = torch.Generator().manual_seed(2)
    for kind, expected in (("steady", 1.0), ("noise", 0.0), ("undoing", -1.0)):
        learner.load_state(
            {"sample_halves": torch.zeros(2, len(learner.sample)), "sample_steps": torch.tensor(0)}
        )
        halves = torch.zeros(2, len(learner.sample), dtype=torch.float64)
        for step in range(8):
            direction = {"steady": steady, "undoing": steady * (-1) ** step}.get(kind)
            if direction is None:
                direction = torch.randn(rows, cols, generator=noise)
            weight = layer.parametrizations.weight.original.detach().double().clone()
            (layer.weight * direction).sum().backward()  # ∂L/∂W' = direction
            halves[step % 2] -= (weight * direction.double()).flatten()[learner.sample]
            pruner.prune_scheduled(layer, 0.5)
        by_hand = _spearman_by_hand(*halves)
        assert learner.consistency() == pytest.approx(by_hand, abs=1e-6), kind
        assert pruner.score_consistency(layer) == pytest.approx(by_hand, abs=1e-6)
        assert by_hand == pytest.approx(expected, abs=0.1), kind


def test_mask_keeps_exactly_the_highest_scores_of_each_layer():
    model = TwoLinears()
    pruner = Pruner(weight={"method": "movement", "sparsity": 0.8})
    pruner.register_placeholders(model)
    generator = torch.Generator().manual_seed(3)
    scores = {
        name: torch.randn(size, generator=generator) for name, size in [("first", (5, 6)), ("second", (3, 5))]
    }
    pruner.load_scores(model, scores)
    for sparsity in (0.0, 0.3, 0.55, 0.8):
        pruner.prune_scheduled(model, sparsity)
        for name, value in scores.items():
            mask = getattr(model, name).parametrizations.weight[0].mask
            kept = value.numel() - zeros_at(value.numel(), sparsity)
            assert int(mask.sum()) == kept, (name, sparsity)
            top = value.flatten().argsort(descending=True)[:kept]  # independent: a full sort of the scores
            assert set(mask.flatten().nonzero().flatten().tolist()) == set(top.tolist())
            assert bool((getattr(model, name).weight[~mask] == 0).all())


def test_layers_stay_dense_until_a_score_is_learned():
    model = TwoLinears()
    pruner = Pruner(weight={"method": "movement", "sparsity": 0.5})
    pruner.register_placeholders(model)
    pruner.prune_scheduled(model, 0.5)  # all scores 0: nothing to rank by
    assert all(bool(layer.parametrizations.weight[0].mask.all()) for layer in (model.first, model.second))


def test_scores_are_not_model_state():
    """A movement-pruned layer has the state keys of any pruned layer (checkpoints, exports and evaluations load
    alike); its scores travel in the callback's state instead."""
    movement, plain = TwoLinears(), TwoLinears()
    Pruner(weight={"method": "movement", "sparsity": 0.5}).register_placeholders(movement)
    Pruner(weight={"method": "l1", "sparsity": 0.5}).register_placeholders(plain)
    assert type(plain.first.parametrizations.weight[0]) is WeightMask
    assert list(movement.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(movement.state_dict())


def test_cubic_schedule_follows_its_formula():
    s_i, s_f, total = 0.1, 0.9, 50
    schedule = CubicSchedule(final_sparsity=s_f, initial_sparsity=s_i, warmup=0.2, cooldown=0.1)
    t_w, t_c = 10, 5  # 0.2 * 50 and 0.1 * 50 steps
    assert schedule.bounds(total) == (t_w, total - t_c)
    for step in (0, 5, 9):
        assert schedule.sparsity(step, total) == s_i
    for step in (10, 11, 20, 27, 44):
        formula = s_f + (s_i - s_f) * (1 - (step - t_w) / (total - t_w - t_c)) ** 3
        assert schedule.sparsity(step, total) == pytest.approx(formula, abs=1e-12), step
    for step in (45, 49, 50):  # the cool-down, and the masks after the last step
        assert schedule.sparsity(step, total) == s_f
    values = [schedule.sparsity(step, total) for step in range(total + 1)]
    assert values == sorted(values)  # it only rises
    # no cool-down: the final sparsity is that of the masks computed after the last step
    no_cooldown = CubicSchedule(final_sparsity=s_f, cooldown=0.0)
    assert no_cooldown.sparsity(total - 1, total) < s_f == no_cooldown.sparsity(total, total)


def test_l1_on_a_schedule_prunes_gradually_and_keeps_what_it_pruned():
    model = TwoLinears()
    pruner = Pruner(weight={"method": "l1", "sparsity": 0.8}, schedule={"warmup": 0.0, "cooldown": 0.0})
    pruner.register_placeholders(model)
    previous = {name: torch.ones(1, dtype=torch.bool) for name in ("first", "second")}
    for sparsity in (0.2, 0.5, 0.8):
        with torch.no_grad():  # training moves the kept weights between steps
            for layer in (model.first, model.second):
                layer.parametrizations.weight.original.mul_(torch.rand_like(layer.weight) + 0.5)
        pruner.prune_scheduled(model, sparsity)
        for name in previous:
            layer = getattr(model, name)
            mask, weight = layer.parametrizations.weight[0].mask, layer.parametrizations.weight.original
            assert int((~mask).sum()) == zeros_at(mask.numel(), sparsity)
            assert bool((~previous[name] <= ~mask).all())  # pruned once, pruned from then on
            assert float(weight[mask].abs().min()) >= float(weight[~mask & previous[name]].abs().max())
            previous[name] = mask.clone()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": {"warmup": 1.5}}, "prune.schedule.warmup=1.5: must be a number in [0.0, 1.0)"),
        ({"schedule": {"cooldown": -0.1}}, "prune.schedule.cooldown=-0.1: must be a number in [0.0, 1.0)"),
        (
            {"schedule": {"warmup": 0.6, "cooldown": 0.4}},
            "prune.schedule.warmup=0.6 + prune.schedule.cooldown=0.4",
        ),
        ({"schedule": {"initial_sparsity": 0.95}}, "prune.schedule.initial_sparsity=0.95: must be at most"),
        ({"schedule": {"end": 0.5}}, "prune.schedule.end: unknown key"),
        (
            {"weight": {"method": "movement", "sparsity": 0.5, "pattern": "2:4"}},
            "prune.weight.pattern='2:4': a pattern",
        ),
        (
            {"weight": {"method": "wanda", "sparsity": 0.5}, "schedule": {}},
            "prune.schedule: prune.weight.method=wanda",
        ),
        (
            {"activation": {"method": "movement", "sparsity": 0.5}},
            "prune.activation.method='movement': must be one of",
        ),
    ],
)
def test_bad_settings_are_one_line(kwargs, message):
    kwargs = {"weight": {"method": "movement", "sparsity": 0.9}, **kwargs}
    with pytest.raises(ConfigError) as err:
        Pruner(**kwargs, key="prune")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["prune=movement_0.9", "train=false"],
            "prune.weight.method=movement: learns its scores from the training gradients, and train=false",
        ),
        (["prune=movement_0.9", "prune.at=1"], "prune.at=1: prune.schedule prunes from the fit's first step"),
        (["prune=movement_0.9", "prune.schedule.warmup=2"], "prune.schedule.warmup=2: must be a number in"),
        (
            ["compress=l1_0.5", "compress.prune.weight.method=movement"],
            "compress.prune.weight.method=movement: learns its masks while training",
        ),
    ],
)
def test_bad_presets_fail_on_construction(compose_cfg, overrides, message):
    cfg = compose_cfg(overrides)
    group = overrides[0].split("=")[0]
    with pytest.raises(ConfigError) as err:
        build(
            cfg[group], group, _convert_="partial"
        )  # as instantiate_callbacks does, before anything is written
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_fit_without_training_steps_is_refused(compose_cfg):
    with pytest.raises(ConfigError, match=r"^prune.schedule: the fit has no training steps"):
        run(compose_cfg([*SMALL, "prune=movement_0.9", "+trainer.limit_train_batches=0"]))


def test_frozen_weights_are_refused(compose_cfg):
    with pytest.raises(ConfigError, match=r"^prune.weight.method=movement: layer .* is frozen"):
        run(compose_cfg([*SMALL, "prune=movement_0.9", "model.merge_lora_before_compress=false"]))


def _train_losses(run_dir: Path) -> list[tuple[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open(newline="") as handle:
        return [(row["step"], row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]


@pytest.mark.slow
def test_dense_steps_train_exactly_like_l1_on_the_same_schedule(compose_cfg, tmp_path):
    """The score hook reads the gradients and changes nothing: until the masks prune (warm-up 80 % of 16 steps),
    movement trains step for step as l1 on the same schedule; then they differ (other weights pruned)."""
    common = [*SMALL, "trainer.max_epochs=2", "logger=csv", "trainer.log_every_n_steps=1"]
    run(compose_cfg([*common, "prune=movement_0.9", "prune.schedule.warmup=0.8"], tmp_path / "movement"))
    l1 = ["prune=l1_0.9", "prune.activation=null", "prune.schedule={warmup: 0.8}"]
    run(compose_cfg([*common, *l1], tmp_path / "l1"))
    movement, magnitude = _train_losses(tmp_path / "movement"), _train_losses(tmp_path / "l1")
    assert len(movement) == len(magnitude) == 16
    # t_w = round(0.8 * 16) = 13 starts the ramp at s_i = 0, t_c = round(1.6) = 2: steps 0..13 dense, 14 and 15 at 0.9
    dense = 14
    assert movement[:dense] == magnitude[:dense]
    assert movement[dense:] != magnitude[dense:]


def _checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _masks(checkpoint: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in checkpoint["state_dict"].items() if k.endswith(MASK_SUFFIX)}


# The progress display, a line per batch: movement_0.9's run shows it (test_progress_lines_follow_the_schedule).
PROGRESS = [
    "+callbacks.progress._target_=adls_lightning.callbacks.progress.progress_bar",
    "+callbacks.progress.interval_s=0",
]
# How often each preset's run logs (the score consistency is logged on the logging steps).
LOG_EVERY = {"movement_0.9": 1, "movement_adam_0.9": 4}


def _preset_run(preset: str) -> list[str]:
    """A preset's 16-step run (64 rows, batch 8, 2 epochs), a CSV log and a last.ckpt every 3 steps."""
    return [
        *SMALL,
        f"prune={preset}",
        "trainer.max_epochs=2",
        "data.batch_size=8",
        "logger=csv",
        f"trainer.log_every_n_steps={LOG_EVERY[preset]}",
        "callbacks.last_checkpoint.every_n_train_steps=3",
        *(PROGRESS if preset == "movement_0.9" else []),
    ]


@pytest.fixture(scope="module")
def preset_runs(tmp_path_factory, tiny_imdb_dir, cache_dir):
    """``preset_runs(preset) -> (folder, finished process)``: one uninterrupted train.py run per preset, shared by the
    preset's end-to-end test, movement_0.9's progress lines and the kill-and-resume's reference run (the same
    overrides serve all three: logging, progress lines, periodic checkpoints and recorded batches change no
    training). Nobody writes into it."""
    done: dict[str, tuple[Path, object]] = {}

    def get(preset: str):
        if preset not in done:
            out = tmp_path_factory.mktemp(preset) / "whole"
            proc = run_train(tiny_imdb_dir, cache_dir, out, *_preset_run(preset), *recording(out))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[preset] = (out, proc)
        return done[preset]

    return get


@pytest.mark.parametrize("preset", ["movement_0.9", "movement_adam_0.9"])
def test_movement_preset_runs_through_train_py(preset_runs, preset):
    out, proc = preset_runs(preset)
    log_every = LOG_EVERY[preset]
    # the scores' consistency is logged on the logging steps once two steps are measured (the CSV counts steps
    # from 0); it is a diagnostic, with no warning
    with (out / "csv" / "metrics.csv").open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("prune/score_consistency")]
    consistency = {int(row["step"]): float(row["prune/score_consistency"]) for row in rows}
    assert sorted(consistency) == [step for step in range(1, 16) if (step + 1) % log_every == 0]
    assert all(-1 <= value <= 1 for value in consistency.values())
    assert "gradient noise" not in proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    # every layer ends with exactly round(0.9 n) zeros (nothing else is zero in a trained float weight)
    assert metrics["prune/weight_sparsity"] == sum(zeros_at(n, 0.9) for n in TINY_SIZES) / sum(TINY_SIZES)
    assert metrics["prune/weight_sparsity"] == pytest.approx(0.9, abs=1e-3)
    assert metrics["prune/scheduled_sparsity"] == pytest.approx(0.9)
    best = _checkpoint(next((out / "checkpoints").glob("best-*.ckpt")))
    masks = _masks(best)
    assert sorted(mask.numel() for mask in masks.values()) == sorted(TINY_SIZES)
    for key, mask in masks.items():  # the best checkpoint is one at the final sparsity
        assert int((~mask).sum()) == zeros_at(mask.numel(), 0.9), key
    state = best["callbacks"]["PruningCallback"]
    assert len(state["scores"]) == len(TINY_SIZES) and all(
        bool(value.any()) for value in state["scores"].values()
    )
    if (
        preset == "movement_adam_0.9"
    ):  # Adam's moments and step count travel with the scores (one step per batch)
        steps = {int(moments["step"]) for moments in state["score_optimizer"].values()}
        assert state["score_optimizer"].keys() == state["scores"].keys() and steps == {best["global_step"]}
    else:
        assert "score_optimizer" not in state


def test_progress_lines_follow_the_schedule(preset_runs):
    """The progress display (a line per batch here) shows the schedule's sparsity rising to 0.9 and the scores'
    consistency beside the loss, as a person watching a movement run would want them (movement_0.9's shared run)."""
    _, proc = preset_runs("movement_0.9")
    lines = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "[adls_lightning.callbacks.progress][INFO] - train " in line
    ]
    shown = [re.search(r"prune/scheduled_sparsity ([\d.]+)", line) for line in lines]
    sparsities = [float(match.group(1)) for match in shown if match]
    assert len(sparsities) >= 16 and sparsities == sorted(sparsities), lines  # it only rises ...
    assert sparsities[0] == 0 and sparsities[-1] == 0.9  # ... from dense to the final sparsity
    assert any("prune/score_consistency" in line and "train/loss" in line for line in lines), lines


def test_train_false_is_one_line_on_the_command_line(tiny_imdb_dir, cache_dir, tmp_path):
    proc = run_train(tiny_imdb_dir, cache_dir, tmp_path / "bad", "prune=movement_0.9", "train=false")
    assert_one_line_error(
        proc, "error: prune.weight.method=movement: learns its scores", "train=false trains"
    )
    assert not [path for path in (tmp_path / "bad").rglob("*")]  # refused before anything was written


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["movement_0.9", "movement_adam_0.9"])
def test_killed_movement_run_resumes_with_the_same_scores_and_masks(
    preset_runs, tiny_imdb_dir, cache_dir, tmp_path, preset
):
    """Killed mid-ramp (step 11 of 16; warm-up 2 steps, cool-down 2) and resumed from the last.ckpt of step 9: the
    same masks and scores (and Adam's moments) at the end as an uninterrupted run (the preset's shared run), and the
    same metrics bit for bit."""
    whole_dir, _ = preset_runs(preset)
    runs = kill_and_resume(tiny_imdb_dir, cache_dir, tmp_path, _preset_run(preset), 11, uninterrupted=False)
    runs["whole"] = whole_dir
    assert runs["resumed_from_step"] == 9
    for name in (
        "last.ckpt",
        "best-epoch01-step16.ckpt",
    ):  # the last step-checkpoint (15) and the final model
        whole, resumed = (_checkpoint(runs[run] / "checkpoints" / name) for run in ("whole", "killed"))
        assert whole["global_step"] == resumed["global_step"] > 11
        whole_masks, resumed_masks = _masks(whole), _masks(resumed)
        assert whole_masks.keys() == resumed_masks.keys() and len(whole_masks) == len(TINY_SIZES)
        assert all(torch.equal(whole_masks[key], resumed_masks[key]) for key in whole_masks)
        whole_scores, resumed_scores = (c["callbacks"]["PruningCallback"]["scores"] for c in (whole, resumed))
        assert whole_scores.keys() == resumed_scores.keys()
        assert all(torch.equal(whole_scores[key], resumed_scores[key]) for key in whole_scores)
        whole_moments, resumed_moments = (
            c["callbacks"]["PruningCallback"].get("score_optimizer", {}) for c in (whole, resumed)
        )
        assert whole_moments.keys() == resumed_moments.keys()
        assert (len(whole_moments) == len(TINY_SIZES)) == (preset == "movement_adam_0.9")
        for key, moments in whole_moments.items():
            assert all(torch.equal(value, resumed_moments[key][name]) for name, value in moments.items()), key
        # the consistency check continues where it was: the same even/odd sums and steps
        whole_check, resumed_check = (c["callbacks"]["PruningCallback"] for c in (whole, resumed))
        for key, halves in whole_check["score_consistency"].items():
            assert all(
                torch.equal(value, resumed_check["score_consistency"][key][n]) for n, value in halves.items()
            )
            assert int(halves["sample_steps"]) == whole["global_step"], key
    whole_metrics, resumed_metrics = (
        json.loads((runs[n] / "metrics.json").read_text()) for n in ("whole", "killed")
    )
    for key in ("val/acc", "test/loss", "test/acc", "prune/weight_sparsity"):
        assert resumed_metrics[key] == whole_metrics[key], key
