"""The FP8 cache layout at a model's shapes: bytes per row, token and page, and empty FP8 stores.

The layout, its quantizer and the error bound are `pallas_kernels.fp8` (the kernels read it
without glm_jax). Per token and decoder layer a latent row [c_kv | k_rope] is kv_lora e4m3
values + kv_lora / 128 float32 scales + rope bf16 values (656 bytes at GLM-5.2's 512 + 64,
against 1,152 in bf16); per token and Full layer an indexer key is D e4m3 + one float32 scale
(132 bytes at D = 128, against 256).

The cache's dtype setting (`--kv-cache-dtype`, vLLM's name and choices `KV_CACHE_DTYPES`) maps
to the `dtype` the cache functions take (`store_dtype`): "auto" None (the model's dtype),
"bf16" bfloat16, "fp8" float8_e4m3fn, which selects this layout (`is_fp8_dtype`): the stores
are `Fp8Latent` / `Fp8Keys`, rows quantized when written (`pages.write_rows`) and dequantized
inside the paged kernels or right after a gather (`pages.as_rows`). The engine's page count
and its pool's bytes come from `page_bytes` with the cache's layout.
"""

from __future__ import annotations

import jax.numpy as jnp

from glm_jax.config import GLMConfig
from glm_jax.ops import FP8_IMPLS, fp8

Fp8Keys, Fp8Latent, dequantize, is_fp8 = fp8.Fp8Keys, fp8.Fp8Latent, fp8.dequantize, fp8.is_fp8
quantize_keys, quantize_latent, write_rows = fp8.quantize_keys, fp8.quantize_latent, fp8.write_rows

__all__ = ["LAYOUTS", "KV_CACHE_DTYPES", "store_dtype", "resolve_cache_dtype", "is_fp8_dtype", "layout_of",
           "check_fp8_model", "check_fp8_impls", "Fp8Keys", "Fp8Latent", "dequantize", "is_fp8", "quantize_keys",
           "quantize_latent", "write_rows", "latent_row_bytes", "key_row_bytes", "bytes_per_token", "page_bytes", "pages_that_fit",
           "empty_stores"]

#: The cache layouts: "bf16" (rows in the model's dtype, 2 bytes a value) and "fp8".
LAYOUTS = ("bf16", "fp8")


#: The cache dtype settings (vLLM's `--kv-cache-dtype` names): "auto" the model's dtype, "bf16",
#: "fp8" (this layout).
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


def store_dtype(kv_cache_dtype: str):
    """A cache dtype setting -> the `dtype` of the cache functions: None (the model's) for
    "auto", bfloat16, or float8_e4m3fn (the FP8 layout). Anything else: one-line ValueError."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return {"auto": None, "bf16": jnp.bfloat16, "fp8": fp8.FP8}[kv_cache_dtype]


def is_fp8_dtype(dtype) -> bool:
    """Whether a cache `dtype` (None, a dtype) asks for the FP8 layout."""
    return dtype is not None and jnp.dtype(dtype) == jnp.dtype(fp8.FP8)


def layout_of(cfg: GLMConfig, dtype=None) -> str:
    """The name of the layout a cache `dtype` gives: "fp8", or the dtype's name ("bfloat16",
    "float32"; None: the model's)."""
    return "fp8" if is_fp8_dtype(dtype) else jnp.dtype(dtype or cfg.dtype).name


def check_fp8_model(cfg: GLMConfig) -> None:
    """One-line ValueError unless the model's latent rows fit the FP8 layout (kv_lora a
    multiple of the 128 values a scale covers)."""
    if cfg.kv_lora_rank % fp8.GROUP:
        raise ValueError(f"--kv-cache-dtype fp8 needs kv_lora_rank a multiple of {fp8.GROUP} (one float32 scale per "
                         f"{fp8.GROUP} latent values); {cfg.name} has {cfg.kv_lora_rank}: use auto or bf16")


def resolve_cache_dtype(cfg: GLMConfig, kv_cache_dtype: str, *, attention: str = "auto",
                        indexer: str = "auto"):
    """The cache `dtype` of a --kv-cache-dtype setting (`store_dtype`), checked against the
    model (`check_fp8_model`) and the kernel implementations named (`check_fp8_impls`) for "fp8"."""
    dtype = store_dtype(kv_cache_dtype)
    if is_fp8_dtype(dtype):
        check_fp8_model(cfg)
        check_fp8_impls(attention, indexer)
    return dtype


def check_fp8_impls(attention: str, indexer: str) -> None:
    """One-line ValueError if a named kernel implementation does not read FP8 pages
    (`ops.FP8_IMPLS`; "auto" picks one that does)."""
    for flag, impl, op in (("--attention-impl", attention, "paged_sparse_mla"),
                           ("--indexer-impl", indexer, "paged_indexer_topk")):
        if impl != "auto" and impl not in FP8_IMPLS[op]:
            raise ValueError(f"--kv-cache-dtype fp8: {flag} {impl} does not read FP8 pages; the implementations "
                             f"that do: {', '.join(FP8_IMPLS[op])} (or auto)")


def _check(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(x) for x in LAYOUTS)}, got {layout!r}")


def latent_row_bytes(cfg: GLMConfig, layout: str = "bf16") -> int:
    """Bytes of one token's latent row in one layer: 2 (kv_lora + rope) in bf16; kv_lora +
    4 kv_lora / 128 + 2 rope in FP8."""
    _check(layout)
    if layout == "bf16":
        return 2 * cfg.latent_dim
    return fp8.latent_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)


def key_row_bytes(cfg: GLMConfig, layout: str = "bf16") -> int:
    """Bytes of one token's indexer key in one Full layer: 2 D in bf16, D + 4 in FP8."""
    _check(layout)
    return 2 * cfg.index_head_dim if layout == "bf16" else fp8.key_row_bytes(cfg.index_head_dim)


def bytes_per_token(cfg: GLMConfig, layout: str = "bf16", *, index_share: bool = True) -> int:
    """Bytes one token occupies across all decoder layers (the MTP layer not included): a
    latent row per layer, an indexer key per Full layer (per layer without IndexShare)."""
    keys = len(cfg.full_layers) if index_share else cfg.num_hidden_layers
    return cfg.num_hidden_layers * latent_row_bytes(cfg, layout) + keys * key_row_bytes(cfg, layout)


def page_bytes(cfg: GLMConfig, page_size: int, layout: str = "bf16") -> int:
    """Bytes of one page of page_size tokens over all layers, as the paged cache stores them
    (latent rows on every layer, keys on Full layers)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return page_size * bytes_per_token(cfg, layout)


def pages_that_fit(cfg: GLMConfig, budget_bytes: int, page_size: int, layout: str = "bf16") -> int:
    """How many whole pages of page_size tokens fit in budget_bytes (0 if not one)."""
    return max(0, int(budget_bytes) // page_bytes(cfg, page_size, layout))


def empty_stores(cfg: GLMConfig, latent_slots: int, key_slots: int, num_pages: int,
                 page_size: int) -> tuple[Fp8Latent, Fp8Keys]:
    """Zero FP8 stores shaped as `store.create_paged_cache` shapes bf16 ones: latent (values
    e4m3 [latent_slots, num_pages, page_size, kv_lora], scales f32 [.., kv_lora / 128], rope
    bf16 [.., rope]) and keys (values e4m3 [key_slots, num_pages, page_size, D], scales f32
    [.., 1])."""
    latent = fp8.empty_latent_pages((latent_slots, num_pages, page_size), cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    keys = fp8.empty_key_pages((key_slots, num_pages, page_size), cfg.index_head_dim)
    return latent, keys
