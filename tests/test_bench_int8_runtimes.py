"""``benchmarks/bench_int8_runtimes.py`` as documented, on the tiny BERT: every row, the CPU line, and the fastest
int8 runtime recorded where ``int8=auto`` reads it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from adls_lightning import int8_runtime
from adls_lightning.gemm import u8s8_saturates

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_tiny_run_prints_each_runtime_and_records_the_fastest(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_int8_runtimes.py"), "--tiny", "--batch", "2"]
    command += ["--tokens", "16", "--repeats", "2", "--rows", "0", "--cache-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.startswith("CPU: ") and "thread(s); torch " in out.splitlines()[0]
    rows = dict(re.findall(r"^(\S.*?)\s+(\d+\.\d+|\(left out: .*\))", out, re.MULTILINE))
    for name in ("torch eager fp32", "torch bf16 weights", *int8_runtime.RUNTIMES):
        assert name in rows, (name, out)
    # the saturating file's row appears exactly where the ort-dynamic row is the repaired one
    assert ("ort-dynamic as written" in rows) is u8s8_saturates(), out
    [line] = [x for x in out.splitlines() if x.startswith("fastest int8 runtime on this CPU at batch 2: ")]
    best = line.split(": ")[1].split(" ")[0]
    timed = {name: float(rows[name]) for name in int8_runtime.RUNTIMES if not rows[name].startswith("(")}
    assert best in timed and timed[best] == min(timed.values())
    [recorded] = json.loads((tmp_path / int8_runtime.CACHE_FILE).read_text()).values()
    assert min(recorded, key=recorded.get) == best and "ort-dynamic as written" not in recorded
