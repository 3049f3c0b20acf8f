"""GLUE tasks and the generic folder task: each of the nine GLUE tasks read from a folder in its exact layout and
trained one step, its metrics.json checked against sklearn/scipy on the same predictions; the folder task's
label kinds; the hub path; bad input refused in one line with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
from transformers import AutoTokenizer

from adls_lightning.app.training import run
from adls_lightning.build import build
from adls_lightning.errors import ConfigError
from adls_lightning.models import load_pretrained, packaged_model_dir
from tests.glue_layouts import FOLDERS, LABELS, glue_overrides, write_glue_task, write_tsv
from tests.helpers import assert_one_line_error, run_train

ROOT = Path(__file__).resolve().parents[1]
GLUE_ORDER = ["cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli"]
EXPECTED_METRICS = {  # the official metrics per task, written out independently of adls_lightning.data.tasks
    "cola": {"mcc"}, "sst2": {"acc"}, "mrpc": {"f1", "acc"}, "stsb": {"pearson", "spearman"},
    "qqp": {"f1", "acc"}, "mnli": {"acc"}, "qnli": {"acc"}, "rte": {"acc"}, "wnli": {"acc"},
}  # fmt: skip
REFERENCE = {
    "acc": accuracy_score,
    "f1": f1_score,
    "mcc": matthews_corrcoef,
    "pearson": lambda y, p: pearsonr(y, p)[0],
    "spearman": lambda y, p: spearmanr(y, p)[0],
}


def predictions(cfg, ckpt: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{split: (labels, predictions)}`` of a checkpoint on the task's test splits, computed here."""
    datamodule = build(cfg.data, "data")
    datamodule.setup("test")
    model = build(cfg.model, "model", _convert_="partial", **datamodule.task.model_overrides())
    model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"])
    model.eval()
    loaders = datamodule.test_dataloader()
    loaders = loaders if isinstance(loaders, list) else [loaders]
    out = {}
    with torch.no_grad():
        for split, loader in zip(datamodule.task.test_splits, loaders):
            labels, preds = [], []
            for batch in loader:
                logits = model(**batch).logits
                preds.append(logits.squeeze(-1) if datamodule.task.is_regression else logits.argmax(-1))
                labels.append(batch["labels"])
            out[split] = torch.cat(labels).numpy(), torch.cat(preds).numpy()
    return out


@pytest.mark.parametrize("task", GLUE_ORDER)
def test_glue_task_from_its_folder_trains_and_reports_its_official_metrics(compose_cfg, tmp_path, task):
    root = write_glue_task(tmp_path / "glue", task)
    # After one step the regression's outputs hardly vary; around the targets' mean (2.9, the default start) that
    # spread is near float32's resolution and Pearson of two float32 passes differs at 1e-4: start at zero here.
    at_zero = ["model.regression_bias_init=zero"] if task == "stsb" else []
    cfg = compose_cfg([*glue_overrides(root, task), *at_zero])
    metrics = run(cfg)
    out = tmp_path / "run"
    assert json.loads((out / "metrics.json").read_text()) == pytest.approx(metrics)
    splits = ["val", "test", *(["test_mm"] if task == "mnli" else [])]
    names = EXPECTED_METRICS[task]
    assert {k for k in metrics if k.split("/")[0] in splits and k.split("/")[1] != "loss"} == {
        f"{split}/{name}" for split in splits for name in names
    }
    assert (
        cfg.main_metric
        == f"val/{ {'cola': 'mcc', 'mrpc': 'f1', 'qqp': 'f1', 'stsb': 'pearson'}.get(task, 'acc') }"
    )
    ckpt = next((out / "checkpoints").glob("best-*.ckpt"))
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    heads = [v.shape[0] for k, v in state.items() if k.endswith("classifier.modules_to_save.default.weight")]
    assert heads == [{"mnli": 3, "stsb": 1}.get(task, 2)]
    # Same predictions, metrics computed by sklearn/scipy: the test splits hold every dev row (quoting off: the
    # rows with an unbalanced quote character stay rows of their own).
    for split, (labels, preds) in predictions(cfg, ckpt).items():
        assert len(labels) == (46 if split == "test_mm" else 40)
        if LABELS[task] is not None:
            assert np.bincount(labels).tolist() == [
                len(labels) // len(LABELS[task]) + (i < len(labels) % len(LABELS[task]))
                for i in range(len(LABELS[task]))
            ]
        for name in names:
            assert metrics[f"{split}/{name}"] == pytest.approx(REFERENCE[name](labels, preds), abs=1e-4)


