"""``python -m adls_lightning.export format=onnx``: the ONNX file of a LoRA checkpoint and of a pruned training run
against the PyTorch model rebuilt here (not by the export), at other batch sizes and sequence lengths than the
export's sample; the int8 file; bad options and fake-quantized checkpoints as one-line errors."""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from pathlib import Path

import lightning
import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from adls_lightning.app.training import run
from adls_lightning.export import onnx as onnx_export
from adls_lightning.lora import merge_lora
from adls_lightning.prune import Pruner
from adls_lightning.quant.transform import quantize_model
from adls_lightning.tools.export import main
from tests.helpers import TINY, build_module, merged_model, run_export, trained_checkpoint

# |ort - torch| <= ATOL + RTOL * |torch|: the tolerance the export itself checks with
ATOL, RTOL = onnx_export.FP32_ATOL, onnx_export.FP32_RTOL
# (rows, tokens) unlike the export's 4 x 16 sample: one row, an odd length, more rows than tokens, a longer batch
OTHER_SHAPES = [(1, 7), (5, 3), (3, 40)]
# a short prune run (as tests/test_prune_callback.py), weights only: activation pruning is runtime behaviour that
# no export carries (docs/mxint8.md, format=onnx)
PRUNE_RUN = [
    "data.train_size=32",
    "data.val_size=16",
    "data.test_size=16",
    "data.max_length=16",
    "trainer.max_epochs=1",
    "prune=l1_0.5",
    "prune.activation=null",
]
# tiny_random: 2 layers x (q, k, v, attention.output 32x32; intermediate 64x32; output 32x64) + pooler 32x32
TINY_PRUNED_WEIGHTS = 2 * (4 * 32 * 32 + 2 * 64 * 32) + 32 * 32


def export_in_process(*args: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(args))
    return code, stdout.getvalue(), stderr.getvalue()


