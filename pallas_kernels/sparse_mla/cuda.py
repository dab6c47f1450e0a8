"""Sparse MLA in hand-written CUDA C++ (pallas_kernels/sparse_mla/cuda/*.cu), called through the
XLA FFI (`jax.ffi.ffi_call`): the forward, and under the shared differentiation rule
(`vjp.make_index_sparse_mla`) a CUDA backward (`SparseMLACudaConfig.backward="cuda"`, the
default: a dq kernel per query and a deterministic dkv kernel per block of latent rows walking
a key index, `key_index`) or the Pallas GPU one (`backward="pallas_gpu"`, `gpu_backward`).

The kernels are built by `scripts/build_cuda_kernels.sh` into build/cuda/libglm_sparse_mla.so
(or the file GLM_CUDA_KERNELS_LIB names). Nothing happens at import: the library is loaded and
its FFI targets registered (platform "CUDA") the first time an op is traced, so the module
imports on a CPU-only machine and registers nothing there.

Supported: bf16 q and kv (paged: also FP8 pages, `fp8.Fp8Latent`, read by `cuda_fp8`'s
kernel), Dk = 576, v_dim = 512, heads a multiple of 64 (one CTA per 64 heads; H = 128 runs two),
any K (slots past K, -1 and out-of-range indices are skipped), the indexer target only with
forward="wgmma" (`target`). Anything else raises a ValueError naming impl="pallas_gpu" as the
one to use.
Design and status: docs/kernels-sparse-mla.md, "CUDA implementation".
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fp8
from pallas_kernels.sparse_mla import cuda_fp8, gpu, gpu_backward, transpose, vjp

#: The command that builds the library.
BUILD_COMMAND = "scripts/build_cuda_kernels.sh"
#: Environment variable naming the library file, overriding the default path.
LIB_ENV = "GLM_CUDA_KERNELS_LIB"
#: The library's default place: build/cuda/ at the repository root.
DEFAULT_LIB = Path(__file__).resolve().parents[2] / "build" / "cuda" / "libglm_sparse_mla.so"
#: The FFI targets (the handler symbols of the library under these names).
TARGETS = {"glm_sparse_mla_fwd": "GlmSparseMlaFwd", "glm_paged_sparse_mla_fwd": "GlmPagedSparseMlaFwd",
           "glm_sparse_mla_fwd_sm90": "GlmSparseMlaFwdSm90",
           "glm_paged_sparse_mla_fwd_sm90": "GlmPagedSparseMlaFwdSm90",
           "glm_sparse_mla_target_sm90": "GlmSparseMlaTargetSm90",
           "glm_sparse_mla_dq": "GlmSparseMlaDq", "glm_sparse_mla_dkv": "GlmSparseMlaDkv",
           cuda_fp8.TARGET: "GlmPagedSparseMlaFp8Fwd"}
#: The forward kernels over bf16 rows `SparseMLACudaConfig.forward` takes: "mma" (mma.sync fed by
#: ldmatrix, sparse_mla_fwd.cu) and "wgmma" (Hopper warpgroup MMAs, a producer warpgroup and two
#: consumers, sparse_mla_fwd_sm90.cu: sm_90 only, rows in blocks of 64; with it also the indexer
#: target, `target`).
FORWARDS = ("mma", "wgmma")

#: The shapes the kernels take.
DK, DV, HEAD_TILE = 576, 512, 64
#: (block_k, stages) pairs compiled into the library; the first is the default.
BLOCK_STAGES = ((64, 2), (32, 4), (32, 3))
#: Latent rows per CTA of the CUDA dkv kernel (kKvRows in sparse_mla_bwd_dkv.cu) and so per block
#: of the key index.
KEY_BLOCK = 32
#: The backward implementations `SparseMLACudaConfig.backward` takes.
BACKWARDS = ("cuda", "pallas_gpu")
#: CTAs the K splits aim for when the queries are few: one wave of an H100's 132 SMs (one CTA an
#: SM). Measured at 128K context, K 2048, 64 heads: one wave beat two at batch 64 (2 splits, 112
#: against 128 us) and 128 (1 split, 186 against 212 us): the f32 partials and their merge cost
#: more than the second wave's tail saves.
TARGET_CTAS = 132

_lock = threading.Lock()
_registered = False


def library_path() -> Path:
    return Path(os.environ.get(LIB_ENV) or DEFAULT_LIB)


def available() -> bool:
    """Whether the library file exists (it is not loaded)."""
    return library_path().is_file()


def ensure_registered() -> None:
    """Loads the library and registers its FFI targets for CUDA, once. RuntimeError with the
    build command where the library is missing or lacks a target."""
    global _registered
    with _lock:
        if _registered:
            return
        path = library_path()
        if not path.is_file():
            raise RuntimeError(f"pallas_kernels: impl='cuda' needs the CUDA kernel library {path}, which is not "
                               f"built: run {BUILD_COMMAND} (nvcc and the CUDA toolkit needed)")
        try:
            lib = ctypes.cdll.LoadLibrary(str(path))
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
        except (OSError, AttributeError) as e:
            raise RuntimeError(f"pallas_kernels: impl='cuda' could not load {path} ({e}); rebuild it with "
                               f"{BUILD_COMMAND}") from e
        _registered = True


@dataclasses.dataclass(frozen=True)
class SparseMLACudaConfig:
    """Tuning of the CUDA sparse MLA (`impl="cuda"`).

    block_k, num_stages: rows per shared-memory buffer and buffers in the ring: (64, 2), (32, 4)
      or (32, 3) (the instantiations compiled; num_stages None: 2 for 64, 4 for 32). FP8 pages
      run (32, 4) where block_k is 64 (`cuda_fp8.block_stages`).
    num_splits: CTAs per query and head group over the K slots (partials merged by lse);
      None: 1 when the queries fill the GPU, else enough to reach about TARGET_CTAS.
    forward: the kernel over bf16 rows, "mma" or "wgmma" (`FORWARDS`; wgmma ignores block_k and
      num_stages: blocks of 64 rows, two buffers). FP8 pages take their own kernel either way.
    backward: "cuda" (the CUDA dq and dkv kernels, `backward`; its index is `key_index`) or
      "pallas_gpu" (the Pallas GPU backward, `gpu_backward`, with pallas_backward's knobs).
    pallas_backward: the Pallas GPU backward's knobs (`SparseMLAGpuConfig`; its forward fields
      are unused), for backward="pallas_gpu"."""

    block_k: int = 64
    num_stages: int | None = None
    num_splits: int | None = None
    forward: str = "mma"
    backward: str = "cuda"
    pallas_backward: gpu.SparseMLAGpuConfig = gpu.SparseMLAGpuConfig()

    def __post_init__(self):
        name = type(self).__name__
        if (self.block_k, self.stages) not in BLOCK_STAGES:
            raise ValueError(f"{name}: (block_k, num_stages) must be one of {BLOCK_STAGES}, got "
                             f"({self.block_k!r}, {self.num_stages!r})")
        if self.num_splits is not None and (isinstance(self.num_splits, bool) or not isinstance(self.num_splits, int)
                                            or self.num_splits < 1):
            raise ValueError(f"{name}.num_splits must be a positive int or None, got {self.num_splits!r}")
        if not isinstance(self.forward, str) or self.forward not in FORWARDS:
            raise ValueError(f"{name}.forward must be one of {FORWARDS}, got {self.forward!r}")
        if not isinstance(self.backward, str) or self.backward not in BACKWARDS:
            raise ValueError(f"{name}.backward must be one of {BACKWARDS}, got {self.backward!r}")
        if not isinstance(self.pallas_backward, gpu.SparseMLAGpuConfig):
            raise ValueError(f"{name}.pallas_backward must be a SparseMLAGpuConfig, got "
                             f"{type(self.pallas_backward).__name__}")

    @property
    def stages(self) -> int:
        return self.num_stages if self.num_stages is not None else (2 if self.block_k == 64 else 4)


def check_supported(op: str, q, kv, v_dim: int, *, return_target: bool = False, target_kernel: bool = False) -> None:
    """ValueError (one line, naming the fallback) for what the CUDA kernels do not take
    (return_target: only where target_kernel, i.e. forward="wgmma")."""
    heads, dk = q.shape[-2:]
    problems = []
    if q.dtype != jnp.bfloat16 or kv.dtype != jnp.bfloat16:
        problems.append(f"bf16 q and kv (got {q.dtype}, {kv.dtype})")
    if dk != DK or kv.shape[-1] != DK:
        problems.append(f"Dk = {DK} (got {dk})")
    if v_dim != DV:
        problems.append(f"v_dim = {DV} (got {v_dim})")
    if heads % HEAD_TILE:
        problems.append(f"a multiple of {HEAD_TILE} heads (got {heads})")
    if return_target and not target_kernel:
        problems.append("no indexer target (return_target=True) but with forward='wgmma'")
    if problems:
        raise ValueError(f"pallas_kernels.{op}: impl='cuda' takes only " + ", ".join(problems) +
                         "; use impl='pallas_gpu' (or 'auto')")


def default_splits(ctas_per_split: int, topk: int, block_k: int) -> int:
    """K splits per query so that about TARGET_CTAS CTAs run (1 once the queries fill the GPU)."""
    blocks = -(-topk // block_k)
    return max(1, min(blocks, TARGET_CTAS // max(1, ctas_per_split)))


def merge_splits(out: jax.Array, lse: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Partials out f32 [R, splits, H, v] (each normalised over its split) and lse [R, splits, H]
    -> (out [R, H, v] in dtype, lse [R, H]) by log-sum-exp weights; a split without a valid
    slot (lse -inf) weighs 0, a query without any gives 0 / -inf."""
    total = jax.nn.logsumexp(lse, axis=1)
    finite = jnp.isfinite(total)
    w = jnp.where(finite[:, None], jnp.exp(lse - jnp.where(finite, total, 0.0)[:, None]), 0.0)
    return jnp.sum(out * w[..., None], axis=1).astype(dtype), total


