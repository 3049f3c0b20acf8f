"""`scripts/gpu_check.sh --dry-run`: the GPU command's steps and their argument checks run without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_lists_every_step_and_checks_their_arguments():
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", sys.executable],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for step in range(1, 7):
        assert f"== gpu_check: {step}." in out
    # Each Python step ran its own --dry-run (argument parsing) and said what it would measure.
    assert "would measure 64M, 256M, 1G elements on cuda" in out
    assert (
        "would time rows [1, 8, 16, 64] of ['bert-base', 'minilm'] in ['float32', 'bfloat16'] on CUDA" in out
    )
    assert out.count("dry run: would report --from-config") == 2
    assert "would time the mask step of 37 MiniLM linears at sparsity 0.5, 0.9 on cuda" in out
    assert "setup.py build_ext --inplace" in out and "pytest -m gpu" in out
    assert out.rstrip().endswith("gpu_check: dry run ok (nothing measured)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the real run is `make gpu-check`")
def test_gpu_check_without_a_gpu_says_so_and_fails():
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", sys.executable],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "torch sees no CUDA device" in result.stderr and "--dry-run" in result.stderr
