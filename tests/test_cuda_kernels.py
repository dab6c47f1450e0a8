"""The CUDA sparse MLA kernels (impl="cuda", pallas_kernels/sparse_mla/cuda.py) where no GPU is:
the build script's failure modes, the registry entries without the library, the Python side's
argument checks, shapes and split merge. The kernels themselves run in
benchmarks/sparse_mla_cuda.py on a GPU."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ml_dtypes
import pallas_kernels as pk
from pallas_kernels import fp8, registry
from pallas_kernels.sparse_mla import cuda, cuda_fp8

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
    assert len(kernels) == 16, result.stdout
    sm90 = [line for line in result.stdout.splitlines() if "sparse_mla_fwd_sm90_kernel<" in line]
    assert len(sm90) == 4, result.stdout                      # contiguous and paged, bf16 and f32 out
    # setmaxnreg moves registers from the launch's 168 a thread (consumer 1 gives 8 back with .dec)
    assert all("Used 168 registers" in line for line in sm90), result.stdout
    sm90 += [line for line in result.stdout.splitlines() if "sparse_mla_target_sm90_kernel" in line]
    assert len(sm90) == 5, result.stdout
    assert "forward sm90 (wgmma): 223288 bytes" in result.stdout, result.stdout
    fp8_kernels = [line for line in kernels if "true, true," in line]            # paged, FP8 rows
    assert sorted(line.split("<")[1].split(",")[:2] for line in fp8_kernels) == [["32", " 3"]] * 2 + [["32", " 4"]] * 2
    assert result.stdout.count("forward fp8 block_k=32") == 2, result.stdout
    bwd = [line for line in result.stdout.splitlines() if "sparse_mla_dq_kernel<" in line or "sparse_mla_dkv_kernel" in line]
    assert len(bwd) == 3, result.stdout
    assert all("0 bytes spill stores, 0 bytes spill loads" in line for line in kernels + sm90 + bwd), result.stdout
    assert (tmp_path / "libglm_sparse_mla.so").is_file()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (host code only: no GPU)")
def test_wgmma_forward_layouts_on_the_host(tmp_path):
    """tests/cuda/sm90_layout_check.cu, compiled for the host and run: every element the wgmma
    forward writes to shared memory (gathered rows, the P tile) is the one its wgmma operands
    read through their descriptors (the PTX canonical layouts of the 128-byte swizzle, modelled
    on the CPU), and its P registers are the A fragment of the accumulator's pairs."""
    exe = tmp_path / "sm90_layout_check"
    subprocess.run(["nvcc", "-std=c++17", f"-I{ROOT / 'pallas_kernels/sparse_mla/cuda'}", "-o", str(exe),
                    str(ROOT / "tests/cuda/sm90_layout_check.cu")], check=True, capture_output=True, timeout=300)
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout


# ----------------------------------------------------------------------------- registry


@pytest.mark.parametrize("op", ["sparse_mla", "paged_sparse_mla"])
def test_registry_entry(op, monkeypatch):
    entry = pk.REGISTRY[op]["cuda"]
    assert entry.platform == "gpu" and not entry.interpretable and not entry.auto
    assert entry.config is cuda.SparseMLACudaConfig
    monkeypatch.setattr(registry.jax, "default_backend", lambda: "gpu")
    assert pk.resolve_impl(op, "auto") == "pallas_gpu"


def test_import_on_cpu_registers_nothing():
    code = ("import jax, pallas_kernels; from pallas_kernels.sparse_mla import cuda; "
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
    assert cuda.SparseMLACudaConfig().backward == "cuda" and cuda.SparseMLACudaConfig().forward == "mma"
    for bad in (dict(block_k=48), dict(block_k=64, num_stages=3), dict(num_splits=0), dict(forward="tma"),
                dict(backward=pk.XlaConfig()), dict(backward="triton"), dict(pallas_backward=pk.XlaConfig())):
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
    config = cuda.SparseMLACudaConfig(num_splits=splits)
    out, lse = jax.eval_shape(lambda: cuda.forward(q, kv, idx, sm_scale=0.1, config=config))
    assert (out.shape, out.dtype) == ((2, 3, H, 512), jnp.bfloat16)
    assert (lse.shape, lse.dtype) == ((2, 3, H), jnp.float32)
    out, lse = jax.eval_shape(lambda: cuda.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=512))
    assert out.shape == (2, 3, H, 512) and lse.shape == (2, 3, H)


@pytest.mark.parametrize("paged", [False, True])
def test_wgmma_forward_calls_its_own_target_without_block_attributes(no_library, paged):
    """forward="wgmma" lowers to the sm90 FFI targets, which take sm_scale and splits only; the
    default stays on the mma.sync kernel."""
    q, kv, idx = _inputs(B=2, S=1, H=64, K=100)
    table = jnp.zeros((2, 2), jnp.int32)
    store = jnp.zeros((2, 2, 64, cuda.DK), jnp.bfloat16)

    def call(config):
        if paged:
            return cuda.paged_sparse_mla(q, store, table, idx, slot=1, sm_scale=0.1, v_dim=512, config=config)
        return cuda.forward(q, kv, idx, sm_scale=0.1, config=config)

    def lowered(config):
        return jax.jit(lambda: call(config)).trace().lower(lowering_platforms=("cuda",)).as_text()

    name = "glm_paged_sparse_mla_fwd" if paged else "glm_sparse_mla_fwd"
    text = lowered(cuda.SparseMLACudaConfig(forward="wgmma", num_splits=2))
    assert f"custom_call @{name}_sm90(" in text and "splits = 2 : i64" in text and "block_k" not in text
    text = lowered(cuda.SparseMLACudaConfig())
    assert f"custom_call @{name}(" in text and "block_k = 64 : i64" in text and "_sm90" not in text


