"""Timing and the device's physical ceilings, shared by the kernel benchmarks."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def bench(fn, *args, reps=7, inner=None, min_time=0.02):
    """Median seconds per call of jitted fn(*args)."""
    out = fn(*args)
    jax.block_until_ready(out)
    if inner is None:
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        once = time.perf_counter() - t
        inner = max(1, min(200, int(min_time / max(once, 1e-6))))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def ceilings(smoke: bool) -> tuple[float, float]:
    """(device copy bandwidth in bytes/s counting read + write, bf16 matmul rate in FLOP/s)."""
    n = 1 << (20 if smoke else 30)                       # 2 GiB of bf16 (read + write 4 GiB)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * 2)
    t = bench(copy, x)
    bw = 2 * n * 2 / t
    m = 256 if smoke else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    t = bench(mm, a, b)
    return bw, 2 * m ** 3 / t
