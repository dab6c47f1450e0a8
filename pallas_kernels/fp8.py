"""The FP8 layout of the paged decode cache: latent rows and indexer keys as float8 e4m3 with
float32 scales, quantized per token when written and dequantized inside the kernels.

Latent row of one token and layer ([c_kv | k_rope], kv_lora + rope values):
    values  float8_e4m3fn [kv_lora]         c_kv / its group's scale, rounded to e4m3
    scales  float32 [kv_lora / 128]         one per GROUP = 128 values: max|x| / 448 of the group
    rope    bfloat16 [rope]                 k_rope kept in bf16 (positions must stay precise)
    = kv_lora + 4 kv_lora / 128 + 2 rope bytes: 656 at GLM-5.2's 512 + 64 (1,152 in bf16).
Indexer key of one token (D values):
    values  float8_e4m3fn [D]               k / scale
    scale   float32 (scales [..] without a width axis: lane-dense pages on a TPU)  max|k| / 448
    = D + 4 bytes: 132 at D = 128 (256 in bf16).

Representation: a NamedTuple of arrays (`Fp8Latent`, `Fp8Keys`), each field a paged store of its
own [slots, pages, P, width] (or one slot [pages, P, width]), rather than one uint8 array of
656-byte rows viewed through bitcasts. Why: every field then has its natural dtype, so XLA
gathers, the Pallas Triton lowering (`ref[slot, pages, offsets, cols]` pointer gathers) and
Mosaic address each with the same indexing as a bf16 store and load e4m3 / f32 / bf16 without
reinterpreting bytes inside a kernel (a width-changing bitcast of a gathered tile, [K, 16]
uint8 to [K, 4] float32, would need a reshape the kernels avoid; not tried here). The cost: a row is three gathers from three arrays instead of one, which moves
the same bytes (each field's part of a row is contiguous: 512 B, 16 B, 128 B). A NamedTuple is a
pytree, so it passes through jit, and the paged ops tell the layout from the store's type
(`is_fp8`): the same op reads bf16 and FP8 pages, no extra argument. On TPUs the narrow
fields may not keep their bytes: TPU HBM arrays are tiled over their two minor dims, and in the
row-major layout a decode step pins, latent scales [.., P, 4] took 32x their bytes in a
compiled v5p program's arguments. A key's scales are therefore [.., P] (a page's P scales along
the lanes: 2x at P = 64; [.., P, 1] took 128x). A
TPU sparse-MLA kernel would want the latent scales page-transposed ([.., 4, P]) or packed into
the values' words; none reads FP8 latents yet.

Quantization (no calibration: each token's scale from its own values). For a group g of values
x (128 latent values, or one whole key): scale = max|x| / 448 (448 = the largest finite e4m3),
values = round-to-nearest-even_e4m3(clip(x / scale, -448, 448)); a group of zeros gets scale 0
and values 0 (no NaN). Dequantized: x' = float32(values) * scale.

Error bound. e4m3 has 3 mantissa bits, so rounding a normal value y (|y| >= 2^-6) errs by at
most half an ulp, |y| * 2^-4; a subnormal one by at most half the subnormal step, 2^-10. With
y = x / scale and |y| <= 448, per element
    |x' - x| <= max(2^-4 |x|, 2^-10 scale) <= 2^-4 max|x over the group|
(the second term, 2^-10 max|x| / 448, is far below the first bound). The float32 division and
product add ~2^-23 relative, negligible. Inputs must be finite (an inf or NaN makes its whole
group NaN).

Pure jnp; no glm_jax import (the kernels read it).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

#: The largest finite float8_e4m3fn.
E4M3_MAX = 448.0
#: Latent values per float32 scale.
GROUP = 128
FP8 = jnp.float8_e4m3fn


class Fp8Latent(NamedTuple):
    """Latent rows in FP8: values float8_e4m3fn [..., C], scales float32 [..., C // GROUP],
    rope bfloat16 [..., R]; as a paged store [..] = [slots, pages, P] or [pages, P]."""

    values: jax.Array
    scales: jax.Array
    rope: jax.Array


class Fp8Keys(NamedTuple):
    """Indexer keys in FP8: values float8_e4m3fn [..., D], scales float32 [...] (one per key)."""

    values: jax.Array
    scales: jax.Array


def is_fp8(store) -> bool:
    """Whether a store (or rows) is in the FP8 layout (`Fp8Latent` / `Fp8Keys`)."""
    return isinstance(store, (Fp8Latent, Fp8Keys))


def quantize_groups(x: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """x [..., N] (N a multiple of group) -> (values float8_e4m3fn [..., N], scales float32
    [..., N // group]), each group's scale max|x| / 448 (0 for a group of zeros)."""
    n = x.shape[-1]
    if group <= 0 or n % group:
        raise ValueError(f"pallas_kernels.fp8: the quantized width {n} must be a multiple of the group {group}")
    xf = jnp.asarray(x, jnp.float32).reshape(*x.shape[:-1], n // group, group)
    scales = jnp.max(jnp.abs(xf), axis=-1) / E4M3_MAX
    safe = jnp.where(scales > 0, scales, 1.0)
    y = jnp.clip(xf / safe[..., None], -E4M3_MAX, E4M3_MAX)
    return y.astype(FP8).reshape(x.shape), scales


def dequantize_groups(values: jax.Array, scales: jax.Array) -> jax.Array:
    """values e4m3 [..., N], scales float32 [..., G] (N = G * group) -> float32 [..., N]."""
    n, g = values.shape[-1], scales.shape[-1]
    v = values.astype(jnp.float32).reshape(*values.shape[:-1], g, n // g)
    return (v * scales[..., None]).reshape(values.shape)


def quantize_latent(rows: jax.Array, kv_lora: int) -> Fp8Latent:
    """rows [..., kv_lora + rope] ([c_kv | k_rope]) -> Fp8Latent (values [..., kv_lora], scales
    [..., kv_lora / 128], rope bf16 [..., rope]); kv_lora a multiple of 128."""
    if not 0 < kv_lora <= rows.shape[-1]:
        raise ValueError(f"pallas_kernels.fp8: kv_lora={kv_lora} must be in [1, {rows.shape[-1]}] (the row width)")
    values, scales = quantize_groups(rows[..., :kv_lora], GROUP)
    return Fp8Latent(values, scales, rows[..., kv_lora:].astype(jnp.bfloat16))


def quantize_keys(keys: jax.Array) -> Fp8Keys:
    """keys [..., D] -> Fp8Keys (values [..., D], scales [...]): one scale per key."""
    values, scales = quantize_groups(keys, keys.shape[-1])
    return Fp8Keys(values, scales[..., 0])


def dequantize(x: Fp8Latent | Fp8Keys) -> jax.Array:
    """FP8 rows -> float32 [..., width]: the latent's [values * scale | rope], a key's values * scale."""
    if isinstance(x, Fp8Keys):
        return x.values.astype(jnp.float32) * x.scales[..., None]
    out = dequantize_groups(x.values, x.scales)
    if isinstance(x, Fp8Latent):
        out = jnp.concatenate([out, x.rope.astype(jnp.float32)], axis=-1)
    return out


def quantize_like(store, rows: jax.Array):
    """rows [..., width] in the layout of `store`: an `Fp8Latent` / `Fp8Keys` for an FP8 store,
    else rows cast to the store's dtype."""
    if isinstance(store, Fp8Latent):
        return quantize_latent(rows, store.values.shape[-1])
    if isinstance(store, Fp8Keys):
        return quantize_keys(rows)
    return rows.astype(store.dtype)


def width(store) -> int:
    """Values a row holds (the width of the rows the store dequantizes to)."""
    if isinstance(store, Fp8Latent):
        return store.values.shape[-1] + store.rope.shape[-1]
    if isinstance(store, Fp8Keys):
        return store.values.shape[-1]
    return store.shape[-1]


# ----------------------------------------------------------------------------- stores and bytes


def empty_latent_pages(lead: tuple[int, ...], kv_lora: int, rope: int) -> Fp8Latent:
    """Zero latent store of shape lead (e.g. (slots, pages, P)) + the row's fields."""
    if kv_lora % GROUP:
        raise ValueError(f"pallas_kernels.fp8: kv_lora={kv_lora} must be a multiple of {GROUP}")
    return Fp8Latent(jnp.zeros(lead + (kv_lora,), FP8), jnp.zeros(lead + (kv_lora // GROUP,), jnp.float32),
                     jnp.zeros(lead + (rope,), jnp.bfloat16))


def empty_key_pages(lead: tuple[int, ...], dim: int) -> Fp8Keys:
    """Zero indexer-key store: values lead + (dim,), scales lead."""
    return Fp8Keys(jnp.zeros(lead + (dim,), FP8), jnp.zeros(lead, jnp.float32))


def latent_row_bytes(kv_lora: int, rope: int) -> int:
    """Bytes of one FP8 latent row: kv_lora e4m3 + kv_lora / 128 float32 + rope bf16 (656 at 512 + 64)."""
    if kv_lora % GROUP:
        raise ValueError(f"pallas_kernels.fp8: kv_lora={kv_lora} must be a multiple of {GROUP}")
    return kv_lora + 4 * (kv_lora // GROUP) + 2 * rope


def key_row_bytes(dim: int) -> int:
    """Bytes of one FP8 indexer key: dim e4m3 + one float32 scale (132 at 128)."""
    return dim + 4


def row_bytes(store) -> int:
    """Bytes one row of a store occupies (any layout)."""
    if isinstance(store, Fp8Keys):
        return store.values.shape[-1] + 4
    return sum(x.shape[-1] * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(store))


def write_rows(store, slot, pages: jax.Array, offsets: jax.Array, rows: jax.Array):
    """store [slots, pages, P, ...] with rows [N, width] written at (slot, pages[i], offsets[i]),
    quantized per row for an FP8 store (`quantize_like`)."""
    new = quantize_like(store, rows)
    return jax.tree.map(lambda s, r: s.at[slot, pages, offsets].set(r), store, new)