def test_wgmma_forward_returns_the_indexer_target(no_library):
    """forward="wgmma" takes return_target: (out, lse, target [B, S, K]), the target from the
    sm90 target kernel's per-head-group sums (divided by H in XLA); the mma.sync kernel refuses it."""
    q, kv, idx = _inputs(B=2, S=3, H=128, K=100)
    config = cuda.SparseMLACudaConfig(forward="wgmma")
    out, lse, target = jax.eval_shape(lambda: cuda.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=512,
                                                              return_target=True, config=config))
    assert out.shape == (2, 3, 128, 512) and lse.shape == (2, 3, 128)
    assert (target.shape, target.dtype) == ((2, 3, 100), jnp.float32)
    text = jax.jit(lambda: cuda.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=512, return_target=True, config=config)
                   ).trace().lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @glm_sparse_mla_target_sm90(" in text and "tensor<6x2x100xf32>" in text
    with pytest.raises(ValueError, match="no indexer target"):
        cuda.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=512, return_target=True)


def test_paged_shapes(no_library):
    q = jnp.zeros((4, 1, 64, cuda.DK), jnp.bfloat16)
    store = jnp.zeros((2, 8, 16, cuda.DK), jnp.bfloat16)
    table = jnp.zeros((4, 3), jnp.int32)
    idx = jnp.zeros((4, 1, 40), jnp.int32)
    out, lse = jax.eval_shape(lambda: cuda.paged_sparse_mla(q, store, table, idx, slot=1, sm_scale=0.1, v_dim=512))
    assert out.shape == (4, 1, 64, 512) and out.dtype == jnp.bfloat16 and lse.shape == (4, 1, 64)


def test_default_splits():
    assert cuda.default_splits(4096, 2048, 64) == 1          # prefill: the queries fill the GPU
    assert cuda.default_splits(64, 2048, 64) == 2            # decode, batch 64: one wave of 132 SMs
    assert cuda.default_splits(128, 2048, 64) == 1
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


# ----------------------------------------------------------------------------- the CUDA backward


def _random_indices(rng, B, S, T, K):
    """int32 [B, S, K]: rows with replacement (duplicates), some -1 and some >= T."""
    idx = rng.integers(0, T, (B, S, K))
    idx = np.where(rng.random((B, S, K)) < 0.15, -1, idx)
    idx = np.where(rng.random((B, S, K)) < 0.05, T + 3, idx)
    return idx.astype(np.int32)


