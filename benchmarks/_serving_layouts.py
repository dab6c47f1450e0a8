"""The KV cache layouts of the load benchmark (`--kv-cache-dtype auto fp8`): one byte budget for
every layout's page pool, what each pool admits, the decode rate an engine run gave, and the
FP8 / bf16 ratios printed after a run.

    budget = cache_budget(fraction=0.3, explicit=None)      # bytes, once, after the weights are placed
    pages = pool_size(cfg, context=131072, page_size=64, kv_cache_dtype="fp8", budget=budget, ...)
    row.update(capacity(server.pool, 131072), **decode_rate(server))
    print_ratios(rows, context=131072, pattern="IndexShare", server="continuous", layouts=["auto", "fp8"])
"""

from __future__ import annotations

import sys

#: The layout the ratios divide by: the cache in the model's dtype.
BASE_LAYOUT = "auto"


def free_device_bytes() -> int | None:
    """Bytes the first device's allocator can still give (bytes_limit - bytes_in_use), or None
    where the device keeps no memory statistics (a CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def cache_budget(fraction: float | None, explicit: int | None) -> int | None:
    """The pool's bytes for every layout: `explicit` (over a fraction), or `fraction` of the
    device's free memory (measured now: call it once, after the model's weights are placed; the
    numbers printed), or None (no byte budget: the pool is counted in max-context sequences).
    Exits in one line where a fraction is asked of a device without memory statistics."""
    if explicit is not None:
        return explicit
    if fraction is None:
        return None
    free = free_device_bytes()
    if free is None:
        sys.exit("--cache-memory-fraction: this device reports no memory statistics (a CPU); "
                 "give the pool's bytes with --kv-cache-memory-bytes")
    print(f"KV cache pools: {fraction:g} of {free:,} free bytes = {int(fraction * free):,} bytes", flush=True)
    return int(fraction * free)


def pool_size(cfg, *, context: int, page_size: int, kv_cache_dtype: str, budget: int | None,
              pool_contexts: float, shards: int = 1) -> int:
    """Pages of a layout's pool: the whole pages `budget` bytes hold in the layout
    (`builders.pool_pages`), or without a budget `pool_contexts` max-context sequences (the
    same pages in every layout) plus 2."""
    from glm_jax.decoding.builders import pool_pages

    if budget is None:
        return int(pool_contexts * context) // page_size + 2
    return pool_pages(cfg, budget, page_size, kv_cache_dtype, shards)


def capacity(pool, context: int) -> dict:
    """A page pool's pages, bytes, and the `context`-token sequences it holds at once (its
    usable pages over the pages one such sequence takes)."""
    return dict(pool_pages=pool.num_pages, pool_bytes=pool.num_pages * pool.bytes_per_page,
                admits=pool.usable_pages // pool.pages_for(context))


def decode_rate(server) -> dict:
    """What an engine's last run decoded, from its `step_times`: decode_tokens_s, the tokens
    drawn per wall second over the steps that prefilled nothing, and peak_decoding, the most
    slots that drew a token in one step (NaN / 0 for a server without step times)."""
    steps = [t for t in getattr(server, "step_times", []) if t.prefill == 0]
    seconds = sum(t.step_s for t in steps)
    tokens = sum(t.rows * t.steps for t in steps)
    return dict(decode_tokens_s=tokens / seconds if seconds else float("nan"),
                peak_decoding=max((t.rows for t in getattr(server, "step_times", [])), default=0))


def layout_server(server: str, kv_cache_dtype: str, layouts: list[str]) -> str:
    """The server's name in rows: with one layout as it is, with several ", KV <layout>" after it."""
    return server if len(layouts) == 1 else f"{server}, KV {kv_cache_dtype}"


def _ratio(a: float, b: float) -> str:
    """'a / b = r x', or 'n/a' where either is missing (NaN) or b is 0."""
    return f"{a:.1f} / {b:.1f} = {a / b:.2f}x" if b and a == a and b == b else "n/a"


def print_ratios(rows: list[dict], *, context: int, pattern: str, server: str, layouts: list[str]) -> None:
    """For each layout other than auto, a line per arrival rate against auto's row of the same
    server, context, pattern and rate: sequences admitted, decode tokens/s, tokens/s, beside each
    one's decode ceiling. Nothing unless auto ran too."""
    if BASE_LAYOUT not in layouts:
        return

    def runs(layout):
        name = layout_server(server, layout, layouts)
        return {r["rate"]: r for r in rows if (r["context"], r["pattern"], r["server"]) == (context, pattern, name)
                and "error" not in r and "load" not in r}

    base = runs(BASE_LAYOUT)
    for layout in layouts:
        if layout == BASE_LAYOUT:
            continue
        for rate, row in runs(layout).items():
            ref = base.get(rate)
            if ref is None:
                continue
            print(f"{layout} / {BASE_LAYOUT}, {context} {pattern} {server} at {rate:g}/s: admits "
                  f"{row['admits']} / {ref['admits']} = {row['admits'] / max(ref['admits'], 1):.2f}x "
                  f"(peak decoding {row['peak_decoding']} / {ref['peak_decoding']}); decode tokens/s "
                  f"{_ratio(row['decode_tokens_s'], ref['decode_tokens_s'])}; tokens/s "
                  f"{_ratio(row['throughput'], ref['throughput'])}; decode ceiling "
                  f"{_ratio(row['ceiling_tokens_s'], ref['ceiling_tokens_s'])}", flush=True)