def _call(target: str, args, *, rows: int, heads: int, splits: int, dtype, sm_scale: float, block_k: int,
          stages: int):
    """One FFI call -> (out [rows, splits, heads, DV] (dtype if one split, else f32), lse). The
    wgmma targets (`_sm90`) take no block_k and stages (their blocks are fixed)."""
    ensure_registered()
    out_dtype = dtype if splits == 1 else jnp.float32
    shapes = (jax.ShapeDtypeStruct((rows, splits, heads, DV), out_dtype),
              jax.ShapeDtypeStruct((rows, splits, heads), jnp.float32))
    blocks = {} if target.endswith("_sm90") else dict(block_k=np.int64(block_k), stages=np.int64(stages))
    return jax.ffi.ffi_call(target, shapes)(*args, sm_scale=np.float32(sm_scale), splits=np.int64(splits), **blocks)


def _bf16_target(paged: bool, config: SparseMLACudaConfig) -> tuple[str, int, int]:
    """The FFI target of config.forward over bf16 rows, with its (block_k, stages)."""
    name = "glm_paged_sparse_mla_fwd" if paged else "glm_sparse_mla_fwd"
    if config.forward == "wgmma":
        return name + "_sm90", 64, 2
    return name, config.block_k, config.stages


def _finish(out, lse, *, batch: int, seq_len: int, heads: int, dtype):
    if out.shape[1] == 1:
        out, lse = out[:, 0], lse[:, 0]
    else:
        out, lse = merge_splits(out, lse, dtype)
    return out.reshape(batch, seq_len, heads, DV), lse.reshape(batch, seq_len, heads)


