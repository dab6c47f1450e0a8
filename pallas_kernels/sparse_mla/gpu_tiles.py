"""The settings and tile helpers shared by the sparse MLA backward kernels on NVIDIA GPUs
(`gpu_pairs`, `gpu_keys`; the forward in `gpu` and the indexer loss kernels use some): default
block sizes and budgets, power-of-two sizes, head tiles read and written with masks
(`load_heads`, `store_heads`: Triton's matmul tiles are powers of two of at least 16 rows, and
no kernel pads the heads in memory), the latent rows' gradient of a tile of (query, head)
columns (`row_gradients`) and a query's block of selected slots (`slot_block`)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import dot, dot_nt

#: Rows per loop step of the pairs kernel (the M dimension of its matmuls).
DEFAULT_BLOCK_K = 64
#: Triton warps of the pairs kernel.
DEFAULT_WARPS = 4
#: Pairs summed per step of the reduce kernel.
DEFAULT_REDUCE_BLOCK = 32
#: Column chunk of the per-pair gradient (its [block_k, chunk] float32 tile lives in registers).
DEFAULT_COL_BLOCK = 128
#: Bytes of one query chunk's per-pair gradients.
DEFAULT_BUDGET = 4 * 2**30
#: Largest padded head count whose dq accumulator is kept in the pairs kernel.
FUSED_DQ_MAX_HEADS = 32
#: Columns ((query, head slot) pairs) of one query tile of the keys kernel (64 with 4 warps:
#: 3.3 ms at the default model's shape on an H100; 128 columns 4.3 ms, 8 warps 7.1 ms).
KEYS_TILE_COLS = 64


def pow2_chunks(start: int, stop: int, most: int = 1 << 30) -> list[tuple[int, int]]:
    """[start, stop) cut into power-of-two (offset, size) chunks of at most `most`, largest first."""
    out = []
    while start < stop:
        size = min(most, 1 << ((stop - start).bit_length() - 1))
        out.append((start, size))
        start += size
    return out


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def head_rows(heads: int) -> int:
    """Rows of a program's head tile: H rounded up to a power of two >= 16 (Triton dot sizes)."""
    return max(16, next_pow2(heads))


def query_slots(heads: int) -> int:
    """Head slots per query in a keys-kernel tile: H rounded up to a power of two."""
    return next_pow2(heads)


def kernel_params(num_warps, num_stages):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


# ----------------------------------------------------------------------------- head tiles

def load_heads(ref, lead: tuple, h0, rows: int, heads: int, cols: tuple[int, int] | None = None, other=0.0):
    """ref [*lead dims, H] or [*lead dims, H, D] -> the `rows` heads h0 .. h0 + rows - 1 at `lead`
    ([rows], or [rows, cs] of columns cols = (c0, cs)); heads >= H read `other`. A plain slice
    when every tile lies inside the H heads (heads a multiple of rows), else a masked load."""
    if heads % rows == 0:
        return ref[(*lead, pl.ds(h0, rows)) + (() if cols is None else (pl.ds(*cols),))]
    if cols is None:
        h = h0 + iota((rows,), 0)
        return plgpu.load(ref.at[(*lead, h)], mask=h < heads, other=other)
    c0, cs = cols
    h = h0 + iota((rows, cs), 0)
    return plgpu.load(ref.at[(*lead, h, c0 + iota((rows, cs), 1))], mask=h < heads, other=other)


def store_heads(ref, lead: tuple, h0, heads: int, val, c0: int | None = None):
    """ref[*lead, h0 + i(, c0 + j)] = val[i(, j)] for the heads h0 + i < H (val [rows] or
    [rows, cs]); the rows past H are not written."""
    rows = val.shape[0]
    if heads % rows == 0:
        ref[(*lead, pl.ds(h0, rows)) + (() if c0 is None else (pl.ds(c0, val.shape[1]),))] = val
        return
    if c0 is None:
        h = h0 + iota((rows,), 0)
        plgpu.store(ref.at[(*lead, h)], val, mask=h < heads)
        return
    h = h0 + iota(val.shape, 0)
    plgpu.store(ref.at[(*lead, h, c0 + iota(val.shape, 1))], val, mask=h < heads)


def row_gradients(rows, qs, dos, lse, delta, sel, *, sm_scale):
    """The latent rows' gradient from a tile of (query, head) columns, inside a kernel.

    rows: the rows' column chunks [bk, cs] (the first len(dos) make up V); qs, dos: the
    columns' q and dout chunks [n, cs]; lse (+inf where a column is empty or padding) / delta
    float32 [n]; sel bool [bk, n]: the (row, column) pairs that count -> float32 [bk, cs] per
    chunk: ds^T q, plus p^T dout in the V chunks."""
    nv = len(dos)
    dtype = rows[0].dtype
    st = dot_nt(rows[0], qs[0])                                                       # s^T [bk, n]
    for rc, qc in zip(rows[1:], qs[1:]):
        st += dot_nt(rc, qc)
    pt = jnp.where(sel, jnp.exp(st * sm_scale - lse[None, :]), 0.0)
    dpt = dot_nt(rows[0], dos[0])
    for rc, dc in zip(rows[1:nv], dos[1:]):
        dpt += dot_nt(rc, dc)
    dsc = (pt * (dpt - delta[None, :]) * sm_scale).astype(dtype)
    pc = pt.astype(dtype)
    out = []
    for i, qc in enumerate(qs):
        g = dot(dsc, qc)                                                              # [bk, cs]
        if i < nv:
            g += dot(pc, dos[i])
        out.append(g)
    return tuple(out)


def slot_block(idx_ref, r, k0, block_k, topk, num_keys, base):
    """Slots k0 .. k0 + block_k - 1 of query row r of idx [R, K] (slots >= K read -1) ->
    (valid bool [bk], kv row base + t [bk], `base` where invalid); base = b * T."""
    k = k0 + iota((block_k,), 0)
    if topk % block_k == 0:
        idx = idx_ref[r, pl.ds(k0, block_k)]
    else:
        idx = plgpu.load(idx_ref.at[r, k], mask=k < topk, other=-1)
    valid = (idx >= 0) & (idx < num_keys)
    return valid, jnp.where(valid, base + idx, base)