@pytest.mark.parametrize("B, S, T, K", [(1, 5, 70, 9), (2, 7, 64, 40), (2, 3, 100, 1)])
def test_key_index_lists_every_pair_once(B, S, T, K):
    """Per block of KEY_BLOCK rows: its units are the queries that selected one of its rows,
    ascending, and each unit's run holds the rows it selected (duplicates repeated) as numpy finds."""
    idx = _random_indices(np.random.default_rng(B * 100 + S), B, S, T, K)
    ki = cuda.key_index(jnp.asarray(idx), T)
    pair_row, unit_query, unit_start, block_units = (np.asarray(a) for a in
                                                     (ki.pair_row, ki.unit_query, ki.unit_start, ki.block_units))
    nblk = -(-T // cuda.KEY_BLOCK)
    assert pair_row.shape == (B * S * K,) and unit_start.shape == (B * S * K + 1,)
    assert block_units.shape == (B * nblk + 1,) and block_units[0] == 0
    n_valid = int(np.sum((idx >= 0) & (idx < T)))
    assert unit_start[block_units[-1]] == n_valid
    for b in range(B):
        for blk in range(nblk):
            units = range(block_units[b * nblk + blk], block_units[b * nblk + blk + 1])
            want = {}
            for s in range(S):
                sel = idx[b, s][(idx[b, s] >= blk * cuda.KEY_BLOCK) & (idx[b, s] < min(T, (blk + 1) * cuda.KEY_BLOCK))]
                if sel.size:
                    want[s] = sorted((sel % cuda.KEY_BLOCK).tolist())
            got = {int(unit_query[u]): sorted(pair_row[unit_start[u]:unit_start[u + 1]].tolist()) for u in units}
            assert [int(unit_query[u]) for u in units] == sorted(want)
            assert got == want


def _pair_terms(q, kv, idx, dout, lse, delta, scale):
    """float64 p [B, S, H, K], ds [B, S, H, K] of every pair (0 where the slot is invalid)."""
    T = kv.shape[1]
    valid = (idx >= 0) & (idx < T)
    rows = np.stack([kv[b][np.where(valid[b], idx[b], 0)] for b in range(kv.shape[0])])   # [B, S, K, Dk]
    logits = np.einsum("bshd,bskd->bshk", q, rows) * scale
    p = np.where(valid[:, :, None], np.exp(logits - lse[..., None]), 0.0)
    dp = np.einsum("bshv,bskv->bshk", dout, rows[..., :dout.shape[-1]])
    ds = p * (dp - delta[..., None])
    return p, ds, rows, valid


def test_dkv_walk_of_the_key_index_matches_the_pair_sum():
    """A float64 numpy model of the dkv kernel's walk (per block of 32 rows, per unit in order,
    per 32-head tile: counts from the unit's run, S^T / dP^T of the whole block, P'^T and dS'^T
    masked by count, dkv += dS'^T Q + P'^T dO) against the contract's sum over pairs; and the dq
    kernel's per-query sum. Duplicates, -1, out-of-range slots, T not a multiple of 32, B = 2."""
    rng = np.random.default_rng(3)
    B, S, H, T, K, dk, dv = 2, 6, 64, 70, 24, 16, 12     # narrow rows: the walk is what is modelled
    scale = 0.3
    q = rng.standard_normal((B, S, H, dk))
    kv = rng.standard_normal((B, T, dk))
    dout = rng.standard_normal((B, S, H, dv))
    idx = _random_indices(rng, B, S, T, K)
    idx[1, 2] = -1                                          # a query with no valid slot
    lse = rng.standard_normal((B, S, H)) + 3.0
    delta = rng.standard_normal((B, S, H))
    p, ds, rows, valid = _pair_terms(q, kv, idx, dout, lse, delta, scale)
    want = np.zeros((B, T, dk))
    want_dq = np.einsum("bshk,bskd->bshd", ds, rows) * scale
    for b in range(B):
        for s in range(S):
            for j in range(K):
                if valid[b, s, j]:
                    t = idx[b, s, j]
                    want[b, t] += scale * ds[b, s, :, j] @ q[b, s]
                    want[b, t, :dv] += p[b, s, :, j] @ dout[b, s]

    ki = cuda.key_index(jnp.asarray(idx), T)
    pair_row, unit_query, unit_start, block_units = (np.asarray(a) for a in
                                                     (ki.pair_row, ki.unit_query, ki.unit_start, ki.block_units))
    R, HT = cuda.KEY_BLOCK, 32
    nblk = -(-T // R)
    got = np.zeros((B, T, dk))
    for blk in range(B * nblk):
        b, t0 = divmod(blk, nblk)
        t0 *= R
        kblock = np.zeros((R, dk))
        n = min(R, T - t0)
        kblock[:n] = kv[b, t0:t0 + n]
        acc = np.zeros((R, dk))
        u0, u1 = block_units[blk], block_units[blk + 1]
        for item in range((u1 - u0) * (H // HT)):
            u = u0 + item // (H // HT)
            h0 = (item % (H // HT)) * HT
            s = unit_query[u]
            count = np.array([np.sum(pair_row[unit_start[u]:unit_start[u + 1]] == r) for r in range(R)], float)
            qt, dot = q[b, s, h0:h0 + HT], dout[b, s, h0:h0 + HT]
            st = kblock @ qt.T                               # [R, 32]
            dpt = kblock[:, :dv] @ dot.T
            pe = np.exp(st * scale - lse[b, s, h0:h0 + HT][None])
            ok = count[:, None] > 0
            pt = np.where(ok, count[:, None] * pe, 0.0)
            dst = np.where(ok, count[:, None] * scale * pe * (dpt - delta[b, s, h0:h0 + HT][None]), 0.0)
            acc += dst @ qt
            acc[:, :dv] += pt @ dot
        got[b, t0:t0 + n] = acc[:n]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    assert np.all(want_dq[1, 2] == 0)


@pytest.mark.parametrize("H, K", [(64, 8), (128, 100)])
def test_backward_shapes(no_library, H, K):
    """Gradients through impl='cuda' trace with the CUDA backward (the library not needed for
    shapes): dq like q, dkv like kv; the pallas_gpu backward still traces too."""
    q, kv, idx = _inputs(B=2, S=3, H=H, K=K)

    def loss(q, kv, config):
        out, lse = cuda.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=512, config=config)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    for config in (cuda.SparseMLACudaConfig(), cuda.SparseMLACudaConfig(backward="pallas_gpu")):
        dq, dkv = jax.eval_shape(jax.grad(functools.partial(loss, config=config), argnums=(0, 1)), q, kv)
        assert (dq.shape, dq.dtype) == (q.shape, q.dtype) and (dkv.shape, dkv.dtype) == (kv.shape, kv.dtype)
    dq, dkv = jax.eval_shape(lambda: cuda.backward(
        q, kv, idx, jnp.zeros((2, 3, H, 512), jnp.bfloat16), jnp.zeros((2, 3, H)), jnp.zeros((2, 3, H)),
        sm_scale=0.1, dq_dtype=jnp.float32))
    assert (dq.shape, dq.dtype) == ((2, 3, H, 576), jnp.float32) and (dkv.shape, dkv.dtype) == ((2, 16, 576),
                                                                                              jnp.float32)


def test_backward_index_follows_the_config():
    idx = jnp.zeros((1, 4, 8), jnp.int32)
    ki = cuda.backward_index(idx, 16, dk=576, dtype=jnp.bfloat16)
    assert isinstance(ki, cuda.KeyIndex) and ki.num_keys == 16
    other = cuda.backward_index(idx, 16, dk=576, dtype=jnp.bfloat16,
                                config=cuda.SparseMLACudaConfig(backward="pallas_gpu"))
    assert not isinstance(other, cuda.KeyIndex)
    entry = pk.REGISTRY["sparse_mla"]["cuda"]
    assert isinstance(entry.backward_index(idx, 16, dk=576, dtype=jnp.bfloat16, config=cuda.SparseMLACudaConfig()),
                      cuda.KeyIndex)


def test_key_index_built_for_other_indices_is_refused(no_library):
    q, kv, idx = _inputs(T=16, K=8)
    wrong = cuda.key_index(jnp.zeros((1, 2, 8), jnp.int32), 32)
    with pytest.raises(ValueError, match="key index was built for"):
        jax.eval_shape(lambda: cuda.sparse_mla(q, kv, idx, sm_scale=0.1, v_dim=512, tindex=wrong))
    with pytest.raises(ValueError, match="v_dim must be 512"):
        cuda.backward(q, kv, idx, None, None, None, sm_scale=0.1, v_dim=128)
    lse = jnp.zeros(q.shape[:-1])
    with pytest.raises(ValueError, match="dout must be"):
        cuda.backward(q, kv, idx, jnp.zeros(q.shape[:-1] + (256,), jnp.bfloat16), lse, lse, sm_scale=0.1)
    with pytest.raises(ValueError, match="a multiple of 64 heads.*use impl='pallas_gpu'"):
        q32 = q[:, :, :32]
        cuda.backward(q32, kv, idx, jnp.zeros(q32.shape[:-1] + (512,), jnp.bfloat16), lse[..., :32],
                      lse[..., :32], sm_scale=0.1)


# ----------------------------------------------------------------------------- a warp-level model of the backward kernels
# The dq and dkv kernels' index arithmetic (swizzle, ldmatrix addresses, mma fragments, roles of
# the warps) replayed in numpy under the PTX semantics of ldmatrix.m8n8.x4 (plain and .trans) and
# mma.m16n8k16 (row.col), one CTA each, with bf16 rounding where the kernels round.

_LANES = np.arange(32)
_G, _C = _LANES // 4, _LANES % 4


def _bf16(x):
    return np.asarray(jnp.asarray(np.asarray(x, np.float32), jnp.bfloat16).astype(jnp.float32), np.float64)


def _swz(r, c, row_bytes=1152):
    return r * row_bytes + ((c ^ (r & 7)) << 4)


def _put_tile(smem, base, tile, row_bytes):
    """Writes a [rows, width] tile at byte `base` with the kernels' swizzle (16-byte chunks)."""
    for r in range(tile.shape[0]):
        for ch in range(tile.shape[1] // 8):
            at = (base + _swz(r, ch, row_bytes)) // 2
            smem[at:at + 8] = tile[r, ch * 8:ch * 8 + 8]


def _ldsm(smem, addrs, trans=False):
    """ldmatrix.x4: addrs [32] byte addresses (lane 8 j + i: row i of matrix j) -> [32, 4, 2]."""
    out = np.zeros((32, 4, 2))
    for j in range(4):
        rows = addrs[8 * j:8 * j + 8] // 2
        if trans:
            for e in range(2):
                out[:, j, e] = smem[rows[2 * _C + e] + _G]
        else:
            for e in range(2):
                out[:, j, e] = smem[rows[_G] + 2 * _C + e]
    return out


def _mma(c, a, b0, b1):
    """c [32, 4] += A B with A from a [32, 4, 2], B from b0, b1 [32, 2] (m16n8k16 fragments)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for e in range(2):
        A[_G, 2 * _C + e] = a[:, 0, e]
        A[_G + 8, 2 * _C + e] = a[:, 1, e]
        A[_G, 2 * _C + 8 + e] = a[:, 2, e]
        A[_G + 8, 2 * _C + 8 + e] = a[:, 3, e]
        B[2 * _C + e, _G] = b0[:, e]
        B[2 * _C + 8 + e, _G] = b1[:, e]
    D = A @ B
    for e in range(2):
        c[:, e] += D[_G, 2 * _C + e]
        c[:, 2 + e] += D[_G + 8, 2 * _C + e]


def _model_inputs(seed, S, T, K, heads=64):
    rng = np.random.default_rng(seed)
    q = _bf16(rng.standard_normal((S, heads, 576)))
    kv = _bf16(rng.standard_normal((T, 576)))
    dout = _bf16(rng.standard_normal((S, heads, 512)))
    idx = rng.integers(0, T, (S, K))
    idx[:, 1] = idx[:, 0]                                       # duplicates
    idx = np.where(rng.random((S, K)) < 0.15, -1, idx)
    idx[0, 2] = T + 1                                           # out of range
    scale = 576 ** -0.5
    lse = np.zeros((S, heads))
    for s in range(S):
        sel = idx[s][(idx[s] >= 0) & (idx[s] < T)]
        z = q[s] @ kv[sel].T * scale
        lse[s] = np.log(np.exp(z).sum(-1))
    delta = rng.standard_normal((S, heads)) * 0.1
    return q, kv, dout, idx.astype(np.int32), lse, delta, scale


def _oracle_pairs(q, kv, dout, idx, lse, delta, scale):
    S, heads, _ = q.shape
    T = kv.shape[0]
    dq = np.zeros_like(q)
    dkv = np.zeros_like(kv)
    for s in range(S):
        sel = idx[s][(idx[s] >= 0) & (idx[s] < T)]
        p = np.exp(q[s] @ kv[sel].T * scale - lse[s][:, None])
        ds = p * (dout[s] @ kv[sel, :512].T - delta[s][:, None])
        dq[s] = scale * ds @ kv[sel]
        g = scale * ds.T @ q[s]
        g[:, :512] += p.T @ dout[s]
        np.add.at(dkv, sel, g)
    return dq, dkv


def test_warp_model_of_the_dq_kernel():
    """One dq CTA (query 1, 64 heads, K = 40: a full block of 32 and a padded one) replayed warp by
    warp as sparse_mla_bwd_dq.cu computes it, against the float64 contract."""
    S, T, K = 2, 90, 40
    q, kv, dout, idx, lse, delta, scale = _model_inputs(1, S, T, K)
    want, _ = _oracle_pairs(q, kv, dout, idx, lse, delta, scale)
    row, BK, DS_STRIDE = 1, 32, 40
    kQ, kDo = 0, 64 * 1152
    kKV = kDo + 64 * 1024
    kDs = kKV + 2 * BK * 1152
    smem = np.zeros((kDs + 64 * DS_STRIDE * 2) // 2)
    _put_tile(smem, kQ, q[row], 1152)
    _put_tile(smem, kDo, dout[row], 1024)
    l2 = lse[row] * np.log2(np.e)
    acc = np.zeros((8, 2, 18, 32, 4))
    for j in range(-(-K // BK)):
        stage = j % 2
        ks = np.zeros((BK, 576))
        valid = np.zeros(BK, bool)
        for r in range(BK):
            k = j * BK + r
            t = idx[row, k] if k < K else -1
            valid[r] = 0 <= t < T
            if valid[r]:
                ks[r] = kv[t]
        s_k = kKV + stage * BK * 1152
        _put_tile(smem, s_k, ks, 1152)
        for w in range(8):                      # S / dP phase
            s_mt, col0 = w & 3, (w >> 2) * 16
            s = np.zeros((2, 32, 4))
            dp = np.zeros((2, 32, 4))
            a_row = s_mt * 16 + (_LANES & 15)
            a_ch = _LANES >> 4
            b_row = col0 + ((_LANES >> 4) << 3) + (_LANES & 7)
            b_ch = (_LANES >> 3) & 1
            for kk in range(36):
                a = _ldsm(smem, kQ + _swz(a_row, kk * 2 + a_ch))
                bf = _ldsm(smem, s_k + _swz(b_row, kk * 2 + b_ch))
                _mma(s[0], a, bf[:, 0], bf[:, 1])
                _mma(s[1], a, bf[:, 2], bf[:, 3])
            for kk in range(32):
                a = _ldsm(smem, kDo + _swz(a_row, kk * 2 + a_ch, 1024))
                bf = _ldsm(smem, s_k + _swz(b_row, kk * 2 + b_ch))
                _mma(dp[0], a, bf[:, 0], bf[:, 1])
                _mma(dp[1], a, bf[:, 2], bf[:, 3])
            h_lo = s_mt * 16 + (_LANES >> 2)
            for nt in range(2):
                col = col0 + nt * 8 + (_LANES & 3) * 2
                for i in range(2):
                    h = h_lo + 8 * i
                    for e in range(2):
                        ok = valid[col + e]
                        pv = np.where(ok, np.exp2(s[nt, :, 2 * i + e] * scale * np.log2(np.e) - l2[h]), 0.0)
                        ds = np.where(ok, pv * (dp[nt, :, 2 * i + e] - delta[row, h]), 0.0)
                        smem[(kDs + (h * DS_STRIDE + col + e) * 2) // 2] = _bf16(ds)
        for w in range(8):                      # dq phase
            dq_hh, dq_cg = w & 1, w >> 1
            v_row = ((_LANES >> 3) & 1) * 8 + (_LANES & 7)
            v_ch = dq_cg * 18 + (_LANES >> 4)
            for kk in range(BK // 16):
                a = [_ldsm(smem, kDs + ((dq_hh * 32 + mt * 16 + (_LANES & 15)) * DS_STRIDE + kk * 16
                                        + (_LANES >> 4) * 8) * 2) for mt in range(2)]
                for np_ in range(9):
                    bf = _ldsm(smem, s_k + _swz(kk * 16 + v_row, v_ch + np_ * 2), trans=True)
                    for mt in range(2):
                        _mma(acc[w, mt, 2 * np_], a[mt], bf[:, 0], bf[:, 1])
                        _mma(acc[w, mt, 2 * np_ + 1], a[mt], bf[:, 2], bf[:, 3])
    got = np.zeros((64, 576))
    for w in range(8):
        dq_hh, dq_cg = w & 1, w >> 1
        for mt in range(2):
            for i in range(2):
                h = dq_hh * 32 + mt * 16 + (_LANES >> 2) + 8 * i
                for nt in range(18):
                    col = dq_cg * 144 + nt * 8 + (_LANES & 3) * 2
                    got[h, col] = acc[w, mt, nt, :, 2 * i] * scale
                    got[h, col + 1] = acc[w, mt, nt, :, 2 * i + 1] * scale
    err = np.linalg.norm(got - want[row]) / np.linalg.norm(want[row])
    assert err < 1e-2, err


def test_warp_model_of_the_dkv_kernel():
    """One dkv CTA (block 1 of 32 rows, T = 50: rows past T) walking its units of the key index
    as sparse_mla_bwd_dkv.cu does, warp by warp, against the float64 contract."""
    S, T, K = 4, 50, 24
    q, kv, dout, idx, lse, delta, scale = _model_inputs(2, S, T, K)
    _, want = _oracle_pairs(q, kv, dout, idx, lse, delta, scale)
    ki = cuda.key_index(jnp.asarray(idx[None]), T)
    pair_row, unit_query, unit_start, block_units = (np.asarray(a) for a in
                                                     (ki.pair_row, ki.unit_query, ki.unit_start, ki.block_units))
    blk, R, HT, TS = 1, 32, 32, 40
    t0 = blk * R
    kK, kSt = 0, R * 1152
    st_bytes = HT * 1152 + HT * 1024 + 3 * 128
    kPt = kSt + 2 * st_bytes
    kDst = kPt + R * TS * 2
    smem = np.zeros((kDst + R * TS * 2) // 2)
    kb = np.zeros((R, 576))
    kb[:T - t0] = kv[t0:T]
    _put_tile(smem, kK, kb, 1152)
    u0 = block_units[blk]
    n_items = (block_units[blk + 1] - u0) * 2
    assert n_items >= 4
    acc = np.zeros((8, 18, 32, 4))
    for it in range(n_items):
        stage = it % 2
        u = u0 + it // 2
        h0 = (it % 2) * HT
        s_q = unit_query[u]
        st = kSt + stage * st_bytes
        _put_tile(smem, st, q[s_q, h0:h0 + HT], 1152)
        _put_tile(smem, st + HT * 1152, dout[s_q, h0:h0 + HT], 1024)
        lse_t, delta_t = lse[s_q, h0:h0 + HT], delta[s_q, h0:h0 + HT]
        count = np.array([np.sum(pair_row[unit_start[u]:unit_start[u + 1]] == r) for r in range(R)], float)
        red = np.zeros((2, 4, R, HT))                 # f32 partials [S, dP][quarter][row][head]
        for w in range(8):                      # S^T / dP^T phase: a quarter of k per warp
            s_mt, s_kq = w & 1, w >> 1
            s = np.zeros((4, 32, 4))
            dp = np.zeros((4, 32, 4))
            a_row = s_mt * 16 + (_LANES & 15)
            a_ch = _LANES >> 4
            b_row = ((_LANES >> 4) << 3) + (_LANES & 7)
            b_ch = (_LANES >> 3) & 1
            for kk in range(9):
                ks = s_kq * 9 + kk
                a = _ldsm(smem, kK + _swz(a_row, ks * 2 + a_ch))
                for np_ in range(2):
                    bf = _ldsm(smem, st + _swz(b_row + np_ * 16, ks * 2 + b_ch))
                    _mma(s[2 * np_], a, bf[:, 0], bf[:, 1])
                    _mma(s[2 * np_ + 1], a, bf[:, 2], bf[:, 3])
            for kk in range(8):
                ks = s_kq * 8 + kk
                a = _ldsm(smem, kK + _swz(a_row, ks * 2 + a_ch))
                for np_ in range(2):
                    bf = _ldsm(smem, st + HT * 1152 + _swz(b_row + np_ * 16, ks * 2 + b_ch, 1024))
                    _mma(dp[2 * np_], a, bf[:, 0], bf[:, 1])
                    _mma(dp[2 * np_ + 1], a, bf[:, 2], bf[:, 3])
            for nt in range(4):
                for i in range(2):
                    r = s_mt * 16 + (_LANES >> 2) + 8 * i
                    for e in range(2):
                        h = nt * 8 + (_LANES & 3) * 2 + e
                        red[0, s_kq, r, h] = s[nt, :, 2 * i + e]
                        red[1, s_kq, r, h] = dp[nt, :, 2 * i + e]
        for tid in range(256):                  # the quarters summed, P'^T and dS'^T
            r, h4 = tid >> 3, (tid & 7) * 4
            for e in range(4):
                sv = red[0, :, r, h4 + e].sum()
                dv = red[1, :, r, h4 + e].sum()
                ok = count[r] > 0
                pe = np.exp2(sv * scale * np.log2(np.e) - lse_t[h4 + e] * np.log2(np.e)) if ok else 0.0
                pv = count[r] * pe if ok else 0.0
                dsv = count[r] * scale * pe * (dv - delta_t[h4 + e]) if ok else 0.0
                smem[(kPt + (r * TS + h4 + e) * 2) // 2] = _bf16(pv)
                smem[(kDst + (r * TS + h4 + e) * 2) // 2] = _bf16(dsv)
        for w in range(8):                      # dkv phase
            d_mt, d_cg = w & 1, w >> 1
            v_row = ((_LANES >> 3) & 1) * 8 + (_LANES & 7)
            v_ch = d_cg * 18 + (_LANES >> 4)
            for kk in range(HT // 16):
                off = ((d_mt * 16 + (_LANES & 15)) * TS + kk * 16 + (_LANES >> 4) * 8) * 2
                a_ds = _ldsm(smem, kDst + off)
                a_p = _ldsm(smem, kPt + off)
                for np_ in range(9):
                    bf = _ldsm(smem, st + _swz(kk * 16 + v_row, v_ch + np_ * 2), trans=True)
                    _mma(acc[w, 2 * np_], a_ds, bf[:, 0], bf[:, 1])
                    _mma(acc[w, 2 * np_ + 1], a_ds, bf[:, 2], bf[:, 3])
                    if d_cg * 18 + np_ * 2 < 64:
                        bf = _ldsm(smem, st + HT * 1152 + _swz(kk * 16 + v_row, v_ch + np_ * 2, 1024), trans=True)
                        _mma(acc[w, 2 * np_], a_p, bf[:, 0], bf[:, 1])
                        _mma(acc[w, 2 * np_ + 1], a_p, bf[:, 2], bf[:, 3])
    got = np.zeros((R, 576))
    for w in range(8):
        d_mt, d_cg = w & 1, w >> 1
        for i in range(2):
            r = d_mt * 16 + (_LANES >> 2) + 8 * i
            for nt in range(18):
                col = d_cg * 144 + nt * 8 + (_LANES & 3) * 2
                got[r, col] = acc[w, nt, :, 2 * i]
                got[r, col + 1] = acc[w, nt, :, 2 * i + 1]
    ref = want[t0:T]
    assert np.all(got[T - t0:] == 0)
    err = np.linalg.norm(got[:T - t0] - ref) / np.linalg.norm(ref)
    assert err < 1e-2, err


# ----------------------------------------------------------------------------- FP8 pages


def _fp8_store(lead=(2, 8, 16), seed=0, kv_lora=512, rope=64):
    rows = jax.random.normal(jax.random.key(seed), lead + (kv_lora + rope,), jnp.float32) * 3
    return fp8.quantize_latent(rows, kv_lora)


def test_cuda_reads_fp8_pages(monkeypatch):
    assert "cuda" in pk.FP8_IMPLS["paged_sparse_mla"]
    assert pk._store_impl("paged_sparse_mla", _fp8_store(), "cuda") == "cuda"
    monkeypatch.setattr(registry.jax, "default_backend", lambda: "gpu")
    assert pk._store_impl("paged_sparse_mla", _fp8_store(), "auto") == "auto"      # auto: pallas_gpu reads them


def test_fp8_block_stages():
    assert cuda_fp8.block_stages(32, 3) == (32, 3) and cuda_fp8.block_stages(32, 4) == (32, 4)
    assert cuda_fp8.block_stages(64, 2) == (32, 4)                                  # the default config


def test_fp8_paged_shapes(no_library):
    q = jnp.zeros((4, 1, 128, cuda.DK), jnp.bfloat16)
    table = jnp.zeros((4, 3), jnp.int32)
    idx = jnp.zeros((4, 1, 40), jnp.int32)
    for config in (cuda.SparseMLACudaConfig(), cuda.SparseMLACudaConfig(block_k=32, num_stages=3, num_splits=2)):
        out, lse = jax.eval_shape(lambda config=config: cuda.paged_sparse_mla(
            q, _fp8_store(), table, idx, slot=1, sm_scale=0.1, v_dim=512, config=config))
        assert (out.shape, out.dtype, lse.shape) == ((4, 1, 128, 512), jnp.bfloat16, (4, 1, 128))


@pytest.mark.parametrize("q_shape, dtype, store_widths, v_dim, match", [
    ((2, 1, 32, 576), jnp.bfloat16, (512, 64), 512, "a multiple of 64 heads"),
    ((2, 1, 64, 576), jnp.float32, (512, 64), 512, "bf16 q"),
    ((2, 1, 64, 576), jnp.bfloat16, (512, 64), 256, "v_dim = 512"),
    ((2, 1, 64, 576), jnp.bfloat16, (384, 192), 512, "FP8 rows of 512 e4m3 values"),
    ((2, 1, 64, 544), jnp.bfloat16, (512, 64), 512, "Dk = 576"),
])
def test_fp8_unsupported_calls_name_the_fallback(q_shape, dtype, store_widths, v_dim, match):
    q = jnp.zeros(q_shape, dtype)
    with pytest.raises(ValueError, match=match + ".*use impl='pallas_gpu'") as info:
        cuda.paged_sparse_mla(q, _fp8_store((2, 4, 16), kv_lora=store_widths[0], rope=store_widths[1]),
                              jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 1, 8), jnp.int32), slot=0, sm_scale=0.1,
                              v_dim=v_dim)
    assert "\n" not in str(info.value)


def test_fp8_missing_library_names_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda.LIB_ENV, str(tmp_path / "missing.so"))
    monkeypatch.setattr(cuda, "_registered", False)
    q = jnp.zeros((2, 1, 64, 576), jnp.bfloat16)
    with pytest.raises(RuntimeError, match=r"not built: run scripts/build_cuda_kernels.sh") as info:
        jax.eval_shape(lambda: cuda.paged_sparse_mla(q, _fp8_store(), jnp.zeros((2, 3), jnp.int32),
                                                     jnp.zeros((2, 1, 8), jnp.int32), slot=0, sm_scale=0.1, v_dim=512))
    assert "\n" not in str(info.value)


# sparse_mla_fp8.cuh's layout
_FP8_CHUNKS, _FP8_ROW, _SCALE_AT, _ROPE_AT = 41, 656, 512, 528


def _gather_model(values, scales, rope, valid):
    """gather_fp8_row<8> for rows [R]: thread sub of a row copies chunks sub, sub + 8, ... < 41
    from the field the chunk falls in (0..31 values, 32 scales, 33..40 rope), zero-filled where
    !valid -> the staged bytes uint8 [R, 656] and how often each chunk was written."""
    fields = [np.asarray(x).view(np.uint8).reshape(len(valid), -1) for x in (values, scales, rope)]
    staged = np.full((len(valid), _FP8_ROW), 0xAB, np.uint8)                       # stale bytes
    writes = np.zeros((len(valid), _FP8_CHUNKS), int)
    for r, ok in enumerate(valid):
        for sub in range(8):
            for ch in range(sub, _FP8_CHUNKS, 8):
                field, at = (0, ch * 16) if ch < 32 else (1, 0) if ch == 32 else (2, (ch - 33) * 16)
                staged[r, ch * 16:ch * 16 + 16] = fields[field][r, at:at + 16] if ok else 0
                writes[r, ch] += 1
    return staged, writes


def _dequantize_model(staged):
    """dequantize_rows over staged uint8 [32, 656] -> the swizzled bf16 tile's bytes [32 * 1152]:
    thread (r, sub) reads the row's 4 scales (one float4) and value chunks sub + 8 i as four
    uint32 words; each 16-bit half is an e4m3 pair (low byte first) -> f16 -> f32, times
    scale[i], rounded to bf16 (nearest even); chunk 2 vc / 2 vc + 1 of the tile at swizzle(r, .);
    rope chunk sub copied to chunk 64 + sub."""
    tile = np.zeros(32 * 1152, np.uint8)
    for tid in range(256):
        r, sub = tid >> 3, tid & 7
        row = staged[r]
        scale = row[_SCALE_AT:_SCALE_AT + 16].view(np.float32)
        for i in range(4):
            vc = sub + 8 * i
            words = row[vc * 16:vc * 16 + 16].view(np.uint32)
            out = []
            for w in words:
                for pair in (int(w) & 0xFFFF, int(w) >> 16):
                    two = np.array([pair & 0xFF, pair >> 8], np.uint8).view(ml_dtypes.float8_e4m3fn)
                    f = two.astype(np.float16).astype(np.float32) * scale[i]
                    out.append(f.astype(ml_dtypes.bfloat16))
            out = np.concatenate(out).view(np.uint8)                                # 16 bf16 = 32 bytes
            tile[_swz(r, 2 * vc):_swz(r, 2 * vc) + 16] = out[:16]
            tile[_swz(r, 2 * vc + 1):_swz(r, 2 * vc + 1) + 16] = out[16:]
        tile[_swz(r, 64 + sub):_swz(r, 64 + sub) + 16] = row[_ROPE_AT + sub * 16:_ROPE_AT + sub * 16 + 16]
    return tile


def test_dequantize_model_matches_fp8_dequantize():
    """The kernel's gather and dequantize step, replayed on 32 rows (6 invalid) of a quantized
    store, read back through the swizzle: bitwise fp8.dequantize rounded to bf16, zero rows
    where invalid; every staged chunk written exactly once."""
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((32, 576)).astype(np.float32) * rng.choice([1e-3, 1.0, 40.0], (32, 1))
    rows[3, :128] = 0                                                               # a zero group: scale 0
    store = fp8.quantize_latent(jnp.asarray(rows), 512)
    valid = rng.random(32) > 0.2
    staged, writes = _gather_model(store.values, store.scales, store.rope, valid)
    assert np.all(writes == 1)
    tile = _dequantize_model(staged)
    got = np.stack([np.concatenate([tile[_swz(r, c):_swz(r, c) + 16] for c in range(72)]) for r in range(32)])
    got = got.view(ml_dtypes.bfloat16).astype(np.float32)
    want = np.asarray(fp8.dequantize(store).astype(jnp.bfloat16).astype(jnp.float32))
    want = np.where(valid[:, None], want, 0.0)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
