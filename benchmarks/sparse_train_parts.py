"""Where a sparse (DSA) training step's attention time goes: its parts timed alone on a GPU.

    PYTHONPATH=. python3 benchmarks/sparse_train_parts.py --seq-len 65536 --json parts.json

At small-128k's shapes (16 heads over GLM-5.2's 576-wide latent rows, top-2048, a 16-head
indexer of width 128), on one sequence of --seq-len tokens: the indexer's top-k; sparse MLA
forward, forward + backward, and forward + backward without the latent rows' gradient, once
per implementation in --impls (the Pallas GPU kernel, which adds that gradient atomically
from its backward kernel, and the chunked XLA impl, which scatter-adds one row per (query,
selected key)); the selected-set indexer KL forward and forward + backward. Each line also gives
the part's matmul FLOPs at the bf16 matmul rate measured in the same run (the physical limit).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks._measure import bench, ceilings
from glm_jax.layers.selected_kl import selected_set_kl

HEADS, LATENT, VALUE, TOPK, INDEX_HEADS, INDEX_DIM = 16, 576, 512, 2048, 16, 128
SCALE = 192 ** -0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--impls", nargs="+", default=["pallas_gpu", "xla"],
                    choices=pallas_kernels.impl_choices("sparse_mla"), help="sparse MLA implementations to time")
    ap.add_argument("--smoke", action="store_true", help="a small ceiling measurement; Pallas interpreted (CPU check)")
    args = ap.parse_args()
    s = args.seq_len
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (1, s, HEADS, LATENT), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (1, s, LATENT), jnp.bfloat16)
    idx_q = jax.random.normal(keys[2], (1, s, INDEX_HEADS, INDEX_DIM), jnp.bfloat16)
    idx_k = jax.random.normal(keys[3], (1, s, INDEX_DIM), jnp.bfloat16)
    idx_w = jax.random.uniform(keys[4], (1, s, INDEX_HEADS), jnp.float32)
    positions, kv_len = jnp.arange(s, dtype=jnp.int32)[None], jnp.array([s], jnp.int32)
    _, matmul = ceilings(args.smoke)

    def topk(a, b, c):
        return pallas_kernels.indexer_topk(a, b, c, topk=TOPK, q_pos=positions, kv_len=kv_len)

    indices = jax.block_until_ready(jax.jit(topk)(idx_q, idx_k, idx_w))

    def attend(impl):
        return lambda q, kv: pallas_kernels.sparse_mla(q, kv, indices, sm_scale=SCALE, v_dim=VALUE, impl=impl,
                                                       interpret=args.smoke and impl.startswith("pallas"))

    def attention_loss(impl):
        return lambda q, kv: jnp.sum(attend(impl)(q, kv)[0].astype(jnp.float32))

    lse = jax.jit(lambda q, kv: attend("xla")(q, kv)[1])(q, kv)
    kl = lambda a, b, c: selected_set_kl(q, kv, indices, lse, sm_scale=SCALE, idx_q=a, idx_keys=b, idx_w=c)
    # matmul FLOPs: scores and weighted sum over the selected keys (x3 with the backward)
    attn_fwd = 2 * s * HEADS * TOPK * (LATENT + VALUE)
    index_fwd = 2 * s * INDEX_HEADS * INDEX_DIM * s / 2
    # the KL's scores: the main heads' and the indexer's over the selected keys; its backward
    # reaches only the indexer inputs
    kl_fwd = 2 * s * TOPK * (HEADS * LATENT + INDEX_HEADS * INDEX_DIM)
    kl_bwd = 2 * 2 * s * TOPK * INDEX_HEADS * INDEX_DIM
    parts = [("indexer top-k", topk, (idx_q, idx_k, idx_w), index_fwd)]
    for impl in args.impls:
        parts += [(f"sparse MLA ({impl}) forward", lambda q, kv, impl=impl: attend(impl)(q, kv)[0], (q, kv), attn_fwd),
                  (f"sparse MLA ({impl}) forward + backward", jax.grad(attention_loss(impl), argnums=(0, 1)), (q, kv),
                   3 * attn_fwd),
                  ("  the same without the latent rows' gradient", jax.grad(attention_loss(impl), argnums=0), (q, kv),
                   2 * attn_fwd)]
    parts += [("selected-set KL forward", kl, (idx_q, idx_k, idx_w), kl_fwd),
              ("selected-set KL forward + backward", jax.grad(kl, argnums=(0, 1, 2)), (idx_q, idx_k, idx_w),
               kl_fwd + kl_bwd)]
    print(f"sparse attention parts at {s} tokens; bf16 matmul {matmul / 1e12:.0f} TFLOP/s")
    print("| part | ms | limit ms (matmul FLOPs at the measured rate) |")
    print("|---|---|---|")
    rows = []
    for name, fn, inputs, flops in parts:
        row = {"part": name.strip(), "limit_ms": flops / matmul * 1e3}
        try:
            row["ms"] = bench(jax.jit(fn), *inputs, reps=3, inner=1) * 1e3
            print(f"| {name} | {row['ms']:.1f} | {row['limit_ms']:.1f} |", flush=True)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: report it, time the next part
            row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"| {name} | failed: {row['failed'][:160]} | {row['limit_ms']:.1f} |", flush=True)
        rows.append(row)
        if args.json:       # after every part, so a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"seq_len": s, "matmul_flops": matmul, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
