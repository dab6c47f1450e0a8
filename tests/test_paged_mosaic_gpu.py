"""The Mosaic GPU paged sparse MLA kernel's checks (`mosaic_gpu_checks.py`: GPU interpret mode
against the reference, the lowering for an H100, the config checks), run in a process of their
own: lowering and interpreting Mosaic GPU kernels in a test worker left it crashing later inside
XLA's serialisation of an unrelated CPU program for the compilation cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_mosaic_gpu_paged_kernel_checks_in_their_own_process():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(HERE / "mosaic_gpu_checks.py")], cwd=HERE.parent, env=dict(os.environ),
                          capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
