"""Where a sparse (DSA) training step's attention time goes: its parts timed alone on a GPU.

    PYTHONPATH=. python3 benchmarks/sparse_train_parts.py --seq-len 65536 --json parts.json
    PYTHONPATH=. python3 benchmarks/sparse_train_parts.py --seq-len 256 --smoke    # CPU check

At small-128k's shapes (16 heads over GLM-5.2's 576-wide latent rows, top-2048, a 16-head
indexer of width 128), on one sequence of --seq-len tokens: the indexer's top-k; sparse MLA
forward, forward + backward, and forward + backward without the latent rows' gradient, once
per implementation in --impls. Then the sparse-stage indexer KL, old and new:

* the per-layer KL this project used to run in every layer (plain XLA: the target recomputed
  from lse by gathering the latent rows again, then the indexer side), forward + backward;
* the target written by the attention forward: the Pallas GPU forward with and without it;
* the grouped indexer side, once per IndexShare group (`indexer_cross_entropy`), forward and
  forward + backward, once per implementation in --kl-impls;
and, per group of --group layers, the old cost (group x per-layer KL) beside the new one
(group x the target's extra forward time + one grouped indexer side).

The selections are the indexer top-k of the random inputs (`--selections indexer`), or a trained
model's (`--selections trained`: `benchmarks/real_selections.py`, checkpoints/default's first
IndexShare group on held-out text), where adjacent queries share most rows.

`--only attention` times the top-k and sparse MLA parts, `--only kl` the indexer KL parts (so
that each can run under its own time limit). Each line also gives two limits measured in the same run: the part's matmul FLOPs at the bf16
matmul rate, and the bytes it must move at the device's copy bandwidth (read + write).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import pallas_kernels
from benchmarks._measure import bench, ceilings
from benchmarks._report import Table, failure, write_json
from pallas_kernels.chunking import choose_q_chunk, map_query_chunks
from pallas_kernels.sparse_mla.xla import gather_rows

HEADS, LATENT, VALUE, TOPK, INDEX_HEADS, INDEX_DIM = 16, 576, 512, 2048, 16, 128
SCALE = 192 ** -0.5
BF16, F32 = 2, 4


def target_from_lse(q, kv, indices, lse, *, sm_scale):
    """The indexer target as the replaced per-layer KL computed it, for its baseline: from the
    attention's lse, gathering the selected latent rows again, chunked over queries.
    q [B, S, H, Dk], kv [B, T, Dk], indices int32 [B, S, K], lse float32 [B, S, H] -> float32 [B, S, K]."""
    batch, seq_len, num_heads, dk = q.shape
    topk, num_keys = indices.shape[-1], kv.shape[1]
    chunk = choose_q_chunk(seq_len, batch * topk * (dk * kv.dtype.itemsize + 8 * num_heads), None)

    def body(q_c, idx_c, lse_c):
        valid = (idx_c >= 0) & (idx_c < num_keys)
        rows = gather_rows(kv, jnp.where(valid, idx_c, 0))
        logits = jnp.einsum("bchd,bckd->bchk", q_c, rows, preferred_element_type=jnp.float32) * sm_scale
        p = jnp.exp(logits - jnp.where(jnp.isfinite(lse_c), lse_c, jnp.inf)[..., None])
        return jnp.mean(jnp.where(valid[:, :, None, :], p, 0.0), axis=2)

    return map_query_chunks(body, (q, indices, lse), (0, -1, -jnp.inf), chunk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--impls", nargs="+", default=["pallas_gpu", "xla"],
                    choices=pallas_kernels.impl_choices("sparse_mla"), help="sparse MLA implementations to time")
    ap.add_argument("--kl-impls", nargs="+", default=["pallas_gpu", "xla"],
                    choices=pallas_kernels.impl_choices("indexer_cross_entropy"),
                    help="grouped indexer-side implementations to time")
    ap.add_argument("--group", type=int, default=4, help="layers per IndexShare group (GLM-5.2: 4)")
    ap.add_argument("--selections", choices=["indexer", "trained"], default="indexer",
                    help="the indexer top-k of the random inputs, or a trained model's (real_selections.py)")
    ap.add_argument("--only", choices=["attention", "kl"], default=None,
                    help="time only the top-k and sparse MLA parts, or only the indexer KL parts")
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
    copy_rate, matmul = ceilings(args.smoke)
    pallas = lambda impl: args.smoke and impl.startswith("pallas")

    def topk(a, b, c):
        return pallas_kernels.indexer_topk(a, b, c, topk=TOPK, q_pos=positions, kv_len=kv_len)

    if args.selections == "trained":
        from benchmarks._selections import trained_selections

        indices = jnp.asarray(trained_selections(s, topk=TOPK))
    else:
        indices = jax.block_until_ready(jax.jit(topk)(idx_q, idx_k, idx_w))

    # Every array a part reads is an argument of its jitted function, never closed over: a
    # closed-over array is a constant of the program, which XLA copies into it and may try to
    # constant-fold (a sort over [S, K] indices took minutes to compile).
    def attend(impl, return_target=False, config=None):
        return lambda q, kv, idx: pallas_kernels.sparse_mla(q, kv, idx, sm_scale=SCALE, v_dim=VALUE, impl=impl,
                                                            return_target=return_target, interpret=pallas(impl),
                                                            config=config)

    def attention_loss(impl, config=None):
        return lambda q, kv, idx: jnp.sum(attend(impl, config=config)(q, kv, idx)[0].astype(jnp.float32))

    lse, target = jax.jit(lambda q, kv, idx: attend("xla", True)(q, kv, idx)[1:])(q, kv, indices)

    def cross_entropy(impl):
        return lambda a, b, c, idx, tgt: jnp.sum(pallas_kernels.indexer_cross_entropy(
            a, b, c, idx, tgt, impl=impl, interpret=pallas(impl)))

    def old_layer_kl(a, b, c, q, kv, idx, lse):
        # the replaced per-layer KL: the target recomputed from lse, then the indexer side (XLA)
        t = target_from_lse(q, kv, idx, lse, sm_scale=SCALE)
        return jnp.sum(pallas_kernels.indexer_cross_entropy(a, b, c, idx, t, impl="xla"))

    pairs = s * TOPK
    # matmul FLOPs: scores and weighted sum over the selected keys (x3 with the backward)
    attn_fwd = 2 * pairs * HEADS * (LATENT + VALUE)
    index_fwd = 2 * s * INDEX_HEADS * INDEX_DIM * s / 2
    target_flops = 2 * pairs * HEADS * LATENT                       # the target pass: Q.K again
    side_fwd = 2 * pairs * INDEX_HEADS * INDEX_DIM                  # the indexer side's scores
    # bytes: every pair gathers its row (latent or indexer key); the per-query tensors once
    attn_bytes = pairs * (LATENT * BF16 + 4) + s * HEADS * (LATENT + VALUE) * BF16
    target_bytes = pairs * (LATENT * BF16 + 4 + F32)                # gather again, write the target
    side_bytes = pairs * (INDEX_DIM * BF16 + 4 + F32) + s * INDEX_HEADS * (INDEX_DIM * BF16 + F32)
    # backward: gather again (+ index, target, place), write a key gradient and read it back
    side_bwd_bytes = pairs * (3 * INDEX_DIM * BF16 + 12) + 2 * s * INDEX_HEADS * (INDEX_DIM * BF16 + F32)
    def fused_topk(a, b, c):
        return pallas_kernels.indexer_topk(a, b, c, topk=TOPK, q_pos=positions, kv_len=kv_len, impl="pallas_gpu",
                                           config=pallas_kernels.IndexerGpuConfig(fused=True),
                                           interpret=args.smoke)

    parts = [("indexer top-k", topk, (idx_q, idx_k, idx_w), index_fwd, s * s / 2 * INDEX_DIM * BF16),
             ("indexer top-k, fused (no scores array)", fused_topk, (idx_q, idx_k, idx_w), index_fwd,
              s * s / 2 * INDEX_DIM * BF16)]
    for impl in args.impls if args.only != "kl" else ():
        parts += [(f"sparse MLA ({impl}) forward", lambda q, kv, idx, impl=impl: attend(impl)(q, kv, idx)[0],
                   (q, kv, indices), attn_fwd, attn_bytes),
                  (f"sparse MLA ({impl}) forward + backward", jax.grad(attention_loss(impl), argnums=(0, 1)),
                   (q, kv, indices), 3 * attn_fwd, 3 * attn_bytes),
                  ("  the same without the latent rows' gradient", jax.grad(attention_loss(impl), argnums=0),
                   (q, kv, indices), 2 * attn_fwd, 2 * attn_bytes)]
    # the new parts first, the old per-layer KL (the slowest) last, so a time limit cuts the baseline
    side_inputs = (idx_q, idx_k, idx_w, indices, target)
    kl_parts = [("sparse MLA (pallas_gpu) forward, no target",
                 lambda q, kv, idx: attend("pallas_gpu")(q, kv, idx)[:2], (q, kv, indices), attn_fwd, attn_bytes),
                ("sparse MLA (pallas_gpu) forward + target", attend("pallas_gpu", True), (q, kv, indices),
                 attn_fwd + target_flops, attn_bytes + target_bytes)]
    for impl in args.kl_impls:
        kl_parts += [(f"grouped indexer side ({impl}) forward", cross_entropy(impl), side_inputs, side_fwd,
                      side_bytes),
                     (f"grouped indexer side ({impl}) forward + backward",
                      jax.grad(cross_entropy(impl), argnums=(0, 1, 2)), side_inputs, 4 * side_fwd,
                      side_bytes + side_bwd_bytes)]
    kl_parts.append(("old per-layer KL (XLA) forward + backward", jax.grad(old_layer_kl, argnums=(0, 1, 2)),
                     (idx_q, idx_k, idx_w, q, kv, indices, lse), target_flops + 4 * side_fwd,
                     target_bytes + side_bytes + side_bwd_bytes))
    if args.only == "kl":
        parts = kl_parts
    elif args.only is None:
        parts += kl_parts
    print(f"sparse attention parts at {s} tokens; bf16 matmul {matmul / 1e12:.0f} TFLOP/s, "
          f"copy {copy_rate / 1e12:.2f} TB/s")
    table = Table("part", "ms", "matmul limit ms", "copy limit ms")
    rows = []

    def save():         # after every part, so a run cut short keeps what it measured
        write_json(args.json, {"seq_len": s, "matmul_flops": matmul, "copy_bytes_per_s": copy_rate, "rows": rows})

    for name, fn, inputs, flops, nbytes in parts:
        row = {"part": name.strip(), "limit_ms": flops / matmul * 1e3, "copy_limit_ms": nbytes / copy_rate * 1e3}
        limits = f"{row['limit_ms']:.1f}", f"{row['copy_limit_ms']:.1f}"
        try:
            row["ms"] = bench(jax.jit(fn), *inputs, reps=3, inner=1) * 1e3
            table.row(name, f"{row['ms']:.1f}", *limits)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: report it, time the next part
            row["failed"] = failure(e)
            table.row(name, f"failed: {row['failed']}", *limits)
        rows.append(row)
        save()
    ms = {r["part"]: r.get("ms") for r in rows}
    if args.only == "attention":
        return
    sides = [(impl, ms[f"grouped indexer side ({impl}) forward + backward"]) for impl in args.kl_impls]
    side_impl, side = next(((i, t) for i, t in sides if t is not None), (None, None))
    old, plain, with_target = (ms.get(k) for k in ("old per-layer KL (XLA) forward + backward",
                                                   "sparse MLA (pallas_gpu) forward, no target",
                                                   "sparse MLA (pallas_gpu) forward + target"))
    if None not in (old, plain, with_target, side):
        new = args.group * (with_target - plain) + side
        print(f"indexer KL per group of {args.group} layers: old {args.group * old:.1f} ms "
              f"({args.group} x the per-layer KL), new {new:.1f} ms ({args.group} x the target's "
              f"{with_target - plain:.1f} + the grouped indexer side's {side:.1f}, {side_impl})")
        rows.append({"part": f"indexer KL per group of {args.group} layers", "old_ms": args.group * old,
                     "new_ms": new})
        save()


if __name__ == "__main__":
    main()
