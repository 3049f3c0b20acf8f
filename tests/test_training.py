"""End-to-end behaviour of the training core on a tiny BERT and synthetic data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adls_lightning.app.training import run
from adls_lightning.build import build
from adls_lightning.errors import ConfigError
from tests.helpers import assert_one_line_error, run_train

ROOT = Path(__file__).resolve().parent.parent
REQUIRED_METRICS = {
    "val/acc",
    "test/acc",
    "params/trainable",
    "params/total",
    "train/samples_per_sec",
    "time/fit_s",
}


@pytest.mark.slow
def test_full_finetune_learns_and_writes_metrics(compose_cfg, tmp_path):
    cfg = compose_cfg(["model/lora=none", "model.optimizer.lr=1e-3", "trainer.max_epochs=4"])
    metrics = run(cfg)
    on_disk = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert on_disk.keys() >= REQUIRED_METRICS
    assert on_disk == pytest.approx(metrics)
    # keyword sentiment is trivially learnable: far above the 0.5 chance level
    assert metrics["val/acc"] >= 0.9 and metrics["test/acc"] >= 0.9
    assert metrics["params/trainable"] == metrics["params/total"]  # full fine-tuning
    assert metrics["train/samples_seen"] == 4 * 300  # 400 rows - 100 validation, 4 epochs


def test_freeze_embeddings_full_finetune_trains_everything_but_the_embeddings(compose_cfg):
    cfg = compose_cfg(["model/lora=none", "model.freeze_embeddings=true"])
    model = build(cfg.model, "model", _convert_="partial")
    named = dict(model.named_parameters())
    embedding_names = {n for n in named if ".embeddings." in n}
    assert embedding_names  # word, position, token-type, LayerNorm
    assert {n for n, p in named.items() if not p.requires_grad} == embedding_names


UNMERGED = "model.merge_lora_before_compress=false"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "trainable_base"), [([UNMERGED], False), ([UNMERGED, "++quant.train_base=true"], True)]
)
def test_parameter_counts_describe_the_model_after_the_callbacks_setup(
    compose_cfg, overrides, trainable_base
):
    # quant.train_base=true unfreezes the quantized base weights in the callback's setup: the count must see it.
    cfg = compose_cfg(["quant=int8", "trainer.max_epochs=1", "test=false", *overrides])
    metrics = run(cfg)
    model = build(cfg.model, "model", _convert_="partial")
    named = dict(model.named_parameters())
    lora = sum(p.numel() for n, p in named.items() if "lora_" in n)
    base_linear = sum(p.numel() for n, p in named.items() if "base_layer" in n)
    head = sum(p.numel() for n, p in named.items() if "modules_to_save" in n)
    assert metrics["model/lora_params"] == lora > 0
    assert metrics["params/trainable"] == lora + head + (base_linear if trainable_base else 0)


@pytest.mark.slow
def test_merged_by_default_counts_the_plain_model_with_no_adapters_left(compose_cfg):
    # The labs' chain: LoRA is merged before quantization, so the deployed model is the plain architecture.
    cfg = compose_cfg(["quant=int8", "trainer.max_epochs=1", "test=false"])
    metrics = run(cfg)
    plain = build(compose_cfg(["model/lora=none"]).model, "model", _convert_="partial")
    total = sum(p.numel() for p in plain.parameters())
    assert metrics["model/lora_params"] == 0
    assert metrics["params/total"] == metrics["params/trainable"] == total


@pytest.mark.slow
def test_lora_freezes_base_keeps_bias_and_trains_adapters_and_head(compose_cfg):
    cfg = compose_cfg(["trainer.max_epochs=1", "model.optimizer.lr=1e-2"])
    model = build(cfg.model, "model", _convert_="partial")
    named = dict(model.named_parameters())
    base = {n: p.detach().clone() for n, p in named.items() if "base_layer" in n}
    adapters = {n: p.detach().clone() for n, p in named.items() if "lora_" in n}
    head = {n: p.detach().clone() for n, p in named.items() if "classifier.modules_to_save" in n}
    assert base and adapters and head
    # biases of adapted layers are kept (MASE's LoRA dropped them) and frozen
    assert any(n.endswith("base_layer.bias") for n in base)
    assert not any(named[n].requires_grad for n in base)
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable == {n for n in named if "lora_" in n or "modules_to_save" in n}
    # PEFT zero-initialises B: before training the adapted model equals the base model exactly
    assert all(torch.count_nonzero(v) == 0 for n, v in adapters.items() if "lora_B" in n)

    import lightning as L

    datamodule = build(cfg.data, "data")
    L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False).fit(
        model, datamodule=datamodule
    )
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base.items()), "frozen base weights changed"
    assert all(not torch.equal(after[n], v) for n, v in adapters.items() if "lora_B" in n)
    assert all(not torch.equal(after[n], v) for n, v in head.items() if n.endswith("weight"))


@pytest.mark.slow
def test_evaluation_only_run_scores_the_given_checkpoint(compose_cfg, tmp_path):
    trained = run(compose_cfg(["model/lora=none", "model.optimizer.lr=1e-3", "trainer.max_epochs=4"]))
    best = sorted((tmp_path / "run" / "checkpoints").glob("best-*.ckpt"))
    assert len(best) == 1
    evaluated = run(
        compose_cfg(["model/lora=none", "train=false", f"ckpt_path={best[0]}"], output_dir=tmp_path / "eval")
    )
    # the same weights on the same splits: the same scores as the trained run's final evaluation
    assert evaluated["val/acc"] == pytest.approx(trained["val/acc"])
    assert evaluated["test/acc"] == pytest.approx(trained["test/acc"])
    assert evaluated["test/acc"] >= 0.9  # not the untrained initial weights (chance level)
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["test/acc"] == evaluated["test/acc"]


@pytest.mark.slow
def test_init_ckpt_starts_from_the_checkpoint_weights_also_when_quantized(compose_cfg, tmp_path):
    trained = run(compose_cfg(["model/lora=none", "model.optimizer.lr=1e-3", "trainer.max_epochs=4"]))
    best = next((tmp_path / "run" / "checkpoints").glob("best-*.ckpt"))
    plain = run(compose_cfg(["model/lora=none", "train=false"], output_dir=tmp_path / "random"))
    assert plain["test/acc"] < 0.8  # the untrained initial weights
    # every run records its storage, so adls-table prices an uncompressed row beside its compressed ones:
    # float32 throughout, 4 bytes per parameter (no LoRA adapters here)
    assert plain["quant/avg_weight_bits"] == 32.0
    assert plain["quant/weight_bytes"] == 4 * plain["params/total"]
    started = run(
        compose_cfg(["model/lora=none", "train=false", f"init_ckpt={best}"], output_dir=tmp_path / "init")
    )
    assert started["test/acc"] == pytest.approx(trained["test/acc"])
    # a full-precision checkpoint loads into QAT-quantized layers; 32-bit fixed point (16 fractional bits) is
    # finer than these weights need, so the scores stay those of the trained run
    quantized = run(
        compose_cfg(
            ["model/lora=none", "train=false", f"init_ckpt={best}", "quant=int32"], output_dir=tmp_path / "q"
        )
    )
    assert quantized["quant/avg_weight_bits"] == 32.0
    assert quantized["test/acc"] == pytest.approx(trained["test/acc"])
    with pytest.raises(ConfigError, match="init_ckpt="):
        run(compose_cfg([f"init_ckpt={tmp_path / 'missing.ckpt'}"], output_dir=tmp_path / "missing"))


def test_tokenized_cache_is_reused(compose_cfg, tmp_path):
    cfg = compose_cfg(["data.max_length=48", f"paths.cache_dir={tmp_path / 'fresh_cache'}"])
    first = build(cfg.data, "data")
    first.setup("fit")
    second = build(cfg.data, "data")
    second.setup("fit")
    assert first.cache_hits == {"train": False, "val": False, "test": False}
    assert second.cache_hits == {"train": True, "val": True, "test": True}
    assert torch.equal(first.splits["train"][0]["input_ids"], second.splits["train"][0]["input_ids"])
    other = build(
        compose_cfg(["data.max_length=40", f"paths.cache_dir={tmp_path / 'fresh_cache'}"]).data, "data"
    )
    other.setup("fit")
    assert other.cache_hits == {"train": False, "val": False, "test": False}, (
        "a different max_length must not hit the cache"
    )


def test_splits_are_stratified_disjoint_and_sized(compose_cfg):
    cfg = compose_cfg(["data.train_size=120", "data.val_size=60", "data.test_size=50"])
    dm = build(cfg.data, "data")
    dm.setup("fit")
    sizes = {k: len(v) for k, v in dm.splits.items()}
    assert sizes == {"train": 120, "val": 60, "test": 50}
    for split in dm.splits.values():
        labels = split.with_format(None)["label"]
        assert abs(sum(labels) - len(labels) / 2) <= 1  # stratified: balanced like the source
    train_ids = {tuple(x) for x in dm.splits["train"].with_format(None)["input_ids"]}
    val_ids = {tuple(x) for x in dm.splits["val"].with_format(None)["input_ids"]}
    assert not train_ids & val_ids
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    # dynamic padding: a batch is as long as its longest row, not max_length
    assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max())


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_csv_and_jsonl_folders_load(compose_cfg, tmp_path, fmt):
    from tests.helpers import make_reviews

    folder = tmp_path / fmt
    folder.mkdir()
    for split, n in (("train", 150), ("test", 40)):
        frame = make_reviews(n, seed=3)
        if fmt == "csv":
            frame.to_csv(folder / f"{split}.csv", index=False)
        else:
            frame.to_json(folder / f"{split}.jsonl", orient="records", lines=True)
    dm = build(compose_cfg([f"data.data_dir={folder}", "data.val_size=50"]).data, "data")
    dm.setup("fit")
    assert {k: len(v) for k, v in dm.splits.items()} == {"train": 100, "val": 50, "test": 40}


def test_label_outside_binary_is_rejected(compose_cfg, tmp_path):
    from tests.helpers import make_reviews

    folder = tmp_path / "bad_labels"
    folder.mkdir()
    frame = make_reviews(150, seed=0)
    frame.loc[3, "label"] = 2
    frame.to_parquet(folder / "train.parquet")
    make_reviews(20, seed=1).to_parquet(folder / "test.parquet")
    with pytest.raises(ConfigError, match=r"row 3 has label 2 \(labels must be 0 or 1\)"):
        run(compose_cfg([f"data.data_dir={folder}", "data.val_size=20"]))


@pytest.mark.slow
def test_fresh_run_refuses_to_overwrite_an_earlier_run(compose_cfg, tmp_path):
    run(compose_cfg(["trainer.max_epochs=1"]))
    before = (tmp_path / "run" / "metrics.json").read_text()
    with pytest.raises(ConfigError, match="hydra.run.dir"):
        run(compose_cfg(["trainer.max_epochs=1"]))
    assert (tmp_path / "run" / "metrics.json").read_text() == before


def test_cli_bad_input_is_one_line_and_exit_2(tiny_imdb_dir, cache_dir, tmp_path):
    proc = run_train(tiny_imdb_dir, cache_dir, tmp_path / "bad", "data.max_length=-1")
    assert assert_one_line_error(proc) == "error: data.max_length=-1: must be a positive integer"


def test_hub_model_offline_is_one_line(tiny_imdb_dir, cache_dir, tmp_path):
    # model=bert_tiny (the labs' hub model) on a machine without the hub: one line naming the key, no traceback.
    proc = run_train(
        tiny_imdb_dir, cache_dir, tmp_path / "offline", "model=bert_tiny", env={"HF_HUB_OFFLINE": "1"}
    )
    assert_one_line_error(proc, starts="error: data.tokenizer=prajjwal1/bert-tiny: cannot load")


def test_raw_splits_are_read_once_per_process_and_source(tiny_imdb_dir, tmp_path):
    import shutil

    from adls_lightning.data import load_raw_splits

    first, identity = load_raw_splits(tiny_imdb_dir, "unused")
    again, same_identity = load_raw_splits(tiny_imdb_dir, "unused")
    assert again is first and same_identity == identity  # trials in one process share the loaded splits
    copy = tmp_path / "copy"
    shutil.copytree(tiny_imdb_dir, copy)
    other, other_identity = load_raw_splits(copy, "unused")
    assert other is not first and other_identity != identity  # another source is loaded on its own
    assert other["train"]["label"] == first["train"]["label"]
