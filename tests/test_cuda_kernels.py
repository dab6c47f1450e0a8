"""The CUDA sparse MLA kernels (impl="cuda", pallas_kernels/attention/cuda.py) where no GPU is:
the build script's failure modes, the registry entries without the library, the Python side's
argument checks, shapes and split merge. The kernels themselves run in
benchmarks/sparse_mla_cuda.py on a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import registry
from pallas_kernels.attention import cuda

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "build_cuda_kernels.sh"
BASH = shutil.which("bash") or "/bin/bash"


def _fake_path(tmp_path: Path, *tools: str, nvcc: str | None = None) -> str:
    """A PATH of one folder holding links to `tools` and, with nvcc, a fake nvcc script."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in tools:
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    if nvcc is not None:
        (bin_dir / "nvcc").write_text("#!" + BASH + "\n" + nvcc + "\n")
        (bin_dir / "nvcc").chmod(0o755)
    return str(bin_dir)


def _build(tmp_path: Path, path: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("NVCC", "FFI_INCLUDE")}
    base.update(PATH=path, OUT_DIR=str(tmp_path / "out"), **env)
    return subprocess.run([BASH, str(SCRIPT)], env=base, capture_output=True, text=True, timeout=120)


# ----------------------------------------------------------------------------- the build script


def test_build_without_nvcc_says_so(tmp_path):
    result = _build(tmp_path, _fake_path(tmp_path, "dirname"))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nvcc not found" in lines[0] and "NVCC=" in lines[0], result.stderr
    assert not (tmp_path / "out" / "libglm_sparse_mla.so").exists()


def test_build_without_ffi_headers_says_so(tmp_path):
    path = _fake_path(tmp_path, "dirname", "mkdir", nvcc="exit 0")
    result = _build(tmp_path, path, FFI_INCLUDE=str(tmp_path / "nowhere"))
    assert result.returncode != 0
    assert "XLA FFI headers not found" in result.stderr and "FFI_INCLUDE" in result.stderr, result.stderr
    assert not (tmp_path / "out" / "libglm_sparse_mla.so").exists()


def test_build_reports_a_compiler_failure(tmp_path):
    include = tmp_path / "include" / "xla" / "ffi" / "api"
    include.mkdir(parents=True)
    (include / "ffi.h").write_text("")
    path = _fake_path(tmp_path, "dirname", "mkdir", "cat", nvcc="echo 'sparse_mla_fwd.cu(1): error: broken'; exit 2")
    result = _build(tmp_path, path, FFI_INCLUDE=str(tmp_path / "include"))
    assert result.returncode != 0
    assert "error: broken" in result.stderr and "nvcc failed" in result.stderr, result.stderr
    assert not (tmp_path / "out" / "libglm_sparse_mla.so").exists()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_build_compiles_spill_free(tmp_path):
    """The real build (about 20 s): against this jaxlib's FFI headers, into a temporary folder;
    every kernel listed without spills."""
    env = {k: v for k, v in os.environ.items() if k not in ("NVCC",)}
    env.update(OUT_DIR=str(tmp_path), FFI_INCLUDE=jax.ffi.include_dir())
    result = subprocess.run([BASH, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    kernels = [line for line in result.stdout.splitlines() if "sparse_mla_fwd_kernel<" in line]
    assert len(kernels) == 12, result.stdout
    assert all("0 bytes spill stores, 0 bytes spill loads" in line for line in kernels), result.stdout
    assert (tmp_path / "libglm_sparse_mla.so").is_file()


# ----------------------------------------------------------------------------- registry


@pytest.mark.parametrize("op", ["sparse_mla", "paged_sparse_mla"])
def test_registry_entry(op, monkeypatch):
    entry = pk.REGISTRY[op]["cuda"]
    assert entry.platform == "gpu" and not entry.interpretable and not entry.auto
    assert entry.config is cuda.SparseMLACudaConfig
    monkeypatch.setattr(registry.jax, "default_backend", lambda: "gpu")
    assert pk.resolve_impl(op, "auto") == "pallas_gpu"


def test_import_on_cpu_registers_nothing():
    code = ("import jax, pallas_kernels; from pallas_kernels.attention import cuda; "
            "assert jax.default_backend() == 'cpu'; assert not cuda._registered; print('ok')")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def _inputs(B=1, S=2, H=64, T=16, K=8, dtype=jnp.bfloat16):
    q = jnp.zeros((B, S, H, cuda.DK), dtype)
    kv = jnp.zeros((B, T, cuda.DK), dtype)
    idx = jnp.zeros((B, S, K), jnp.int32)
    return q, kv, idx


def test_public_op_on_cpu_is_refused():
    q, kv, idx = _inputs()
    with pytest.raises(ValueError, match="impl='cuda' compiles for gpu, but this runs on the CPU"):
        pk.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=512, impl="cuda")
    with pytest.raises(ValueError, match="no interpret mode"):
        pk.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=512, impl="cuda", interpret=True)


def test_missing_library_names_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda.LIB_ENV, str(tmp_path / "missing.so"))
    monkeypatch.setattr(cuda, "_registered", False)
    assert not cuda.available()
    q, kv, idx = _inputs()
    for fn in (lambda: cuda.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=512),
               lambda: cuda.forward(q, kv, idx, sm_scale=0.1)):
        with pytest.raises(RuntimeError, match=r"not built: run scripts/build_cuda_kernels.sh") as info:
            jax.eval_shape(fn)
        assert "\n" not in str(info.value)
    assert not cuda._registered


