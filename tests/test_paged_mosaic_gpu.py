"""The Mosaic GPU sparse MLA kernel's checks (`mosaic_gpu_checks.py`: GPU interpret mode
against the reference, the lowering for an H100, the config checks), run in a process of their
own, so that lowering and interpreting Mosaic GPU kernels leaves no state in a test worker."""

from __future__ import annotations

from conftest import run_pytest


def test_mosaic_gpu_paged_kernel_checks_in_their_own_process():
    assert " passed" in run_pytest("tests/mosaic_gpu_checks.py")
