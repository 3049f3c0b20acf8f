"""``benchmarks/bench_train.py --baseline hf-tuned``: the tuned HF Trainer baseline's test accuracy is its model's
accuracy on the test rows, computed here row by row in the rows' own order. transformers 5 also orders
evaluation batches by length when training is length-grouped, so scoring ``predict``'s output against the
dataset's labels in row order gave chance accuracy (0.505 on the 2,000 IMDb test reviews)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import transformers

from adls_lightning.build import build

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_train", ROOT / "benchmarks" / "bench_train.py")
bench_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_train)


def test_tuned_baseline_scores_each_prediction_against_its_own_row(compose_cfg, monkeypatch):
    cfg = compose_cfg(["model=minilm", "data.max_length=48", "data.batch_size=16", "trainer.max_epochs=1"])
    datamodule = build(cfg.data, "data")
    datamodule.setup("fit")
    monkeypatch.setattr(
        bench_train, "hf_tuned_bf16", lambda: False
    )  # fp32: the row-by-row check below is exact
    trained = {}
    predict = transformers.Trainer.predict

    def keep_model(self, *args, **kwargs):
        trained["model"] = self.model
        return predict(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "predict", keep_model)
    result = bench_train.run_plain_hf(cfg, datamodule, tuned=True)

    model = trained["model"].eval()
    test = datamodule.splits["test"].with_format(None)
    labels, predicted = [], []
    with torch.inference_mode():
        for row in test:
            ids = torch.tensor([row["input_ids"]])
            predicted.append(int(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.argmax(-1)))
            labels.append(int(row["label"]))
    accuracy = sum(p == y for p, y in zip(predicted, labels, strict=True)) / len(labels)
    assert 0 < sum(predicted) < len(predicted), "the model predicts one label only: the order would not show"
    # the batched predictions pad rows, which may flip a near-tie: at most one row in a hundred
    assert abs(result["test_acc"] - accuracy) <= 0.01, (result["test_acc"], accuracy)
    assert (
        accuracy > 0.6
    )  # the keyword reviews are learnt in one epoch: a misordered score would sit near 0.5
