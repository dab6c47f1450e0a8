"""The parts of the default recipe's train step, forward + backward, old form against new,
each beside its limit (run through `train_step_parts.py parts`).

A part's limit is max(its matmul FLOPs / the bf16 matmul rate, the bytes it must move / the
copy bandwidth), both measured in the same run (`_measure.ceilings`). The old forms are the
code the step ran before (kept here, and only here, as the baseline).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._measure import bench, ceilings
from benchmarks._report import failure


# ---------------------------------------------------------------------------------- old forms
def old_head_cross_entropy(kernel, hidden, targets, chunk=2048):
    """The vocabulary head as it ran before: per chunk of positions, logits = (h @ W) in the
    model dtype converted to float32, log-softmax, rematerialised in the backward pass.
    kernel [D, V], hidden [B, S, D], targets int32 [B, S] -> mean CE."""
    from pallas_kernels.chunking import map_query_chunks

    def nll(h, t):
        logits = (h @ kernel).astype(jnp.float32)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked

    return jnp.mean(map_query_chunks(nll, (hidden, targets), (0, 0), chunk, remat=True))


def old_head_tv(kernel, p_hidden, q_hidden, chunk=2048):
    """The TV term as it ran before: its own chunked pass, logits of both sides again."""
    from pallas_kernels.chunking import map_query_chunks

    def tv(p, q):
        ps = jax.lax.stop_gradient(jax.nn.softmax((p @ kernel).astype(jnp.float32), axis=-1))
        qs = jax.nn.softmax((q @ kernel).astype(jnp.float32), axis=-1)
        return 1.0 - jnp.sum(jnp.minimum(ps, qs), axis=-1)

    return map_query_chunks(tv, (p_hidden, q_hidden), (0, 0), chunk, remat=True)


def old_embed(table, ids):
    """table [V, D] bf16, ids int32 [B, S]: autodiff's backward is a bf16 scatter-add."""
    return table[ids]


def old_expert_ffn(xs, group_sizes, gate_proj, up_proj, down_proj, block):
    """The blocked expert matmuls as they ran before: rows scattered into per-expert blocks
    padded to `block` rows, a batched matmul per block, gathered back. xs [M, D] sorted by
    expert, group_sizes int32 [E] -> float32 [M, D]."""
    num_rows, num_experts = xs.shape[0], group_sizes.shape[0]
    num_blocks = -(-(num_rows + num_experts * (block - 1)) // block)
    padded = -(-group_sizes // block) * block
    padded_end, end = jnp.cumsum(padded), jnp.cumsum(group_sizes)
    expert_of_row = jnp.repeat(jnp.arange(num_experts), group_sizes, total_repeat_length=num_rows)
    slot = (padded_end - padded)[expert_of_row] + jnp.arange(num_rows) - (end - group_sizes)[expert_of_row]
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(num_blocks) * block, side="right"),
                               num_experts - 1)
    x_blocks = jnp.zeros((num_blocks * block, xs.shape[1]), xs.dtype).at[slot].set(xs).reshape(num_blocks, block, -1)
    mm = lambda a, w: jnp.einsum("bci,bio->bco", a, w[block_expert], preferred_element_type=jnp.float32)
    act = jax.nn.silu(mm(x_blocks, gate_proj)) * mm(x_blocks, up_proj)
    return mm(act.astype(xs.dtype), down_proj).reshape(num_blocks * block, -1)[slot]


