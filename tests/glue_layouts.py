"""Small GLUE task folders written in the distribution's exact layout (headers, column order, label spellings,
CoLA without a header, MNLI's two dev files with five annotator labels), for tests that cannot download GLUE.

Some sentences carry unbalanced quote characters, as GLUE's do: a reader with quoting on would merge rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "home", "bird", "sang", "loudly", "today", "it"]
# words that carry the label, so a tiny model has something to learn
CUES = ["yes", "no", "maybe"]

HEADERS = {
    "SST-2": ["sentence", "label"],
    "MRPC": ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    "STS-B": [
        "index",
        "genre",
        "filename",
        "year",
        "old_index",
        "source1",
        "source2",
        "sentence1",
        "sentence2",
        "score",
    ],  # fmt: skip
    "QQP": ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
    "MNLI": [
        "index",
        "promptID",
        "pairID",
        "genre",
        "sentence1_binary_parse",
        "sentence2_binary_parse",
        "sentence1_parse",
        "sentence2_parse",
        "sentence1",
        "sentence2",
        "label1",
        "gold_label",
    ],  # fmt: skip
    "QNLI": ["index", "question", "sentence", "label"],
    "RTE": ["index", "sentence1", "sentence2", "label"],
    "WNLI": ["index", "sentence1", "sentence2", "label"],
}
MNLI_DEV_HEADER = [*HEADERS["MNLI"][:11], "label2", "label3", "label4", "label5", "gold_label"]
FOLDERS = {
    "cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "qqp": "QQP", "mnli": "MNLI",
    "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI",
}  # fmt: skip
LABELS = {  # as the files write them, in id order
    "cola": ["0", "1"], "sst2": ["0", "1"], "mrpc": ["0", "1"], "qqp": ["0", "1"], "wnli": ["0", "1"],
    "mnli": ["entailment", "neutral", "contradiction"], "qnli": ["entailment", "not_entailment"],
    "rte": ["entailment", "not_entailment"], "stsb": None,
}  # fmt: skip


def _sentence(rng: np.random.Generator, cue: str, quote: bool) -> str:
    words = list(rng.choice(WORDS, int(rng.integers(3, 12))))
    words.insert(int(rng.integers(0, len(words))), cue)
    text = " ".join(words)
    return f'He said "{text}' if quote else text


def _rows(task: str, n: int, seed: int, dev: bool) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    labels = LABELS[task]
    rows = []
    for i in range(n):
        label = labels[i % len(labels)] if labels else f"{5 * (i % 11) / 10:.3f}"
        cue = CUES[i % len(labels)] if labels else CUES[i % 2]
        s1, s2 = _sentence(rng, cue, i % 7 == 3), _sentence(rng, cue, i % 5 == 1)
        if task == "cola":
            rows.append(["gj04", label, "" if label == "1" else "*", s1])
        elif task == "sst2":
            rows.append([s1, label])
        elif task == "mrpc":
            rows.append([label, str(1000 + i), str(2000 + i), s1, s2])
        elif task == "stsb":
            rows.append(
                [str(i), "main-captions", "MSRvid", "2012test", f"{i:04d}", "none", "none", s1, s2, label]
            )
        elif task == "qqp":
            rows.append([str(i), str(2 * i), str(2 * i + 1), s1, s2, label])
        elif task == "mnli":
            parses = [f"( {s1} )", f"( {s2} )", f"(ROOT {s1})", f"(ROOT {s2})"]
            annotators = [label] * (5 if dev else 1)
            rows.append(
                [str(i), str(31193 + i), f"{31193 + i}n", "government", *parses, s1, s2, *annotators, label]
            )
        else:  # qnli, rte, wnli
            rows.append([str(i), s1, s2, label])
    return rows


def write_tsv(path: Path, header: list[str] | None, rows: list[list[str]]) -> None:
    lines = ([header] if header else []) + rows
    path.write_text("".join("\t".join(row) + "\n" for row in lines), encoding="utf-8")


def write_glue_task(root: Path, task: str, n_train: int = 120, n_dev: int = 40) -> Path:
    """``root/<TASK>/train.tsv`` and its dev file(s) in GLUE's layout; returns ``root``."""
    folder = root / FOLDERS[task]
    folder.mkdir(parents=True, exist_ok=True)
    header = HEADERS.get(FOLDERS[task])
    write_tsv(folder / "train.tsv", header, _rows(task, n_train, 0, dev=False))
    if task == "mnli":
        write_tsv(folder / "dev_matched.tsv", MNLI_DEV_HEADER, _rows(task, n_dev, 1, dev=True))
        write_tsv(folder / "dev_mismatched.tsv", MNLI_DEV_HEADER, _rows(task, n_dev + 6, 2, dev=True))
    else:
        write_tsv(folder / "dev.tsv", header, _rows(task, n_dev, 1, dev=True))
    return root


def write_glue_tasks(root: Path, *tasks: str) -> Path:
    """:func:`write_glue_task` for each of ``tasks`` under one ``root``; returns ``root``."""
    for task in tasks:
        write_glue_task(root, task)
    return root


ONE_STEP = [
    "data.val_size=20",
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=1",
    "data.batch_size=16",
]


def glue_overrides(root: Path, task: str) -> list[str]:
    return ["data=glue", f"data.task={task}", f"data.data_dir={root}", *ONE_STEP]
