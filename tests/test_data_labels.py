"""Class names: IMDb's preset names its labels 0 and 1 ``negative`` and ``positive`` (what the model records as
``id2label`` and an export's predictions print), a folder of one's own keeps its label values unless
``data.label_names`` names them, and a bad ``data.label_names`` is one line, in the pre-flight check as in the
data module. The expected names are IMDb's dataset card (0 = negative review), not read from the code."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from adls_lightning.build import build
from adls_lightning.data.sources import check_local_data
from adls_lightning.errors import ConfigError


def folder_of(tmp_path, labels: list, name: str = "own"):
    folder = tmp_path / name
    folder.mkdir()
    for split, n in (("train", 60), ("test", 12)):
        pd.DataFrame(
            {"text": [f"text {i}" for i in range(n)], "label": labels * (n // len(labels))}
        ).to_parquet(folder / f"{split}.parquet")
    return folder


def test_imdb_names_its_labels_negative_and_positive_and_a_folder_keeps_its_values(compose_cfg, tmp_path):
    # the default data config (IMDb), alone and as experiment=cpu, from a local folder of IMDb's layout or the hub
    # (its task is known without reading the data)
    for preset in ([], ["experiment=cpu"], ["data.data_dir=null"]):
        task = build(compose_cfg(preset).data, "data").task
        assert (task.name, task.label_names) == ("imdb", ("negative", "positive"))
        assert task.model_overrides()["label_names"] == ["negative", "positive"]
    own = folder_of(tmp_path, [0, 1, 2])
    task = build(compose_cfg(["data=folder", f"data.data_dir={own}", "data.val_size=5"]).data, "data").task
    assert (task.name, task.label_names) == ("folder", ("0", "1", "2"))
    named = ["data=folder", f"data.data_dir={own}", "data.val_size=5", "data.label_names=[low,mid,high]"]
    assert build(compose_cfg(named).data, "data").task.label_names == ("low", "mid", "high")


def test_imdb_ids_follow_data_labels_whatever_their_names(compose_cfg, tiny_imdb_dir):
    """The names are set apart from the values: reversing ``data.labels`` reverses the ids, and a tokenized cache
    of the other order is not reused (its key holds the values, not only the names)."""
    test_labels = pd.read_parquet(tiny_imdb_dir / "test.parquet")["label"].to_numpy()
    ids = {}
    for order in ("[0,1]", "[1,0]"):
        data = build(compose_cfg([f"data.labels={order}", "data.val_size=50"]).data, "data")
        data.setup("test")
        assert data.task.label_names == ("negative", "positive")
        rows = data.splits["test"].with_format(None)
        ids[order] = sorted(zip(rows["input_ids"], rows["label"]))
    assert sorted(label for _, label in ids["[0,1]"]) == sorted(test_labels.tolist())
    assert [label for _, label in ids["[1,0]"]] == [1 - label for _, label in ids["[0,1]"]]
    assert np.bincount([label for _, label in ids["[1,0]"]]).tolist() == np.bincount(1 - test_labels).tolist()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "good",
            "data.label_names='good': must be a list of names (non-empty strings), one per class in id order",
        ),
        (
            "[1,2]",
            "data.label_names=[1, 2]: must be a list of names (non-empty strings), one per class in id order",
        ),
        (
            "[neg,mid,pos]",
            "data.label_names=['neg', 'mid', 'pos']: 3 names for 2 classes (labels 0, 1); give one name per class, "
            "in id order",
        ),
        ("[pos,pos]", "data.label_names=['pos', 'pos']: a name given twice; each class needs its own name"),
    ],
)
def test_a_bad_label_names_is_one_line_in_the_preflight_and_the_data_module(compose_cfg, value, message):
    cfg = compose_cfg([f"data.label_names={value}"])
    data = OmegaConf.to_container(cfg.data, resolve=True)
    for refuse in (lambda: check_local_data(data), lambda: build(cfg.data, "data").task):
        with pytest.raises(ConfigError) as caught:
            refuse()
        assert str(caught.value) == message


def test_label_names_of_a_regression_are_refused(compose_cfg, tmp_path):
    scores = folder_of(tmp_path, [0.25, 0.75], "scores")
    overrides = ["data=folder", f"data.data_dir={scores}", "data.val_size=5", "data.main_metric=pearson"]
    cfg = compose_cfg([*overrides, "data.label_names=[low,high]"])
    with pytest.raises(
        ConfigError, match=r"^data.label_names=\['low', 'high'\]: the labels are floats \(a regression"
    ):
        check_local_data(OmegaConf.to_container(cfg.data, resolve=True))
