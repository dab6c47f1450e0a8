"""Lightning-indexer benchmark: the Pallas top-k vs the XLA baseline, next to the roofline.

    PYTHONPATH=. python3 benchmarks/indexer_topk.py            # on a GPU
    PYTHONPATH=. python3 benchmarks/indexer_topk.py --smoke    # tiny shapes, interpret mode, CPU

Prints, in one run: the measured device copy bandwidth and bf16 matmul rate (the ceilings); an
exactness check of the Pallas top-k against the reference on integer-valued inputs (exact
scores, many ties); selection alone over given float32 scores [64, T]; decode (64 sequences x
1 query, 32 heads x 128, bf16 keys) at several contexts, with bandwidth on the key bytes; and
prefill scoring and top-k (4K and 8K queries at the end of a 128K context) with the FLOP rate
of the causal scores, and on a GPU the fused top-k (`IndexerGpuConfig(fused=True)`: no scores
array; its count and compaction kernels compute their scores) against the scores' matmul limit. The baseline is what one writes without the kernels: the `xla` scores
followed by `jax.lax.top_k`. Paged decode: the same decode over keys in a store of 64-row pages
in shuffled order, `paged_indexer_topk` (the kernel reads the keys through the page table)
against the path it replaces (the pages gathered into a contiguous copy, then the Pallas
top-k), next to the copy-bandwidth floor of the key bytes. `--paged-only` runs the ceilings and
the paged decode alone. `--json FILE` also writes the rows for plotting.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks._measure import bench, ceilings
from benchmarks._report import write_json
from pallas_kernels.indexer_topk import gpu as gpu_kernels

H, D, TOPK = 32, 128, 2048


def impl_name() -> str:
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "pallas_gpu")


def decode_inputs(key, B, S, T, dtype=jnp.bfloat16):
    kq, kk, kw = jax.random.split(key, 3)
    q = jax.random.normal(kq, (B, S, H, D), dtype)
    k = jax.random.normal(kk, (B, T, D), dtype)
    w = jax.random.uniform(kw, (B, S, H), jnp.float32, 0.0, 1.0) * H ** -0.5 * D ** -0.5
    q_pos = jnp.broadcast_to(T - S + jnp.arange(S, dtype=jnp.int32), (B, S))
    return q, k, w, q_pos, jnp.full((B,), T, jnp.int32)


def check(impl, interpret):
    """Exactness on integer-valued inputs (exact float32 scores, plentiful ties)."""
    rng = np.random.default_rng(0)
    B, S, T, topk = (2, 3, 700, 64) if interpret else (4, 5, 40000, TOPK)
    q = jnp.asarray(rng.integers(-2, 3, (B, S, H, D)), jnp.bfloat16)
    k = jnp.asarray(rng.integers(-2, 3, (B, T, D)), jnp.bfloat16)
    w = jnp.asarray(rng.integers(0, 3, (B, S, H)), jnp.float32)
    q_pos = jnp.asarray(rng.integers(T // 2, T, (B, S)), jnp.int32)
    kv_len = jnp.asarray(rng.integers(T // 2, T + 1, (B,)), jnp.int32)
    args = dict(topk=topk, q_pos=q_pos, kv_len=kv_len)
    want = jax.jit(functools.partial(pk.indexer_topk, impl="xla", **args))(q, k, w)
    got = jax.jit(functools.partial(pk.indexer_topk, impl=impl, interpret=interpret, **args))(q, k, w)
    same = bool(np.array_equal(np.asarray(got), np.asarray(want)))
    print(f"exactness vs xla on integer inputs [{B}x{S} queries, {T} keys, top-{topk}]: "
          f"{'identical' if same else 'DIFFERENT'}")
    return same


def device_bytes() -> int | None:
    """The memory the default device lets one program use (None where it does not say)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def paged_batch(batch: int, context: int, memory: int | None, itemsize: int = 2) -> int:
    """Sequences of `context` keys that one paged decode row measures: `batch`, or fewer where the
    store and the baseline's gathered copy (twice the key bytes) would take more than half of the
    device's `memory` (an 80 GB card takes 64 sequences of 1M keys: 32 GiB)."""
    if memory is None:
        return batch
    per_sequence = 2 * context * D * itemsize
    return max(1, min(batch, memory // 2 // per_sequence))


def paged_decode(impl, interpret, bw, contexts, batch, topk, page):
    """Paged decode rows: paged kernel vs pages copied then the contiguous kernel, with the floor
    key bytes / copy bandwidth. Each row's batch is sized to the device (`paged_batch`)."""
    print(f"\n| paged decode: 1 query a sequence, pages of {page} keys (shuffled) | sequences | paged ms | "
          f"copy + kernel ms | speedup | floor ms (key bytes / copy BW) | % of copy BW |")
    print("|---|---|---|---|---|---|---|")
    memory = None if interpret else device_bytes()
    rows = []
    for T in contexts:
        b = paged_batch(batch, T, memory)
        q, _, w, q_pos, kv_len = decode_inputs(jax.random.key(4), b, 1, page)
        q_pos, kv_len = q_pos + (T - page), kv_len + (T - page)
        n = -(-T // page)
        table = (1 + jax.random.permutation(jax.random.key(5), b * n)).reshape(b, n).astype(jnp.int32)
        store = jax.random.normal(jax.random.key(6), (1, b * n + 1, page, D), jnp.bfloat16)   # no contiguous copy
        args = dict(topk=topk, q_pos=q_pos, kv_len=kv_len, impl=impl, interpret=interpret)
        paged_fn = jax.jit(lambda q, st, t, w: pk.paged_indexer_topk(q, st, t, w, **args))
        copy_fn = jax.jit(lambda q, st, t, w: pk.indexer_topk(q, st[0][t].reshape(b, n * page, D), w, **args))
        ours = bench(paged_fn, q, store, table, w)
        base = bench(copy_fn, q, store, table, w)
        key_bytes = b * T * D * jnp.dtype(store.dtype).itemsize
        print(f"| {T} | {b} | {ours * 1e3:.3f} | {base * 1e3:.3f} | {base / ours:.2f}x | {key_bytes / bw * 1e3:.3f} | "
              f"{100 * key_bytes / ours / bw:.0f}% |", flush=True)
        rows.append(dict(kind="paged_decode", T=T, batch=b, ours_s=ours, baseline_s=base, key_bytes=key_bytes,
                         page=page))
        del store
    return rows


def baseline_topk(q, k, w, q_pos, kv_len, topk):
    s = pk.indexer_scores(q, k, w, q_pos=q_pos, kv_len=kv_len, impl="xla")
    return jax.lax.top_k(s, topk)[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 262144, 1048576])
    ap.add_argument("--prefill-queries", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--paged-only", action="store_true", help="only the ceilings and the paged decode")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    interpret = args.smoke
    impl = impl_name()
    bw, mm = ceilings(args.smoke)
    print(f"device: {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e9:.0f} GB/s; "
          f"bf16 matmul {mm / 1e12:.0f} TFLOP/s; impl {impl}")
    contexts = [4096] if args.smoke else args.contexts
    batch = 2 if args.smoke else 64
    topk = 64 if args.smoke else TOPK
    page = 16 if args.smoke else 64
    if args.paged_only:
        rows = paged_decode(impl, interpret, bw, contexts, batch, topk, page)
        write_json(args.json, dict(copy_bytes_per_s=bw, matmul_flops=mm, rows=rows))
        return
    ok = check(impl, interpret)
    rows = []

    print("\n| selection alone, f32 scores | ours ms | lax.top_k ms | speedup | GB/s on scores | copy GB/s |")
    print("|---|---|---|---|---|---|")
    for T in contexts:
        s = jax.random.normal(jax.random.key(1), (batch, T), jnp.float32)
        ours = bench(jax.jit(lambda x: gpu_kernels.select_topk(x, topk, interpret=interpret)), s)
        base = bench(jax.jit(lambda x: jax.lax.top_k(x, topk)[1]), s)
        gbs = s.nbytes / ours / 1e9
        print(f"| [{batch}, {T}] | {ours * 1e3:.3f} | {base * 1e3:.3f} | {base / ours:.1f}x | {gbs:.0f} | {bw / 1e9:.0f} |",
              flush=True)
        rows.append(dict(kind="select", T=T, ours_s=ours, baseline_s=base))

    print("\n| decode: 64 seq x 1 query, bf16 keys | ours ms | baseline ms | speedup | key GB/s | % of copy |")
    print("|---|---|---|---|---|---|")
    for T in contexts:
        q, k, w, q_pos, kv_len = decode_inputs(jax.random.key(2), batch, 1, T)
        ours_fn = jax.jit(lambda q, k, w, p, n: pk.indexer_topk(q, k, w, topk=topk, q_pos=p, kv_len=n,
                                                                impl=impl, interpret=interpret))
        base_fn = jax.jit(functools.partial(baseline_topk, topk=topk))
        ours = bench(ours_fn, q, k, w, q_pos, kv_len)
        base = bench(base_fn, q, k, w, q_pos, kv_len)
        gbs = k.nbytes / ours / 1e9
        print(f"| {T} | {ours * 1e3:.3f} | {base * 1e3:.3f} | {base / ours:.1f}x | {gbs:.0f} | "
              f"{100 * k.nbytes / ours / bw:.0f}% |", flush=True)
        rows.append(dict(kind="decode", T=T, ours_s=ours, baseline_s=base, key_bytes=k.nbytes))
        del q, k

    rows += paged_decode(impl, interpret, bw, contexts, batch, topk, page)

    T = 4096 if args.smoke else 131072
    fused = impl == "pallas_gpu"
    print(f"\n| prefill, {T} keys | scores ms | TFLOP/s | % of matmul | top-k ms | baseline ms | speedup | "
          f"fused top-k ms | matmul limit ms | fused / limit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for S in ([256] if args.smoke else args.prefill_queries):
        q, k, w, q_pos, kv_len = decode_inputs(jax.random.key(3), 1, S, T)
        flops = 2 * H * D * float(jnp.sum(q_pos + 1))
        score_fn = jax.jit(lambda q, k, w, p, n: gpu_kernels.scores(
            q, k, w, q_pos=p, kv_len=n, interpret=interpret))
        t_scores = bench(score_fn, q, k, w, q_pos, kv_len)
        ours_fn = jax.jit(lambda q, k, w, p, n: pk.indexer_topk(q, k, w, topk=topk, q_pos=p, kv_len=n,
                                                                impl=impl, interpret=interpret))
        ours = bench(ours_fn, q, k, w, q_pos, kv_len, reps=3)
        base = bench(jax.jit(functools.partial(baseline_topk, topk=topk)), q, k, w, q_pos, kv_len, reps=3)
        rate = flops / t_scores
        t_fused = float("nan")
        if fused:
            fused_fn = jax.jit(lambda q, k, w, p, n: pk.indexer_topk(
                q, k, w, topk=topk, q_pos=p, kv_len=n, impl=impl, config=pk.IndexerGpuConfig(fused=True),
                interpret=interpret))
            t_fused = bench(fused_fn, q, k, w, q_pos, kv_len, reps=3)
            same = bool(jnp.all(fused_fn(q, k, w, q_pos, kv_len) == ours_fn(q, k, w, q_pos, kv_len)))
        print(f"| {S} queries | {t_scores * 1e3:.2f} | {rate / 1e12:.0f} | {100 * rate / mm:.0f}% | "
              f"{ours * 1e3:.2f} | {base * 1e3:.2f} | {base / ours:.1f}x | {t_fused * 1e3:.2f}"
              f"{'' if not fused or same else ' (differs from the top-k!)'} | {flops / mm * 1e3:.2f} | "
              f"{t_fused / (flops / mm):.1f}x |", flush=True)
        rows.append(dict(kind="prefill", S=S, T=T, scores_s=t_scores, ours_s=ours, baseline_s=base, fused_s=t_fused,
                         matmul_limit_s=flops / mm))
    write_json(args.json, dict(copy_bytes_per_s=bw, matmul_flops=mm, exact=ok, rows=rows))


if __name__ == "__main__":
    main()
