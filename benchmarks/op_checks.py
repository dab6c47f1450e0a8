"""What the public ops' argument checks (`pallas_kernels.checks`) cost: each op through its public,
checked entry point against its registry implementation called directly, unchecked, in one run.

    PYTHONPATH=. python3 benchmarks/op_checks.py [--json FILE]

Two rows per op: the time to trace (where the checks run, once per shape) and the time of a
jitted call (the compiled program, where they do not run at all). The shapes are small: the
checks cost the same at every size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks._measure import bench
from benchmarks._report import Table, device_kind, write_json
from pallas_kernels import registry

B, S, T, H, D, K = 1, 64, 4096, 8, 128, 256


def _inputs():
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, S, H, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, D), jnp.float32)
    w = jax.random.uniform(keys[2], (B, S, H), jnp.float32)
    q_pos = jnp.broadcast_to(T - S + jnp.arange(S, dtype=jnp.int32), (B, S))
    kv_len = jnp.full((B,), T, jnp.int32)
    idx = jax.random.randint(keys[3], (B, S, K), 0, T, jnp.int32)
    return q, k, w, q_pos, kv_len, idx


def _cases():
    """(op, checked fn, unchecked fn, args): both take the same arrays."""
    q, k, w, q_pos, kv_len, idx = _inputs()
    topk = registry.REGISTRY["indexer_topk"]["xla"]
    attend = registry.REGISTRY["sparse_mla"]["xla"]
    return [
        ("indexer_topk", lambda q, k, w: pk.indexer_topk(q, k, w, topk=K, q_pos=q_pos, kv_len=kv_len, impl="xla"),
         lambda q, k, w: topk.fn(q, k, w, topk=K, q_pos=q_pos, kv_len=kv_len, kv_start=None,
                                 config=topk.config(), interpret=False), (q, k, w)),
        ("sparse_mla", lambda q, kv, i: pk.sparse_mla(q, kv, i, sm_scale=0.1, v_dim=D // 2, impl="xla"),
         lambda q, kv, i: attend.fn(q, kv, i, sm_scale=0.1, v_dim=D // 2, config=attend.config(), interpret=False),
         (q, k, idx)),
    ]


def _trace_seconds(fn, args, reps=20) -> float:
    """Median seconds to trace fn at args' shapes (no compile); a new function each time, so
    that no trace is reused."""
    times = []
    for _ in range(reps):
        fresh = lambda *a: fn(*a)     # noqa: E731 - a new identity for jit's trace cache
        t = time.perf_counter()
        jax.jit(fresh).trace(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _same_program(a, b, args) -> bool:
    """Whether a and b lower to the same StableHLO (the checks leave nothing in the program)."""
    text = lambda fn: jax.jit(fn).lower(*args).as_text().split("\n", 1)[1]    # noqa: E731 - past the module name
    return text(a) == text(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    print(f"device: {device_kind()}; shapes B={B} S={S} T={T} H={H} D={D} K={K}, impl xla")
    table = Table("op", "what", "checked (public) ms", "unchecked (registry) ms", "checked / unchecked",
                  "same compiled program")
    rows = []
    for op, checked, unchecked, fn_args in _cases():
        same = _same_program(checked, unchecked, fn_args)
        trace = (_trace_seconds(checked, fn_args), _trace_seconds(unchecked, fn_args))
        checked_fn, unchecked_fn = jax.jit(checked), jax.jit(unchecked)
        calls = [(bench(checked_fn, *fn_args, reps=15), bench(unchecked_fn, *fn_args, reps=15)) for _ in range(3)]
        call = tuple(statistics.median(c[i] for c in calls) for i in (0, 1))     # interleaved rounds
        for what, (a, b) in (("trace", trace), ("jitted call", call)):
            table.row(op, what, f"{a * 1e3:.3f}", f"{b * 1e3:.3f}", f"{a / b:.2f}", same)
            rows.append(dict(op=op, what=what, checked_s=a, unchecked_s=b, same_program=same))
        write_json(args.json, dict(device=device_kind(), rows=rows))


if __name__ == "__main__":
    main()