def old_moe(cfg, params, x):
    """The routed experts as they ran before (sort, then gathers and scatter-adds).
    params: dict router [E, D] f32, bias [E], gate/up [E, D, F], down [E, F, D]; x [N, D]."""
    from glm_jax.layers.moe import route

    experts, weights = route(cfg, x, params["router"], params["bias"])
    flat_expert = experts.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = (order // cfg.num_experts_per_tok).astype(jnp.int32)
    group_sizes = jnp.bincount(flat_expert, length=cfg.n_routed_experts).astype(jnp.int32)
    rows = x.shape[0] * cfg.num_experts_per_tok
    block = max(8, min(4096, 1 << (max(rows // (8 * cfg.n_routed_experts), 1).bit_length() - 1)))
    out = old_expert_ffn(x[token_of], group_sizes, params["gate"], params["up"], params["down"], block)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((x.shape[0], x.shape[1]), jnp.float32).at[token_of].add(out).astype(x.dtype)


# ---------------------------------------------------------------------------------- timing
def fwd_bwd(loss, argnums):
    """jit(grad of a scalar loss w.r.t. argnums), returning the loss too. Every array a part
    times is passed as an argument: a closed-over array is a constant that XLA may fold."""
    return jax.jit(jax.value_and_grad(loss, argnums=argnums))


def main(args, recipe: dict) -> None:
    from benchmarks._report import device_kind, write_json
    from glm_jax.config import load_config

    cfg = load_config(recipe["config"])
    bw, mm = ceilings(args.smoke)
    print(f"device {device_kind()}: copy {bw / 1e9:,.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for name, part in PARTS.items():
        if args.parts and name not in args.parts:
            continue
        try:
            cases, limit = part(cfg, recipe, bw, mm)
        except Exception as e:  # noqa: BLE001 - a part that cannot be set up is reported, not fatal
            rows.append(dict(part=name, impl="-", failed=failure(e)))
            continue
        limit_s, limit_what = limit
        first = None
        for impl, fn, fn_args in cases:
            try:
                t = bench(fn, *fn_args, reps=5, inner=1)
                row = dict(part=name, impl=impl, ms=t * 1e3, limit_ms=limit_s * 1e3, limit_what=limit_what)
                outputs = jax.tree.leaves(fn(*fn_args))
                first = outputs if first is None else first
                row["rel_diff_from_first"] = _relative_difference(outputs, first)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory in the old form
                row = dict(part=name, impl=impl, failed=failure(e))
            rows.append(row)
            print(row, flush=True)
            write_json(args.json, dict(device=device_kind(), copy_gbs=bw / 1e9, matmul_tflops=mm / 1e12, rows=rows))
    write_json(args.json, dict(device=device_kind(), copy_gbs=bw / 1e9, matmul_tflops=mm / 1e12, rows=rows))


def _relative_difference(outputs, reference) -> float | None:
    """The largest ||a - b|| / ||b|| over the output arrays (the loss and its gradients) of one
    implementation of a part against those of its first; None where their shapes differ."""
    if [o.shape for o in outputs] != [r.shape for r in reference]:
        return None
    diffs = [float(jnp.linalg.norm((o.astype(jnp.float32) - r.astype(jnp.float32)).ravel())
                   / max(float(jnp.linalg.norm(r.astype(jnp.float32).ravel())), 1e-30))
             for o, r in zip(outputs, reference)]
    return max(diffs, default=0.0)


def _normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


def embedding_part(cfg, recipe, bw, mm):
    """One lookup of the B x S tokens into the [V, D] table, forward + backward."""
    b, s, v, d = recipe["batch_size"], recipe["seq_len"], cfg.vocab_size, cfg.hidden_size
    table = _normal(0, (v, d), jnp.bfloat16)
    # Zipf-distributed ids, as in text: many rows of a few ids collide in the scatter-add
    ids = jnp.asarray(np.minimum(np.random.default_rng(1).zipf(1.2, (b, s)) - 1, v - 1), jnp.int32)
    cot = _normal(2, (b, s, d), jnp.bfloat16)
    loss = lambda lookup: lambda t, i, c: jnp.vdot(lookup(t, i).astype(jnp.float32), c.astype(jnp.float32))
    cases = [("autodiff table[ids] (bf16 scatter-add)", fwd_bwd(loss(old_embed), 0), (table, ids, cot))]
    cases += [(impl, fwd_bwd(loss(fn), 0), (table, ids, cot)) for impl, fn in NEW_EMBEDDING.items()]
    moved = 2 * b * s * d * 2 + v * d * (2 + 4)       # rows out, cotangent in, the f32 table gradient and its bf16
    return cases, (moved / bw, "rows gathered, cotangent read, table gradient written")


def head_part(cfg, recipe, bw, mm):
    """The main head's CE: hidden [B, S, D] -> mean CE over V, forward + backward (h and W)."""
    b, s, v, d = recipe["batch_size"], recipe["seq_len"], cfg.vocab_size, cfg.hidden_size
    kernel = _normal(0, (d, v), jnp.bfloat16, d ** -0.5)
    hidden = _normal(1, (b, s, d), jnp.bfloat16)
    targets = jax.random.randint(jax.random.key(2), (b, s), 0, v)
    cases = [("chunked, f32 logits, remat", fwd_bwd(old_head_cross_entropy, (0, 1)), (kernel, hidden, targets))]
    cases += [(impl, fwd_bwd(fn, (0, 1)), (kernel, hidden, targets)) for impl, fn in NEW_HEAD_CE.items()]
    return cases, (3 * 2 * b * s * d * v / mm, "3 matmuls of [B*S, D] x [D, V]")


def mtp_head_part(cfg, recipe, bw, mm):
    """One MTP depth's CE and TV terms (TV weight 1, CE weight 1), forward + backward."""
    b, s, v, d = recipe["batch_size"], recipe["seq_len"], cfg.vocab_size, cfg.hidden_size
    kernel = _normal(0, (d, v), jnp.bfloat16, d ** -0.5)
    p_hidden = _normal(1, (b, s, d), jnp.bfloat16)
    q_hidden = _normal(3, (b, s, d), jnp.bfloat16)
    targets = jax.random.randint(jax.random.key(2), (b, s), 0, v)
    old = lambda w, q, p, t: old_head_cross_entropy(w, q, t) + jnp.mean(old_head_tv(w, p, q))
    args = (kernel, q_hidden, p_hidden, targets)
    cases = [("CE and TV in separate chunked passes", fwd_bwd(old, (0, 1)), args)]
    cases += [(impl, fwd_bwd(lambda w, q, p, t, fn=fn: fn(w, p, q, t), (0, 1)), args)
              for impl, fn in NEW_MTP_HEAD.items()]
    return cases, (4 * 2 * b * s * d * v / mm, "4 matmuls of [B*S, D] x [D, V] (q and p logits, dh, dW)")


def moe_part(cfg, recipe, bw, mm):
    """One MoE layer's routed experts over the B x S tokens, forward + backward (x and weights)."""
    n, d, f, e = recipe["batch_size"] * recipe["seq_len"], cfg.hidden_size, cfg.moe_intermediate_size, \
        cfg.n_routed_experts
    params = dict(router=_normal(0, (e, d), jnp.float32, d ** -0.5), bias=jnp.zeros((e,), jnp.float32),
                  gate=_normal(1, (e, d, f), jnp.bfloat16, d ** -0.5), up=_normal(2, (e, d, f), jnp.bfloat16, d ** -0.5),
                  down=_normal(3, (e, f, d), jnp.bfloat16, f ** -0.5))
    x = _normal(4, (n, d), jnp.bfloat16)
    loss = lambda moe: lambda p, x: jnp.sum(moe(cfg, p, x).astype(jnp.float32) ** 2)
    cases = [("sort + gathers + scatter-add (blocked matmuls)", fwd_bwd(loss(old_moe), (0, 1)), (params, x))]
    cases += [(impl, fwd_bwd(loss(fn), (0, 1)), (params, x)) for impl, fn in NEW_MOE.items()]
    flops = 3 * 3 * 2 * n * cfg.num_experts_per_tok * d * f
    moved = n * d * 2 * 2 * (1 + 2 * cfg.num_experts_per_tok)   # x and dx, their k copies out and back
    return cases, (max(flops / mm, moved / bw), "expert matmuls (k of E per token) or the token copies")


def dense_indexer_kl_part(cfg, recipe, bw, mm):
    """One IndexShare group's dense-stage indexer KL (its 4 layers' head-summed attention against
    the indexer over every earlier key), forward + backward into the indexer's inputs."""
    from glm_jax.layers.decoder import head_summed_target, indexer_kl
    import pallas_kernels as pk

    b, s, layers = recipe["batch_size"], recipe["seq_len"], cfg.index_topk_freq
    h, dk = cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    qs = _normal(0, (layers, b, s, h, dk), jnp.bfloat16)
    latent = _normal(1, (layers, b, s, dk), jnp.bfloat16)
    iq, ik = _normal(2, (b, s, hi, di), jnp.bfloat16), _normal(3, (b, s, di), jnp.bfloat16)
    iw = jax.random.uniform(jax.random.key(4), (b, s, hi), jnp.float32) * (hi * di) ** -0.5
    kv_len = jnp.full((b,), s, jnp.int32)

    def fused(iq, ik, iw, qs, latent, impl="xla", config=None):
        rows = pk.dense_indexer_kl(tuple(qs), tuple(latent), iq, ik, iw, sm_scale=scale, kv_len=kv_len, impl=impl,
                                   config=config)
        return jnp.sum(rows) / b

    def expanded(iq, ik, iw, qs, latent):
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        mask = jnp.arange(s)[None, None, :] <= pos[:, :, None]
        scores = pk.indexer_scores(iq, ik, iw, q_pos=pos, kv_len=kv_len, impl="xla")
        total = 0.0
        for q, c in zip(qs, latent):
            logits = jnp.einsum("bshd,btd->bhst", q, c, preferred_element_type=jnp.float32) * scale
            probs = jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), axis=-1)
            total = total + indexer_kl(head_summed_target(probs), scores, mask) / layers
        return total

    args = (iq, ik, iw, qs, latent)      # arguments, not constants: XLA would fold the work away
    cases = [("expanded: [B, H, S, S] float32 per layer", fwd_bwd(expanded, (0, 1, 2)), args),
             ("fused blockwise (XLA), tiles of 256", fwd_bwd(fused, (0, 1, 2)), args),
             ("fused blockwise (XLA), tiles of 512",
              fwd_bwd(lambda *a: fused(*a, config=pk.DenseIndexerKLXlaConfig(block=512)), (0, 1, 2)), args)]
    if jax.default_backend() == "gpu":          # the lab's kernels, registered by train_step_parts.py
        from lab.dense_indexer_kl_gpu import DenseIndexerKLGpuConfig

        for tile in (64, 32, 16):
            cases.append((f"fused, Pallas GPU kernels (tiles of {tile})",
                          fwd_bwd(lambda *a, tile=tile: fused(*a, impl="pallas_gpu",
                                                              config=DenseIndexerKLGpuConfig(block=tile)), (0, 1, 2)),
                          args))
    pairs = b * s * (s + 1) / 2
    flops = pairs * 2 * (layers * h * dk + 3 * hi * di)
    return cases, (flops / mm, "each layer's causal logits once, the indexer's scores and 2 gradients")


PARTS = {"embedding": embedding_part, "lm head CE": head_part, "MTP depth CE + TV": mtp_head_part,
         "MoE (routed)": moe_part, "dense-stage indexer KL (a group of 4 layers)": dense_indexer_kl_part}



def _embedding():
    from glm_jax.layers import embedding

    return embedding


def _moe():
    from glm_jax.layers import moe

    return moe


def _new_head_ce(kernel, hidden, targets):
    from glm_jax.training.head_losses import linear_cross_entropy

    return linear_cross_entropy(hidden, kernel, targets)


def _new_mtp_head(kernel, p_hidden, q_hidden, targets):
    from glm_jax.training.head_losses import linear_nll_and_tv

    nll, tv = linear_nll_and_tv(q_hidden, kernel, targets, jax.lax.stop_gradient(p_hidden))
    return jnp.mean(nll) + jnp.mean(tv)


#: New implementations: name -> function.
NEW_EMBEDDING = {"sorted runs summed by small one-hot matmuls, no scatter":
                 lambda t, i: _embedding().embed_lookup(t, i, backward="sorted")}
NEW_HEAD_CE = {"fused: gradients in the forward pass, bf16 matmuls": _new_head_ce}
NEW_MTP_HEAD = {"one pass for CE and TV, recomputed backward, bf16 matmuls": _new_mtp_head}
NEW_MOE = {label: (lambda cfg, p, x, path=path: _moe().routed_experts(cfg, x, p["router"], p["bias"], p["gate"],
                                                                    p["up"], p["down"], dispatch=path))
           for path, label in (("sorted", "sorted: permutation gathers, blocked matmuls, no scatter-add"),
                               ("dense", "dense: every expert on every token, no gather"))}