@pytest.mark.parametrize(
    ("name", "num_labels"),
    [("acc", 2), ("acc", 3), ("f1", 2), ("mcc", 2), ("mcc", 3), ("pearson", 1), ("spearman", 1)],
)
def test_each_metric_matches_sklearn_and_scipy(name, num_labels):
    from adls_lightning.data.tasks import build_metric

    rng = np.random.default_rng(0)
    labels = rng.normal(size=300) if num_labels == 1 else rng.integers(0, num_labels, 300)
    preds = (
        labels + rng.normal(size=300)
        if num_labels == 1
        else np.where(rng.random(300) < 0.6, labels, rng.integers(0, num_labels, 300))
    )
    metric = build_metric(name, num_labels)
    for chunk in range(3):  # accumulated over batches, as in an epoch
        part = slice(100 * chunk, 100 * (chunk + 1))
        metric.update(
            torch.as_tensor(preds[part], dtype=torch.float32 if num_labels == 1 else torch.long),
            torch.as_tensor(labels[part], dtype=torch.float32 if num_labels == 1 else torch.long),
        )
    assert float(metric.compute()) == pytest.approx(REFERENCE[name](labels, preds), abs=1e-5)


def test_glue_from_the_hub_renames_columns_and_takes_dev_as_test(monkeypatch, compose_cfg, tmp_path):
    calls = []

    def fake_load_dataset(name, config=None, **kwargs):
        calls.append((name, config))
        split = lambda n: datasets.Dataset.from_dict(  # noqa: E731
            {
                "premise": [f"p {i}" for i in range(n)],
                "hypothesis": [f"h {i}" for i in range(n)],
                "label": [i % 3 for i in range(n)],
                "idx": list(range(n)),
            }  # fmt: skip
        )
        return datasets.DatasetDict(
            {
                "train": split(90),
                "validation_matched": split(12),
                "validation_mismatched": split(15),
                "test_matched": split(5),
            }
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = compose_cfg(["data=glue", "data.task=mnli", "data.data_dir=null", "data.val_size=10"])
    datamodule = build(cfg.data, "data")
    datamodule.setup("fit")
    assert calls == [("nyu-mll/glue", "mnli")]
    assert {k: len(v) for k, v in datamodule.splits.items()} == {
        "train": 80,
        "val": 10,
        "test": 12,
        "test_mm": 15,
    }
    assert "token_type_ids" in datamodule.splits["train"].column_names  # tokenized as pairs
    assert datamodule.task.label_names == ("entailment", "neutral", "contradiction")


def test_pairs_are_tokenized_as_pairs(compose_cfg, tmp_path):
    root = write_glue_task(tmp_path / "glue", "rte")
    cfg = compose_cfg([*glue_overrides(root, "rte"), "data.max_length=12"])
    datamodule = build(cfg.data, "data")
    datamodule.setup("fit")
    tokenizer = datamodule.tokenizer
    row = datamodule.splits["test"].with_format(None)[0]
    first, second = (tmp_path / "glue" / "RTE" / "dev.tsv").read_text().splitlines()[1].split("\t")[1:3]
    expected = tokenizer(first, second, truncation=True, max_length=12)
    assert row["input_ids"] == expected["input_ids"] and row["token_type_ids"] == expected["token_type_ids"]
    assert 1 in row["token_type_ids"] and len(row["input_ids"]) <= 12
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["token_type_ids"].shape == batch["input_ids"].shape


def test_folder_task_with_pairs_string_labels_and_regression(compose_cfg, tmp_path):
    import pandas as pd

    folder = tmp_path / "own"
    folder.mkdir()
    names = ["neutral", "contradiction", "entailment"]
    for split, n in (("train", 90), ("test", 30)):
        pd.DataFrame(
            {
                "text": [f"a {i}" for i in range(n)],
                "text_pair": [f"b {i}" for i in range(n)],
                "label": [names[i % 3] for i in range(n)],
            }
        ).to_json(folder / f"{split}.jsonl", orient="records", lines=True)
    cfg = compose_cfg(["data=folder", f"data.data_dir={folder}", "data.val_size=15"])
    datamodule = build(cfg.data, "data")
    datamodule.setup("fit")
    assert datamodule.task.label_names == ("contradiction", "entailment", "neutral")  # sorted, recorded
    assert datamodule.task.metrics == ("acc",)
    test = datamodule.splits["test"].with_format(None)
    assert [row["label"] for row in test][:3] == [2, 0, 1]  # neutral, contradiction, entailment
    # floats: a regression, main metric named by the user
    reg = tmp_path / "reg"
    reg.mkdir()
    for split, n in (("train", 60), ("test", 20)):
        pd.DataFrame({"text": [f"a {i}" for i in range(n)], "label": [i / 7 for i in range(n)]}).to_parquet(
            reg / f"{split}.parquet"
        )
    cfg = compose_cfg(
        ["data=folder", f"data.data_dir={reg}", "data.val_size=10", "data.main_metric=spearman"]
    )
    datamodule = build(cfg.data, "data")
    datamodule.setup("fit")
    assert datamodule.task.is_regression and datamodule.task.metrics == ("spearman", "pearson")
    assert cfg.main_metric == "val/spearman"
    with pytest.raises(
        ConfigError,
        match=r"data.main_metric=acc: not a metric of this task \(its metrics: pearson, spearman\)",
    ):
        build(compose_cfg(["data=folder", f"data.data_dir={reg}", "data.val_size=10"]).data, "data").setup(
            "fit"
        )


# --------------------------------------------------------------------------------------------------- bad input
def _bad_cases(base: Path, good: Path, ckpt: Path) -> dict[str, tuple[list[str], str]]:
    def variant(name: str, task: str, edit) -> Path:
        root = write_glue_task(base / name, task)
        edit(root / FOLDERS[task])
        return root

    def bad_header(folder: Path) -> None:
        lines = (folder / "train.tsv").read_text().splitlines(keepends=True)
        (folder / "train.tsv").write_text("index\tpremise\thypothesis\tlabel\n" + "".join(lines[1:]))

    def bad_label(folder: Path) -> None:
        rows = [line.split("\t") for line in (folder / "dev.tsv").read_text().splitlines()]
        rows[5][-1] = "maybe"
        write_tsv(folder / "dev.tsv", None, rows)

    def bad_score(folder: Path) -> None:
        rows = [line.split("\t") for line in (folder / "train.tsv").read_text().splitlines()]
        rows[8][-1] = "high"
        write_tsv(folder / "train.tsv", None, rows)

    no_dev = variant("no_dev", "rte", lambda folder: (folder / "dev.tsv").unlink())
    return {
        "unknown_task": (
            ["data=glue", "data.task=glu", f"data.data_dir={good}"],
            "data.task=glu: unknown GLUE task (valid: cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli)",
        ),
        "missing_file": (["data=glue", "data.task=rte", f"data.data_dir={no_dev}"], "no RTE/dev.tsv"),
        "bad_header": (
            ["data=glue", "data.task=rte", f"data.data_dir={variant('header', 'rte', bad_header)}"],
            "is not GLUE rte's",
        ),
        "bad_label": (
            ["data=glue", "data.task=rte", f"data.data_dir={variant('label', 'rte', bad_label)}"],
            "line 6 has label 'maybe' (GLUE rte's labels: entailment, not_entailment)",
        ),
        "bad_score": (
            ["data=glue", "data.task=stsb", f"data.data_dir={variant('score', 'stsb', bad_score)}"],
            "line 9 has score 'high' (GLUE stsb needs a number)",
        ),
        "swap_one_way_pairs": (  # entailment is one-way: the swapped pair would not keep its label
            ["data=glue", "data.task=rte", f"data.data_dir={good}", "data.swap_pairs=true"],
            "data.swap_pairs=true: GLUE rte's label depends on the order of its texts (swapping is for the "
            "symmetric tasks: mrpc, stsb, qqp)",
        ),
        "swap_single_texts": (
            ["data.swap_pairs=true"],  # IMDb: one review per row
            "data.swap_pairs=true: this data has single texts, no text_pair column to swap",
        ),
        # an init_ckpt of another label count: the run's check_label_count, refused in-process by
        # test_init_head_new_starts_a_task_from_another_tasks_encoder; from the command line, an init_ckpt refused
        # once the model is built is this case (each one a Lightning-importing process of ~12 CPU-s)
        "lora_into_full": (  # the tiny model's checkpoint has LoRA adapters; the route is its merged export
            ["data=glue", "data.task=rte", f"data.data_dir={good}", "model/lora=none", f"init_ckpt={ckpt}"],
            "a LoRA checkpoint, and this model has no LoRA adapters (model.lora=null); keep the run's LoRA, or "
            f"export it merged (python -m adls_lightning.export ckpt={ckpt} out=DIR format=hf)",
        ),
    }


def test_swap_pairs_adds_each_training_pair_in_the_other_order(compose_cfg, tmp_path):
    """data.swap_pairs=true (MRPC: paraphrase is symmetric): the training split holds every pair twice, once as
    GLUE writes it and once with its texts swapped, tokenized as the tokenizer encodes (second, first), with the
    same label; validation and test are the same rows as without it."""
    root = write_glue_task(tmp_path / "glue", "mrpc")
    plain = build(compose_cfg(glue_overrides(root, "mrpc")).data, "data")
    plain.setup("fit")
    swapped = build(compose_cfg([*glue_overrides(root, "mrpc"), "data.swap_pairs=true"]).data, "data")
    swapped.setup("fit")
    train = plain.splits["train"].with_format(None)
    doubled = swapped.splits["train"].with_format(None)
    assert len(doubled) == 2 * len(train)
    for split in ("val", "test"):
        assert (
            swapped.splits[split].with_format(None)["input_ids"]
            == plain.splits[split].with_format(None)["input_ids"]
        )
    # each training row's texts and label, found in the file through the row's token ids
    tokenizer, max_length = plain.tokenizer, swapped.hparams.max_length
    rows = [line.split("\t") for line in (root / "MRPC" / "train.tsv").read_text().splitlines()[1:]]
    by_ids = {
        tuple(tokenizer(r[3], r[4], truncation=True, max_length=max_length)["input_ids"]): r for r in rows
    }
    originals, mirrors = doubled.select(range(len(train))), doubled.select(range(len(train), len(doubled)))
    assert originals["input_ids"] == train["input_ids"]
    for original, mirror in zip(originals, mirrors):
        label, _, _, first, second = by_ids[tuple(original["input_ids"])]
        expected = tokenizer(second, first, truncation=True, max_length=max_length)
        assert mirror["input_ids"] == expected["input_ids"] != original["input_ids"]
        assert mirror["token_type_ids"] == expected["token_type_ids"]
        assert mirror["label"] == original["label"] == int(label)


def test_init_head_new_starts_a_task_from_another_tasks_encoder(compose_cfg, tmp_path):
    """Intermediate-task transfer: RTE (2 labels) from an STS-B checkpoint (1 output). With init_head=new every
    tensor but the head's comes from the checkpoint and the head keeps its fresh initialisation; the run trains and
    checkpoints a 2-way head. Without it the run is refused, naming init_head=new."""
    run(compose_cfg(glue_overrides(write_glue_task(tmp_path / "glue", "stsb"), "stsb")))
    ckpt = next((tmp_path / "run" / "checkpoints").glob("best-*.ckpt"))
    source = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    rte = write_glue_task(tmp_path / "glue", "rte")

    with pytest.raises(ConfigError, match="its classifier has 1 output.*add init_head=new"):
        run(compose_cfg([*glue_overrides(rte, "rte"), f"init_ckpt={ckpt}"], tmp_path / "refused"))

    cfg = compose_cfg([*glue_overrides(rte, "rte"), f"init_ckpt={ckpt}", "init_head=new"], tmp_path / "rte")
    datamodule = build(cfg.data, "data")
    datamodule.setup("fit")
    overrides = {"init_ckpt": str(ckpt), "init_head": "new", **datamodule.task.model_overrides()}
    model = build(cfg.model, "model", _convert_="partial", **overrides)
    head = {k: v.clone() for k, v in model.state_dict().items() if ".classifier." in f".{k}"}
    model.setup("fit")
    loaded = model.state_dict()
    assert head and all(torch.equal(loaded[k], v) for k, v in head.items())  # the fresh head, untouched
    assert {v.shape[0] for k, v in head.items() if k.endswith("weight") and "lora_" not in k} == {2}
    encoder = [k for k in source if k not in head]
    assert len(encoder) == len(loaded) - len(head) and len(encoder) > 20
    for key in encoder:
        assert torch.equal(loaded[key], source[key]), key

    metrics = run(cfg)
    assert {"val/acc", "test/acc"} <= set(metrics)
    trained = torch.load(next((tmp_path / "rte" / "checkpoints").glob("best-*.ckpt")), weights_only=False)
    assert (
        trained["state_dict"]["model.base_model.model.classifier.modules_to_save.default.weight"].shape[0]
        == 2
    )


def test_a_folder_fine_tuned_on_another_task_starts_a_new_task(tiny_bert, tmp_path):
    """model.backbone.name_or_path may name a folder fine-tuned on another task (an exported STS-B model: one
    output): every encoder weight comes from it and the head is new, sized for this task. A weight of the encoder
    whose shape differs from the folder's own config is refused in one line naming it."""
    stsb = tiny_bert(seed=3, num_labels=1)
    stsb.save_pretrained(tmp_path / "stsb")
    model = load_pretrained(str(tmp_path / "stsb"), num_labels=3)
    source, loaded = stsb.state_dict(), model.state_dict()
    assert loaded["classifier.weight"].shape == (3, 32) and loaded["classifier.bias"].shape == (3,)
    encoder = [k for k in source if not k.startswith("classifier.")]
    assert len(encoder) > 20
    for key in encoder:
        assert torch.equal(loaded[key], source[key]), key

    config = json.loads((tmp_path / "stsb" / "config.json").read_text())
    (tmp_path / "resized").mkdir()
    (tmp_path / "resized" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    (tmp_path / "resized" / "model.safetensors").write_bytes(
        (tmp_path / "stsb" / "model.safetensors").read_bytes()
    )
    with pytest.raises(
        ConfigError, match=r"name_or_path=.*resized: weights whose shape .*intermediate\.dense\.weight"
    ):
        load_pretrained(str(tmp_path / "resized"), num_labels=3)


def test_train_py_starts_a_task_from_a_folder_of_another_task(tiny_bert, tmp_path, cache_dir):
    """The documented route, as a user runs it: a folder as export writes it (weights of a one-output STS-B model,
    its config, the tokenizer), named as the pretrained model of an RTE run without LoRA."""
    folder = tmp_path / "stsb_export"
    tiny_bert(seed=3, num_labels=1, vocab_size=30522).save_pretrained(folder)
    AutoTokenizer.from_pretrained(packaged_model_dir()).save_pretrained(folder)
    rte = write_glue_task(tmp_path / "glue", "rte")
    out = tmp_path / "rte"
    command = [
        sys.executable, str(ROOT / "train.py"), "experiment=glue_cpu", "data.task=rte", f"data.data_dir={rte}",
        "model/lora=none", f"model.backbone.name_or_path={folder}", "logger=none", "trainer.max_epochs=1",
        "+trainer.limit_train_batches=1", "data.val_size=20", "callbacks.rich_progress_bar=null",
        f"paths.cache_dir={cache_dir}", f"hydra.run.dir={out}",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "another task's head, replaced: classifier.bias, classifier.weight" in proc.stdout + proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["test/acc"] <= 1 and metrics["params/trainable"] == metrics["params/total"]


def test_bad_glue_input_is_one_line_and_writes_nothing(compose_cfg, tmp_path, tiny_imdb_dir, cache_dir):
    good = write_glue_task(tmp_path / "good", "rte")
    run(compose_cfg(glue_overrides(good, "rte")))  # a LoRA checkpoint to start a run without LoRA from
    ckpt = next((tmp_path / "run" / "checkpoints").glob("best-*.ckpt"))
    cases = _bad_cases(tmp_path / "bad", good, ckpt)

    def attempt(item):
        name, (args, expected) = item
        out = tmp_path / f"out_{name}"
        return name, expected, out, run_train(tiny_imdb_dir, cache_dir, out, *args, "data.val_size=20")

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(attempt, cases.items()))
    for name, expected, out, proc in results:
        assert_one_line_error(proc, contains=expected)
        # Hydra may have made the (empty) run folder before the task's checks; nothing is written into it
        written = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
        assert not written, f"{name} wrote {written}"
