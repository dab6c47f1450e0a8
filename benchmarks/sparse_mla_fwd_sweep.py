"""The GPU sparse MLA forward's settings swept at one shape, beside the matmul rate.

    PYTHONPATH=. python3 benchmarks/sparse_mla_fwd_sweep.py --heads 64 --queries 16384 --context 65536 \
        --best best.json
    PYTHONPATH=. python3 benchmarks/sparse_mla_fwd_sweep.py --smoke            # CPU check

Times `pallas_kernels.sparse_mla(impl="pallas_gpu")`'s forward (one program per query, all heads
or `head_group` heads per program) on random causal top-K selections of the last --queries
positions of a --context-token sequence, for every combination of block_k, num_warps,
num_stages and head_group given, and prints each one's ms, TFLOP/s (2 S H K (Dk + v) FLOPs)
and share of the bf16 matmul rate measured in the same run, the default settings first.
--best writes the fastest settings as a JSON dict of `SparseMLAGpuConfig` fields (for
`train_long.py --sparse-config`).
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks._measure import bench, ceilings
from benchmarks._report import Table, failure, write_json

LATENT, VALUE = 576, 512


def random_selections(key, queries: int, context: int, topk: int) -> jax.Array:
    """int32 [1, queries, topk]: for the query at position context - queries + s, topk distinct
    positions <= it (uniform; -1 where fewer exist)."""
    pos = context - queries + jnp.arange(queries, dtype=jnp.int32)
    u = jax.random.uniform(key, (queries, topk))
    # distinct by construction: position j of the k-th of topk evenly spaced strata, jittered
    stride = (pos[:, None] + 1).astype(jnp.float32) / topk
    idx = jnp.floor((jnp.arange(topk)[None, :] + u) * stride).astype(jnp.int32)
    return jnp.where(jnp.arange(topk)[None, :] <= pos[:, None], jnp.minimum(idx, pos[:, None]), -1)[None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--queries", type=int, default=16384)
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--block-k", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--head-group", type=int, nargs="+", default=[0], help="heads per program (0: all)")
    ap.add_argument("--best", default=None, help="write the fastest settings here (JSON)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    args = ap.parse_args()
    if args.smoke:
        args.heads, args.queries, args.context, args.topk = 16, 8, 64, 16
        args.block_k, args.warps, args.stages, args.head_group = [16], [4], [1], [0]
    keys = jax.random.split(jax.random.key(0), 3)
    s, h, t, k = args.queries, args.heads, args.context, args.topk
    q = jax.random.normal(keys[0], (1, s, h, LATENT), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (1, t, LATENT), jnp.bfloat16)
    idx = random_selections(keys[2], s, t, k)
    _, matmul = ceilings(args.smoke)
    flops = 2 * s * h * k * (LATENT + VALUE)
    print(f"sparse MLA forward, {h} heads, {s} queries over {t} keys, top-{k}; bf16 matmul {matmul / 1e12:.0f} "
          f"TFLOP/s; {flops / 1e12:.1f} TFLOP a call")
    table = Table("block_k", "num_warps", "num_stages", "head_group", "ms", "TFLOP/s", "% of matmul")
    default = pallas_kernels.SparseMLAGpuConfig()
    grid = [dict(block_k=None, num_warps=default.num_warps, num_stages=default.num_stages, head_group=None)]
    grid += [dict(block_k=bk, num_warps=w, num_stages=st, head_group=hg or None)
             for bk, w, st, hg in itertools.product(args.block_k, args.warps, args.stages, args.head_group)]
    results = []
    for settings in grid:
        config = pallas_kernels.SparseMLAGpuConfig(**settings)
        fn = jax.jit(lambda q, kv, idx, c=config: pallas_kernels.sparse_mla(
            q, kv, idx, sm_scale=0.05, v_dim=VALUE, impl="pallas_gpu", config=c, interpret=args.smoke)[0])
        label = [str(settings[f] or "default") for f in ("block_k", "num_warps", "num_stages", "head_group")]
        try:
            ms = bench(fn, q, kv, idx, reps=3, inner=1) * 1e3
        except Exception as e:  # noqa: BLE001 - e.g. shared memory exceeded: report, try the next
            table.row(*label, f"failed: {failure(e)}")
            continue
        results.append((ms, settings))
        table.row(*label, f"{ms:.2f}", f"{flops / ms / 1e9:.0f}", f"{flops / ms / 1e9 / (matmul / 1e12):.0%}")
    if results:
        ms, best = min(results, key=lambda r: r[0])
        print(f"fastest: {best} at {ms:.2f} ms ({results[0][0] / ms:.2f}x the default settings)")
        write_json(args.best, {key: v for key, v in best.items() if v is not None})


if __name__ == "__main__":
    main()