def forward(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float,
            config: SparseMLACudaConfig = SparseMLACudaConfig()) -> tuple[jax.Array, jax.Array]:
    """The CUDA forward alone (config's forward kernel, blocks and splits): q bf16 [B, S, H, 576],
    kv bf16 [B, T, 576], indices int32 [B, S, K] -> (out bf16 [B, S, H, 512], lse f32 [B, S, H]).
    Not differentiable (see `sparse_mla`)."""
    batch, seq_len, heads, _ = q.shape
    topk = indices.shape[-1]
    rows = batch * seq_len
    target, block_k, stages = _bf16_target(False, config)
    splits = int(config.num_splits or default_splits(rows * (heads // HEAD_TILE), topk, block_k))
    out, lse = _call(target, (q, kv, jnp.asarray(indices, jnp.int32)), rows=rows, heads=heads,
                     splits=splits, dtype=q.dtype, sm_scale=sm_scale, block_k=block_k, stages=stages)
    return _finish(out, lse, batch=batch, seq_len=seq_len, heads=heads, dtype=q.dtype)


def target(q: jax.Array, kv: jax.Array, indices: jax.Array, lse: jax.Array, *, sm_scale: float) -> jax.Array:
    """The indexer target of the forward whose lse is given (the wgmma kernel's second pass over
    the same rows: S again, no P V): q bf16 [B, S, H, 576], kv bf16 [B, T, 576], indices int32
    [B, S, K], lse float32 [B, S, H] -> float32 [B, S, K], mean over heads of
    exp(sm_scale q_h . kv[indices[j]] - lse_h); 0 at invalid slots. A constant (no gradient)."""
    batch, seq_len, heads, _ = q.shape
    topk = indices.shape[-1]
    rows = batch * seq_len
    ensure_registered()
    sums = jax.ffi.ffi_call("glm_sparse_mla_target_sm90",
                            jax.ShapeDtypeStruct((rows, heads // HEAD_TILE, topk), jnp.float32))(
        q, kv, jnp.asarray(indices, jnp.int32), jnp.asarray(lse, jnp.float32).reshape(rows, heads),
        sm_scale=np.float32(sm_scale))
    return jax.lax.stop_gradient(jnp.sum(sums, axis=1) / heads).reshape(batch, seq_len, topk)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyIndex:
    """The CUDA dkv kernel's index of the indices (`key_index`): the valid (query, slot) pairs
    sorted by (block of KEY_BLOCK latent rows, query), grouped into units (one block, one query):

    pair_row int32 [P] (P = B*S*K): each sorted pair's row within its block (t % KEY_BLOCK);
    unit_query int32 [P]: the query s (within its sequence) of each unit, units of a block in
      ascending s (entries past the last unit are 0, never read);
    unit_start int32 [P + 1]: the first sorted pair of each unit; the entry after the last unit
      (and every later one) is the number of valid pairs;
    block_units int32 [B * nblk + 1] (nblk = ceil(T / KEY_BLOCK)): the first unit of each block
      (b major), the last entry the number of units;
    seq_len, topk, num_keys: static (the index shape it was built for)."""

    pair_row: jax.Array
    unit_query: jax.Array
    unit_start: jax.Array
    block_units: jax.Array
    seq_len: int = dataclasses.field(metadata=dict(static=True))
    topk: int = dataclasses.field(metadata=dict(static=True))
    num_keys: int = dataclasses.field(metadata=dict(static=True))


def key_index(indices: jax.Array, num_keys: int) -> KeyIndex:
    """indices int32 [B, S, K] (-1 / out of range = skip), num_keys T -> `KeyIndex`: one stable
    sort of the B*S*K (block * S + s, row) pairs, the first pair of each (block, query) run marked
    and compacted, and a binary search per block. Depends only on the indices: build it once
    per IndexShare group (`backward_index`) and pass it to each layer's sparse_mla."""
    batch, seq_len, topk = indices.shape
    nblk = -(-num_keys // KEY_BLOCK)
    pairs = batch * seq_len * topk
    sentinel = batch * nblk * seq_len
    if sentinel >= 2**31 or pairs >= 2**31:
        raise ValueError(f"key_index: {batch} x {nblk} blocks x {seq_len} queries or {pairs} pairs overflow int32")
    idx = jnp.asarray(indices, jnp.int32)
    valid = (idx >= 0) & (idx < num_keys)
    b = jnp.arange(batch, dtype=jnp.int32)[:, None, None]
    s = jnp.arange(seq_len, dtype=jnp.int32)[None, :, None]
    key = jnp.where(valid, (b * nblk + idx // KEY_BLOCK) * seq_len + s, sentinel).reshape(-1)
    row = jnp.where(valid, idx % KEY_BLOCK, 0).reshape(-1)
    key, row = jax.lax.sort((key, row), num_keys=1, is_stable=True)
    live = key != sentinel
    first = live & jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
    unit = jnp.cumsum(first.astype(jnp.int32)) - 1
    dest = jnp.where(first, unit, pairs)                       # pairs: dropped
    n_valid = jnp.sum(live.astype(jnp.int32))
    place = jnp.arange(pairs, dtype=jnp.int32)
    unit_start = jnp.full((pairs + 1,), n_valid, jnp.int32).at[dest].set(place, mode="drop")
    unit_key = jnp.full((pairs,), sentinel, jnp.int32).at[dest].set(key, mode="drop")
    unit_query = jnp.where(unit_key < sentinel, unit_key % seq_len, 0)
    bounds = jnp.arange(batch * nblk + 1, dtype=jnp.int32) * seq_len
    block_units = jnp.searchsorted(unit_key, bounds, side="left").astype(jnp.int32)
    return KeyIndex(pair_row=row, unit_query=unit_query, unit_start=unit_start, block_units=block_units,
                    seq_len=seq_len, topk=topk, num_keys=num_keys)


def check_key_index(tindex: KeyIndex, indices: jax.Array, num_keys: int) -> None:
    """ValueError where tindex was built for other indices' shape or T."""
    want = (indices.shape[1], indices.shape[2], num_keys)
    got = (tindex.seq_len, tindex.topk, tindex.num_keys)
    if got != want or tindex.pair_row.shape[0] != indices.size:
        raise ValueError(f"sparse_mla: the key index was built for S, K, T = {got}; got {want}")


def backward(q: jax.Array, kv: jax.Array, indices: jax.Array, dout: jax.Array, lse: jax.Array, delta: jax.Array, *,
             sm_scale: float, v_dim: int = DV, tindex: KeyIndex | None = None, dq_dtype=None):
    """The CUDA backward: (dq [B, S, H, 576] in dq_dtype (default q's), dkv float32 [B, T, 576]).

    q bf16 [B, S, H, 576], kv bf16 [B, T, 576], indices int32 [B, S, K] (-1 / out of range =
    skip, duplicates counted each), dout [B, S, H, 512] (cast to bf16), lse and delta float32
    [B, S, H] (delta = rowsum(out * dout) - dlse, `vjp._delta`). tindex: `key_index(indices, T)`
    (built here when None). Deterministic: fixed order, no atomics."""
    if v_dim != DV:
        raise ValueError(f"cuda.backward: v_dim must be {DV}, got {v_dim}")
    check_supported("sparse_mla (backward)", q, kv, int(v_dim))
    if dout.shape != q.shape[:-1] + (DV,) or lse.shape != q.shape[:-1] or delta.shape != q.shape[:-1]:
        raise ValueError(f"cuda.backward: dout must be [B, S, H, {DV}] and lse, delta [B, S, H] for q "
                         f"{tuple(q.shape)}; got {tuple(dout.shape)}, {tuple(lse.shape)}, {tuple(delta.shape)}")
    ensure_registered()
    idx = jnp.asarray(indices, jnp.int32)
    num_keys = kv.shape[1]
    if tindex is None:
        tindex = key_index(idx, num_keys)
    else:
        check_key_index(tindex, idx, num_keys)
    dout = jnp.asarray(dout, jnp.bfloat16)
    lse = jnp.asarray(lse, jnp.float32)
    delta = jnp.asarray(delta, jnp.float32)
    scale = np.float32(sm_scale)
    dq = jax.ffi.ffi_call("glm_sparse_mla_dq", jax.ShapeDtypeStruct(q.shape, dq_dtype or q.dtype))(
        q, kv, idx, dout, lse, delta, sm_scale=scale)
    dkv = jax.ffi.ffi_call("glm_sparse_mla_dkv", jax.ShapeDtypeStruct(kv.shape, jnp.float32))(
        q, kv, dout, lse, delta, tindex.pair_row, tindex.unit_query, tindex.unit_start, tindex.block_units,
        sm_scale=scale)
    return dq, dkv


@functools.lru_cache(maxsize=None)
def _op(sm_scale: float, v_dim: int, config: SparseMLACudaConfig, dkv_mode: str, bwd: tuple,
        return_target: bool = False):
    """The differentiable op: the CUDA forward of config (with return_target also the indexer
    target, `target`); the CUDA backward (dkv_mode "cuda") or the Pallas GPU backward of
    dkv_mode ("sorted", "by_key") with the keyword settings bwd ((name, value), ...)."""
    def fwd(q, kv, idx, index):
        del index
        out, lse = forward(q, kv, idx, sm_scale=sm_scale, config=config)
        if not return_target:
            return out, lse
        return out, lse, target(q, kv, idx, lse, sm_scale=sm_scale)

    if dkv_mode == "cuda":
        return vjp.make_index_sparse_mla(fwd, functools.partial(backward, sm_scale=sm_scale, v_dim=v_dim))
    fn = {"sorted": gpu_backward.backward, "by_key": gpu_backward.backward_by_key}[dkv_mode]
    return vjp.make_index_sparse_mla(fwd, functools.partial(fn, sm_scale=sm_scale, v_dim=v_dim, interpret=False,
                                                            **dict(bwd)))


def _dkv_mode(c: gpu.SparseMLAGpuConfig, q, kv, indices, v_dim: int) -> str:
    return gpu.resolve_dkv_mode(c, seq_len=q.shape[1], num_keys=kv.shape[1], heads=q.shape[2], dk=q.shape[3],
                                v_dim=int(v_dim), topk=indices.shape[-1], itemsize=jnp.dtype(kv.dtype).itemsize)


def backward_index(indices: jax.Array, num_keys: int, *, dk: int, dtype,
                   config: SparseMLACudaConfig = SparseMLACudaConfig(), heads: int | None = None,
                   v_dim: int | None = None):
    """The index the backward takes: `key_index` for backward="cuda", else `gpu.backward_index`
    with config.pallas_backward."""
    if config.backward == "cuda":
        return key_index(jnp.asarray(indices, jnp.int32), int(num_keys))
    return gpu.backward_index(indices, num_keys, dk=dk, dtype=dtype, config=config.pallas_backward, heads=heads,
                              v_dim=v_dim)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, sm_scale: float, v_dim: int,
               return_target: bool = False, config: SparseMLACudaConfig = SparseMLACudaConfig(),
               interpret: bool = False, tindex=None):
    """Contract of `pallas_kernels.sparse_mla`: the CUDA forward, differentiable through the
    CUDA backward (config.backward="cuda"; tindex a `KeyIndex` from `backward_index`, else built
    here) or the Pallas GPU one ("pallas_gpu": config.pallas_backward, tindex as in
    `gpu.sparse_mla`). A tindex of the other backward's kind is not used (the right one is built)."""
    if interpret:
        raise ValueError("pallas_kernels.sparse_mla: impl='cuda' has no interpret mode; it runs only on CUDA GPUs")
    check_supported("sparse_mla", q, kv, int(v_dim), return_target=return_target,
                    target_kernel=config.forward == "wgmma")
    idx = jnp.asarray(indices, jnp.int32)
    if config.backward == "cuda":
        if isinstance(tindex, KeyIndex):
            check_key_index(tindex, idx, kv.shape[1])
        else:
            tindex = key_index(idx, kv.shape[1])
        op = _op(float(sm_scale), int(v_dim), config, "cuda", (), bool(return_target))
        return op(q, kv, idx, tindex)
    c = config.pallas_backward
    dkv_mode = _dkv_mode(c, q, kv, indices, v_dim)
    if c.dkv_mode == "auto" and isinstance(tindex, transpose.KeyBitmap):
        dkv_mode = "by_key"
    want = {"sorted": transpose.TransposedIndex, "by_key": transpose.KeyBitmap}[dkv_mode]
    if tindex is not None and not isinstance(tindex, want):
        if c.dkv_mode != "auto" and not isinstance(tindex, KeyIndex):
            raise ValueError(f"sparse_mla: dkv_mode={dkv_mode!r} takes a {want.__name__}, got {type(tindex).__name__}")
        tindex = None
    if tindex is None:
        tindex = gpu._indexed_index(idx, kv.shape[1], dkv_mode, dk=q.shape[3], dtype=kv.dtype, c=c)
    op = _op(float(sm_scale), int(v_dim), config, dkv_mode, gpu._backward_settings(c, dkv_mode),
             bool(return_target))
    return op(q, kv, idx, tindex)


def paged_sparse_mla(q: jax.Array, kv_pages: jax.Array, page_table: jax.Array, indices: jax.Array, *, slot,
                     sm_scale: float, v_dim: int, config: SparseMLACudaConfig = SparseMLACudaConfig(),
                     interpret: bool = False):
    """Contract of `pallas_kernels.paged_sparse_mla` (forward only): the same kernel reading the
    rows in place, logical row t of sequence b at kv_pages[slot, page_table[b, t // P], t % P]; the
    K slots split over `num_splits` CTAs per query (default: enough to fill the GPU) and merged
    by lse. kv_pages bf16 [slots, pages, P, 576] or an `fp8.Fp8Latent` of such pages (the FP8
    kernel, `cuda_fp8`)."""
    if interpret:
        raise ValueError("pallas_kernels.paged_sparse_mla: impl='cuda' has no interpret mode; it runs only on "
                         "CUDA GPUs")
    if fp8.is_fp8(kv_pages):
        cuda_fp8.check_supported(q, kv_pages, int(v_dim))
        block_k, stages = cuda_fp8.block_stages(config.block_k, config.stages)
        target, store = cuda_fp8.TARGET, tuple(kv_pages)
    else:
        check_supported("paged_sparse_mla", q, kv_pages, int(v_dim))
        target, block_k, stages = _bf16_target(True, config)
        store = (kv_pages,)
    batch, seq_len, heads, _ = q.shape
    topk = indices.shape[-1]
    rows = batch * seq_len
    splits = int(config.num_splits or default_splits(rows * (heads // HEAD_TILE), topk, block_k))
    slot = jnp.reshape(jnp.asarray(slot, jnp.int32), (1,))
    args = (q, *store, jnp.asarray(page_table, jnp.int32), slot, jnp.asarray(indices, jnp.int32))
    out, lse = _call(target, args, rows=rows, heads=heads, splits=splits, dtype=q.dtype,
                     sm_scale=float(sm_scale), block_k=block_k, stages=stages)
    return _finish(out, lse, batch=batch, seq_len=seq_len, heads=heads, dtype=q.dtype)
