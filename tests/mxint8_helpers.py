"""Helpers shared by the MXINT8 kernel tests (tests/test_mxint8*.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from adls_lightning.mxint8.ops import PORTABLE_CPU_ENV


def assert_passes_with_portable_kernels(test_file: str, keyword: str) -> None:
    """Run the tests of ``test_file`` selected by ``-k keyword`` again in a subprocess with the C++ CPU
    kernels forced onto their portable loops (``ADLS_MXINT8_PORTABLE_CPU=1``, read once at load), and
    assert that some ran and all passed."""
    assert_passes_with_env(test_file, keyword, {PORTABLE_CPU_ENV: "1"})


def assert_passes_with_env(test_file: str, keyword: str, env: dict[str, str]) -> None:
    """Run the tests of ``test_file`` selected by ``-k keyword`` again in a subprocess with ``env`` added to the
    environment (switches read once at import), and assert that some ran and all passed."""
    command = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-k", keyword]
    result = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