@pytest.mark.parametrize("change, match", [
    (dict(H=32), "a multiple of 64 heads"),
    (dict(dtype=jnp.float32), "bf16 q and kv"),
    (dict(v_dim=128), "v_dim = 512"),
    (dict(return_target=True), "no indexer target"),
])
def test_unsupported_calls_name_the_fallback(change, match):
    v_dim = change.pop("v_dim", 512)
    target = change.pop("return_target", False)
    q, kv, idx = _inputs(**change)
    with pytest.raises(ValueError, match=match + ".*use impl='pallas_gpu'"):
        cuda.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=v_dim, return_target=target)


def test_config_is_validated():
    assert cuda.SparseMLACudaConfig().stages == 2
    assert cuda.SparseMLACudaConfig(block_k=32).stages == 4
    for bad in (dict(block_k=48), dict(block_k=64, num_stages=3), dict(num_splits=0),
                dict(backward=pk.XlaConfig())):
        with pytest.raises(ValueError, match="SparseMLACudaConfig"):
            cuda.SparseMLACudaConfig(**bad)


# ----------------------------------------------------------------------------- shapes, splits


@pytest.fixture
def no_library(monkeypatch):
    """Tracing without the library: registration skipped (eval_shape never runs the kernel)."""
    monkeypatch.setattr(cuda, "ensure_registered", lambda: None)


@pytest.mark.parametrize("H, K, splits", [(64, 8, None), (64, 2048, 3), (128, 100, None)])
def test_forward_shapes(no_library, H, K, splits):
    q, kv, idx = _inputs(B=2, S=3, H=H, K=K)
    out, lse = jax.eval_shape(lambda: cuda.forward(q, kv, idx, sm_scale=0.1, splits=splits))
    assert (out.shape, out.dtype) == ((2, 3, H, 512), jnp.bfloat16)
    assert (lse.shape, lse.dtype) == ((2, 3, H), jnp.float32)
    out, lse = jax.eval_shape(lambda: cuda.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=512))
    assert out.shape == (2, 3, H, 512) and lse.shape == (2, 3, H)


def test_paged_shapes(no_library):
    q = jnp.zeros((4, 1, 64, cuda.DK), jnp.bfloat16)
    store = jnp.zeros((2, 8, 16, cuda.DK), jnp.bfloat16)
    table = jnp.zeros((4, 3), jnp.int32)
    idx = jnp.zeros((4, 1, 40), jnp.int32)
    out, lse = jax.eval_shape(lambda: cuda.paged_sparse_mla(q, store, table, idx, slot=1, sm_scale=0.1, v_dim=512))
    assert out.shape == (4, 1, 64, 512) and out.dtype == jnp.bfloat16 and lse.shape == (4, 1, 64)


def test_default_splits():
    assert cuda.default_splits(4096, 2048, 64) == 1          # prefill: the queries fill the GPU
    assert cuda.default_splits(64, 2048, 64) == 4            # decode, batch 64
    assert cuda.default_splits(128, 2048, 64) == 2
    assert cuda.default_splits(1, 40, 32) == 2               # never more splits than blocks


def test_merge_splits_matches_one_softmax():
    """Partials of a softmax over 3 splits (one split empty, one query with no valid slot) merged
    by lse equal the softmax over all the slots, in float64 numpy."""
    rng = np.random.default_rng(0)
    rows, heads, dv, per = 3, 2, 4, 5
    logits = rng.standard_normal((rows, heads, 3 * per))
    values = rng.standard_normal((rows, 3 * per, dv))
    valid = np.ones((rows, 3 * per), bool)
    valid[:, per:2 * per] = False          # split 1 empty for every query
    valid[2] = False                       # query 2: nothing valid
    outs, lses = [], []
    for s in range(3):
        sl = slice(s * per, (s + 1) * per)
        z = np.where(valid[:, None, sl], logits[:, :, sl], -np.inf)
        m = np.max(z, axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(z - m)
        l = p.sum(-1)
        outs.append(np.einsum("rhk,rkd->rhd", p, values[:, sl]) / np.where(l > 0, l, 1.0)[..., None])
        with np.errstate(divide="ignore"):
            lses.append(np.where(l > 0, m[..., 0] + np.log(np.where(l > 0, l, 1.0)), -np.inf))
    out, lse = cuda.merge_splits(jnp.asarray(np.stack(outs, 1), jnp.float32), jnp.asarray(np.stack(lses, 1),
                                                                                        jnp.float32), jnp.float32)
    z = np.where(valid[:2, None, :], logits[:2], -np.inf)
    full_lse = np.log(np.sum(np.exp(z), -1))
    full = np.einsum("rhk,rkd->rhd", np.exp(z - full_lse[..., None]), values[:2])
    np.testing.assert_allclose(np.asarray(out[:2]), full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse[:2]), full_lse, rtol=1e-5)
    assert np.all(np.asarray(out[2]) == 0) and np.all(np.asarray(lse[2]) == -np.inf)