def batch(vocab: int, rows: int, tokens: int, seed: int = 2) -> dict[str, torch.Tensor]:
    """Random ids; every row after the first is padded from a random point (at least one real token)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (rows, tokens), generator=generator)
    lengths = torch.randint(1, tokens + 1, (rows,), generator=generator)
    lengths[0] = tokens
    attention_mask = (torch.arange(tokens) < lengths[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def ort_logits(path: Path, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    return onnx_export.onnx_logits(onnx_export.onnx_session(path), inputs)


def torch_logits(model, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    with torch.inference_mode():
        return model(**inputs).logits.numpy()


@pytest.fixture(scope="module")
def lora_export(tmp_path_factory) -> tuple[Path, Path, str]:
    """A LoRA checkpoint (non-zero B) exported with int8=true by the command, as a user runs it: (ckpt, folder, the
    command's stdout). The file's one command-line export (test_command_line_export reads it): the other tests
    read its folder or its checkpoint."""
    folder = tmp_path_factory.mktemp("lora_onnx")
    ckpt = folder / "tiny.ckpt"
    trained_checkpoint(ckpt, TINY)
    result = run_export(f"ckpt={ckpt}", f"out={folder / 'out'}", "format=onnx", "int8=true", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    return ckpt, folder / "out", result.stdout


def test_lora_export_matches_the_merged_model_at_other_shapes(lora_export):
    ckpt, out, stdout = lora_export
    model = merged_model(ckpt, TINY)
    path = out / onnx_export.ONNX_FILE
    for rows, tokens in OTHER_SHAPES:
        inputs = batch(model.config.vocab_size, rows, tokens)
        expected = torch_logits(model, inputs)
        np.testing.assert_allclose(
            ort_logits(path, inputs), expected, rtol=RTOL, atol=ATOL, err_msg=f"{rows}x{tokens}"
        )
    # the merge matters: unmerged base weights give other logits
    base = build_module(TINY).model.get_base_model().eval()
    inputs = batch(model.config.vocab_size, 3, 40)
    assert np.abs(torch_logits(base, inputs) - ort_logits(path, inputs)).max() > 1e-3

    graph = onnx.load(str(path))
    assert [o.version for o in graph.opset_import if o.domain == ""] == [onnx_export.ONNX_OPSET]
    shapes = {
        value.name: [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        for value in [*graph.graph.input, *graph.graph.output]
    }
    assert shapes == {
        "input_ids": ["batch", "sequence"],
        "attention_mask": ["batch", "sequence"],
        "logits": ["batch", 2],
    }
    # the export's line, then its self-check's table (tests/test_export_selfcheck.py)
    summary, check = stdout.split("self-check", 1)
    summary = summary.strip().splitlines()
    assert "agreement" in check and "speedup" in check
    assert (
        len(summary) == 1
        and f"opset {onnx_export.ONNX_OPSET}" in summary[0]
        and "argmax agrees 4/4" in summary[0]
    )


def test_int8_model_runs_close_to_fp32(lora_export):
    ckpt, out, stdout = lora_export
    model = merged_model(ckpt, TINY)
    fp32_file, int8_file = out / onnx_export.ONNX_FILE, out / onnx_export.ONNX_INT8_FILE
    # ORT quantizes the linear weights and the embedding tables (Gather), most of the tiny model's 4.4 MB
    assert int8_file.stat().st_size < 0.4 * fp32_file.stat().st_size
    inputs = batch(model.config.vocab_size, 64, 24)
    expected = torch_logits(model, inputs)
    int8 = ort_logits(int8_file, inputs)
    difference = np.abs(int8 - expected).max()
    agreement = float((int8.argmax(-1) == expected.argmax(-1)).mean())
    print(
        f"int8 vs fp32 PyTorch, 64 rows x 24 tokens: max |Δlogit| {difference:.3g}, argmax agreement {agreement:.1%}"
    )
    # random weights give logits of ~0.1 around near-ties; int8 must move them by little and flip few
    assert difference < 0.05 and agreement >= 0.9
    assert "model_int8.onnx" in stdout

    # ONNX Runtime fp32 vs torch eager on this tiny model, printed, not asserted (a shared machine). One thread each:
    # on a loaded machine a parallel region waits for a descheduled thread, which is all a tiny model's ops measure.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        session, inputs = onnx_export.onnx_session(fp32_file), batch(model.config.vocab_size, 8, 128)
        timings = {}
        for name, call in {
            "torch eager": lambda: torch_logits(model, inputs),
            "ORT fp32": lambda: onnx_export.onnx_logits(session, inputs),
        }.items():
            call()
            start = time.perf_counter()
            for _ in range(10):
                call()
            timings[name] = (time.perf_counter() - start) / 10
    finally:
        torch.set_num_threads(threads)
    print(
        f"8 x 128 tokens, 1 thread: torch eager {timings['torch eager'] * 1e3:.2f} ms, ORT fp32 "
        f"{timings['ORT fp32'] * 1e3:.2f} ms (ORT {timings['torch eager'] / timings['ORT fp32']:.2f}x faster)"
    )


def test_pruned_run_exports_with_its_masks_baked_in(compose_cfg, tmp_path):
    run(compose_cfg(PRUNE_RUN))
    ckpt = next((tmp_path / "run/checkpoints").glob("best-*.ckpt"))
    code, stdout, stderr = export_in_process(f"ckpt={ckpt}", f"out={tmp_path / 'out'}", "format=onnx", *TINY)
    assert code == 0, stderr[-3000:]

    # the run's model rebuilt as the run holds it: LoRA merged, masks as live parametrizations (not baked)
    module = build_module(TINY)
    merge_lora(module)
    Pruner(weight={"sparsity": 0.5, "method": "l1"}).register_placeholders(module)
    module.load_state_dict(torch.load(ckpt, weights_only=False)["state_dict"], strict=True)
    model = module.model.eval()
    path = tmp_path / "out" / onnx_export.ONNX_FILE
    for rows, tokens in OTHER_SHAPES:
        inputs = batch(model.config.vocab_size, rows, tokens)
        np.testing.assert_allclose(
            ort_logits(path, inputs),
            torch_logits(model, inputs),
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"{rows}x{tokens}",
        )
    # half of every pruned weight is an exact zero in the file (trained float weights never are); the exporter
    # folds the transposed weights into constants of its own names, so count every float matrix but the embeddings
    matrices = [
        numpy_helper.to_array(t)
        for t in onnx.load(str(path)).graph.initializer
        if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2 and "embeddings" not in t.name
    ]
    assert sum(int((m == 0).sum()) for m in matrices) == TINY_PRUNED_WEIGHTS // 2


def test_fake_quantized_checkpoint_without_its_recipe_is_refused_naming_the_key(tmp_path):
    module = build_module(TINY)
    merge_lora(module)
    quantize_model(
        module.model, {"linear": {"config": {"name": "integer", "data_in_width": 8, "weight_width": 8}}}
    )
    ckpt = tmp_path / "quant.ckpt"
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": lightning.__version__}, ckpt)
    code, _, stderr = export_in_process(f"ckpt={ckpt}", f"out={tmp_path / 'out'}", "format=onnx", *TINY)
    assert code == 2
    # no run record beside this checkpoint and no quant= given: the quantization cannot be known (a run's own
    # checkpoints export: tests/test_export_compressed.py)
    assert stderr.strip().splitlines()[-1] == (
        f"error: ckpt={ckpt}: model.bert.encoder.layer.0.attention.self.query.linear.weight is the state of a "
        "fake-quantized layer, but the run's config (['model=tiny_random']) quantizes nothing; pass the quant= or "
        "compress= overrides it was trained with"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["format=onnx", "int8=maybe"], "error: int8=maybe: must be true, false, scaled or auto"),
        (["format=hf", "int8=true"], "error: int8=true: only with format=onnx"),
        (["format=tflite"], "error: format=tflite: must be one of mxint8, hf, onnx"),
    ],
)
def test_bad_option_is_one_line_exit_2(lora_export, tmp_path, args, message):
    ckpt = lora_export[0]
    code, _, stderr = export_in_process(f"ckpt={ckpt}", f"out={tmp_path / 'out'}", *args, *TINY)
    assert code == 2 and stderr.strip().splitlines()[-1].startswith(message), stderr
    assert "Traceback" not in stderr and not (tmp_path / "out").exists()


def test_logits_off_the_tolerance_fail_loudly(lora_export, tmp_path, monkeypatch):
    """An export whose ONNX Runtime logits miss PyTorch's (here: shifted by 10x the tolerance) exits 1 with one line."""
    real = onnx_export.onnx_logits
    monkeypatch.setattr(onnx_export, "onnx_logits", lambda session, inputs: real(session, inputs) + 10 * ATOL)
    # the file the fixture's export wrote stands in for a new export (saves the exporter's seconds)
    exported = lora_export[1] / onnx_export.ONNX_FILE
    monkeypatch.setattr(onnx_export, "export_onnx", lambda model, path: shutil.copyfile(exported, path))
    code, stdout, stderr = export_in_process(
        f"ckpt={lora_export[0]}", f"out={tmp_path / 'out'}", "format=onnx", *TINY
    )
    assert code == 1 and not stdout
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "ONNX Runtime logits differ from PyTorch's by up to 0.001" in last


@pytest.mark.slow
def test_command_line_export(lora_export):
    _, out, stdout = lora_export
    assert stdout.startswith(f"exported onnx to {out}: model.onnx ")
    assert (out / onnx_export.ONNX_FILE).is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", ["tiny_roberta", "tiny_distilbert", "tiny_deberta", "tiny_electra", "tiny_albert"]
)
def test_other_families_export_within_the_tolerance(family, tmp_path):
    """The exporter on each family's tiny LoRA model (merged), checked at another shape than the export's sample."""
    module = build_module([f"model={family}"])
    merge_lora(module)
    model = module.model.eval()
    path = tmp_path / onnx_export.ONNX_FILE
    onnx_export.export_onnx(model, path)
    onnx_export.check_against_torch(path, model)
    inputs = batch(model.config.vocab_size, 3, 37)
    np.testing.assert_allclose(ort_logits(path, inputs), torch_logits(model, inputs), rtol=RTOL, atol=ATOL)
