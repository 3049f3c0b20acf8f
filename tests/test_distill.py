"""Knowledge distillation in compression-aware fine-tuning (``compress.distill``): the loss against the formula
computed here, a frozen teacher in eval mode that gets no gradient and is no model state, weight 0 = no distillation,
the teacher restored on resume, one-line errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch

from adls_lightning.app.training import run
from adls_lightning.build import EXTRA_TARGETS_ENV, build
from adls_lightning.callbacks.compression import CompressionCallback
from adls_lightning.distill import Distiller, distillation_loss
from adls_lightning.errors import ConfigError
from adls_lightning.prune import is_weight_pruned
from tests.helpers import kill_and_resume

SMALL = ["data.train_size=64", "data.val_size=32", "data.test_size=32", "data.max_length=32"]
STEPS_PER_EPOCH = 8  # 64 rows / batch 8


def by_hand(student, teacher, task, temperature, weight):
    """(1 - w)·task + w·T²·KL(p_t ‖ p_s), the softmaxes and the KL sum written out, in float64."""
    s, t = student.double() / temperature, teacher.double() / temperature
    p_s = torch.exp(s) / torch.exp(s).sum(dim=-1, keepdim=True)
    p_t = torch.exp(t) / torch.exp(t).sum(dim=-1, keepdim=True)
    kl = (p_t * (torch.log(p_t) - torch.log(p_s))).sum(dim=-1).mean()
    return (1 - weight) * task.double() + weight * temperature**2 * kl


@pytest.mark.parametrize(("temperature", "weight"), [(1.0, 0.5), (2.0, 0.3), (4.0, 1.0), (0.5, 0.9)])
def test_distillation_loss_is_the_formula(temperature, weight):
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 3, generator=generator), torch.randn(6, 3, generator=generator) * 2
    task = torch.tensor(0.7)
    loss, term = distillation_loss(student, teacher, task, temperature, weight)
    torch.testing.assert_close(loss.double(), by_hand(student, teacher, task, temperature, weight))
    torch.testing.assert_close(term.double(), by_hand(student, teacher, task, temperature, 1.0))


def test_regression_outputs_distil_by_mean_squared_error():
    student, teacher, task = (
        torch.tensor([[0.5], [2.0], [-1.0]]),
        torch.tensor([[1.0], [1.0], [0.0]]),
        torch.tensor(3.0),
    )
    loss, term = distillation_loss(student, teacher, task, temperature=4.0, weight=0.25)
    mse = (0.5**2 + 1.0**2 + 1.0**2) / 3  # no temperature for a regression output
    assert float(term) == pytest.approx(mse)
    assert float(loss) == pytest.approx(0.75 * 3.0 + 0.25 * mse)


def test_weight_zero_is_the_task_loss_exactly():
    student = torch.randn(4, 2, requires_grad=True)
    task = torch.nn.functional.cross_entropy(student, torch.tensor([0, 1, 1, 0]))
    loss, _ = distillation_loss(student, torch.randn(4, 2), task, 2.0, 0.0)
    assert torch.equal(loss, task)
    (grad_mixed,) = torch.autograd.grad(loss, student, retain_graph=True)
    (grad_task,) = torch.autograd.grad(task, student)
    assert torch.equal(grad_mixed, grad_task)


def test_distiller_copies_freezes_and_asks_the_teacher(tiny_bert):
    model = tiny_bert(num_labels=1).train()
    distiller = Distiller(model, temperature=3.0, weight=0.4)
    assert distiller.teacher is not model and not distiller.teacher.training and model.training
    assert not any(p.requires_grad for p in distiller.teacher.parameters())
    batch = {"input_ids": torch.randint(1, 100, (3, 7)), "attention_mask": torch.ones(3, 7, dtype=torch.long)}
    with torch.no_grad():
        expected_teacher = model.eval()(**batch).logits
    student, task = torch.randn(3, 1), torch.tensor(0.2)
    loss, parts = distiller.loss({**batch, "labels": torch.zeros(3)}, student, task)
    mse = ((student - expected_teacher) ** 2).mean()
    torch.testing.assert_close(loss, 0.6 * task + 0.4 * mse)
    assert set(parts) == {"task_loss", "distill_loss"}


class TeacherCheck(L.Callback):
    """Checks the teacher at every post-compression training step; what it saw is kept on the class."""

    seen: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        compression = next(cb for cb in trainer.callbacks if isinstance(cb, CompressionCallback))
        if compression.distiller is None or any(r.get("step") == trainer.global_step for r in self.seen):
            return
        teacher = compression.distiller.teacher
        record = {"step": trainer.global_step, "first": not self.seen}
        if not self.seen:  # nothing trained since compression: the teacher is the student's weights, unpruned
            student_layer = pl_module.model.bert.encoder.layer[0].output.dense
            teacher_layer = teacher.bert.encoder.layer[0].output.dense
            record["same_weights"] = torch.equal(
                teacher_layer.parametrizations.weight.original, student_layer.parametrizations.weight.original
            )
            record["student_pruned"] = not bool(student_layer.parametrizations.weight[0].mask.all())
            record["teacher_unpruned"] = all(
                bool(m.parametrizations.weight[0].mask.all())
                for m in teacher.modules()
                if is_weight_pruned(m)
            )
            record["teacher_hooks"] = sum(len(m._forward_pre_hooks) for m in teacher.modules())
        self.seen.append(record)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        compression = next(cb for cb in trainer.callbacks if isinstance(cb, CompressionCallback))
        if compression.distiller is None:
            return
        teacher = compression.distiller.teacher
        optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        self.seen[-1].update(
            no_grad=all(p.grad is None for p in teacher.parameters()),
            eval_mode=not any(m.training for m in teacher.modules()),
            student_training=pl_module.training,
            in_optimizer=any(id(p) in optimized for p in teacher.parameters()),
            in_module=any(p is q for p in teacher.parameters() for q in pl_module.parameters()),
            in_state=any(key.startswith("distiller") for key in pl_module.state_dict()),
            uses_it=pl_module.distiller is compression.distiller,
        )


@pytest.mark.slow
def test_teacher_gets_no_gradient_stays_in_eval_mode_and_is_no_model_state(
    compose_cfg, tmp_path, monkeypatch
):
    # this module as pytest imported it (its name depends on how pytest was started), so the class is this one
    monkeypatch.setenv(EXTRA_TARGETS_ENV, f"{__name__}.*")
    TeacherCheck.seen = []
    check = [f"+callbacks.check._target_={__name__}.TeacherCheck"]
    metrics = run(compose_cfg([*SMALL, "compress=l1_0.5", "compress.distill=true", *check], tmp_path / "d"))
    seen = TeacherCheck.seen
    assert len(seen) == STEPS_PER_EPOCH  # every step of the post-compression epoch, none before compression
    first = seen[0]
    assert first["same_weights"] and first["student_pruned"] and first["teacher_unpruned"]
    assert first["teacher_hooks"] == 0  # no activation pruning on the teacher
    for record in seen:
        assert record["no_grad"] and record["eval_mode"] and record["student_training"] and record["uses_it"]
        assert not (record["in_optimizer"] or record["in_module"] or record["in_state"])
    assert metrics["prune/weight_sparsity"] == 0.5
    # the checkpoint's model keys are those of a run without distillation; the teacher is callback state
    plain = run(compose_cfg([*SMALL, "compress=l1_0.5"], tmp_path / "p"))
    assert "train/distill_loss" in metrics and "train/distill_loss" not in plain
    distilled_ckpt, plain_ckpt = (
        torch.load(
            next((tmp_path / d / "checkpoints").glob("best-*.ckpt")), map_location="cpu", weights_only=True
        )
        for d in ("d", "p")
    )
    assert list(distilled_ckpt["state_dict"]) == list(plain_ckpt["state_dict"])
    teacher = distilled_ckpt["callbacks"]["CompressionCallback"]["teacher"]
    assert "teacher" not in plain_ckpt["callbacks"]["CompressionCallback"]
    assert all(key.startswith("bert.") or key.startswith("classifier.") for key in teacher)


def _losses(run_dir: Path) -> list[str]:
    with (run_dir / "csv" / "metrics.csv").open(newline="") as handle:
        return [row["train/loss"] for row in csv.DictReader(handle) if row.get("train/loss")]


@pytest.mark.slow
def test_weight_zero_trains_exactly_like_no_distillation(compose_cfg, tmp_path):
    common = [*SMALL, "compress=l1_0.5", "logger=csv", "trainer.log_every_n_steps=1"]
    plain = run(compose_cfg(common, tmp_path / "plain"))
    zero = run(
        compose_cfg([*common, "compress.distill=true", "compress.distill_weight=0"], tmp_path / "zero")
    )
    assert len(_losses(tmp_path / "plain")) == 2 * STEPS_PER_EPOCH
    assert _losses(tmp_path / "zero") == _losses(tmp_path / "plain")
    for key in ("val/acc", "val/loss", "test/loss", "test/acc", "compress/val_acc_final"):
        assert zero[key] == plain[key], key
    assert zero["train/distill_loss"] > 0  # the teacher was asked: its term is there, weighted 0


@pytest.mark.slow
def test_killed_distilling_run_resumes_with_the_same_teacher(tiny_imdb_dir, cache_dir, tmp_path):
    """Killed in the post-compression epoch (step 11) and resumed from the last.ckpt of step 9: the teacher is rebuilt
    from the checkpoint, so the run ends exactly as an uninterrupted one."""
    overrides = [
        *SMALL,
        "data.val_size=16",
        "data.test_size=16",
        "compress=l1_0.5",
        "compress.distill=true",
        "callbacks.last_checkpoint.every_n_train_steps=3",
    ]
    runs = kill_and_resume(tiny_imdb_dir, cache_dir, tmp_path, overrides, 11)
    assert runs["resumed_from_step"] == 9
    whole, resumed = (json.loads((runs[n] / "metrics.json").read_text()) for n in ("whole", "killed"))
    for key in ("train/loss", "train/distill_loss", "val/acc", "test/loss", "test/acc"):
        assert resumed[key] == whole[key], key


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["compress.distill=yes"], "compress.distill='yes': must be true or false"),
        (
            ["compress.distill=true", "compress.distill_temperature=0"],
            "compress.distill_temperature=0: must be",
        ),
        (
            ["compress.distill=true", "compress.distill_weight=1.5"],
            "compress.distill_weight=1.5: must be a number",
        ),
        (
            ["compress.distill=true", "compress.post_epochs=0"],
            "compress.distill=true: compress.post_epochs=0",
        ),
    ],
)
def test_bad_settings_fail_on_construction_in_one_line(compose_cfg, overrides, message):
    cfg = compose_cfg(["compress=l1_0.5", *overrides])
    with pytest.raises(ConfigError) as err:
        build(cfg.compress, "compress", _convert_="partial")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_compressing_a_fine_tuned_lora_run_compresses_after_at_epoch_and_distils(
    compose_cfg, tmp_path, caplog
):
    """init_ckpt of an (unmerged LoRA) fine-tune, the labs' chain: the plain checkpoint is not mistaken for a
    compressed one (which would compress before training and leave no teacher), so the run trains at_epoch epochs,
    compresses, then distils."""
    import logging

    lora = [*SMALL, "trainer.max_epochs=1"]  # the tiny preset's LoRA adapters, unmerged in the checkpoint
    run(compose_cfg(lora, tmp_path / "fine_tuned"))
    fine_tuned = next((tmp_path / "fine_tuned" / "checkpoints").glob("best-*.ckpt"))
    caplog.set_level(logging.INFO)
    metrics = run(
        compose_cfg(
            [*lora, f"init_ckpt={fine_tuned}", "compress=int8_l1_0.5", "compress.distill=true"],
            tmp_path / "c",
        )
    )
    assert "holds a compressed model" not in caplog.text
    assert "compress/val_acc_before" in metrics and "compress/val_acc_after_compression" in metrics
    assert metrics["train/distill_loss"] > 0  # a teacher was there after compression
