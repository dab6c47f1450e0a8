"""How much adjacent queries of a trained indexer share their selected rows, against random picks.

    PYTHONPATH=. python3 benchmarks/selection_overlap.py --checkpoint checkpoints/default \
        --json docs/data/selection_overlap_default_cpu.json

The sparse attention kernels gather every (query, selected row) pair's latent row on its own: at
few heads (16) that moves ~1 KB per 35 kFLOP, far below the matmul rate, whatever the kernel
(docs/kernels-sparse-mla.md). A kernel that loads the union of a block of b adjacent queries'
rows once and reuses it for all b queries moves |union| rows instead of b * K. This script
measures, on held-out text through a trained model's own indexers, for each block size b:

  union / K     the rows a block loads, in units of one query's selection (b if nothing is shared)
  reuse         b * K / union: the pairs served per row loaded (the byte reduction)
  useful        K / union: the share of a dense [b queries, union rows] product that is selected

beside the same numbers for uniformly random selections from the same causal prefixes (the
selections `benchmarks/sparse_mla.py` and `sparse_train_parts.py` time). Only queries whose
causal prefix is at least 2K keys long count (shorter ones select nearly everything).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.mtp_ablation import heldout_prompts
from glm_jax.checkpoint import load_model_dir
from glm_jax.data.tokenizer import load_tokenizer
from glm_jax.layers.decoder import AttentionSettings


def full_layer_indices(model, tokens: jax.Array) -> list[np.ndarray]:
    """tokens int32 [B, S] -> each IndexShare group's top-k indices, int32 [B, S, K] (-1 = none),
    in layer order, from the model's sparse forward."""
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    kv_len = jnp.full((b,), s, jnp.int32)
    x = model.embed_tokens(tokens)
    found = []
    for stack in model.stacks:
        graphdef, state = nnx.split(stack)

        def body(x, group_state, graphdef=graphdef):
            x, _, _, indices = nnx.merge(graphdef, group_state).forward(x, positions, kv_len, AttentionSettings())
            return x, indices

        x, indices = jax.lax.scan(body, x, state)                   # [groups, B, S, K]
        found += [np.asarray(i) for i in indices]
    return found


def random_indices(shape: tuple[int, int, int], rng: np.random.Generator) -> np.ndarray:
    """int32 [B, S, K]: for query s, min(K, s + 1) distinct keys drawn uniformly from [0, s]."""
    batch, seq_len, topk = shape
    out = np.full(shape, -1, np.int32)
    for s in range(seq_len):
        n = min(topk, s + 1)
        for b in range(batch):
            out[b, s, :n] = rng.choice(s + 1, size=n, replace=False)
    return out


def block_unions(indices: np.ndarray, block: int, first_query: int) -> np.ndarray:
    """indices int32 [B, S, K] -> the size of the union of the valid indices of each block of
    `block` adjacent queries starting at or after first_query (one value per block)."""
    batch, seq_len, topk = indices.shape
    count = max(0, (seq_len - first_query) // block)
    blocks = indices[:, first_query:first_query + count * block].reshape(batch * count, block * topk)
    sizes = []
    for part in np.array_split(blocks, max(1, blocks.size // 2**24)):     # bounded sort temporaries
        rows = np.sort(part, axis=1)                                        # -1 first
        sizes.append(np.sum((rows[:, 1:] != rows[:, :-1]) & (rows[:, 1:] >= 0), axis=1) + (rows[:, 0] >= 0))
    return np.concatenate(sizes).astype(np.float64)


def overlap_rows(indices: np.ndarray, topk: int, blocks: list[int], first_query: int) -> list[dict]:
    rows = []
    for block in blocks:
        union = block_unions(indices, block, first_query)
        rows.append({"block": block, "union_over_k": float(np.mean(union) / topk),
                     "reuse": float(np.mean(block * topk / union)), "useful": float(np.mean(topk / union))})
    return rows


def overlap_table(named: list[tuple[str, list[dict]]]) -> list[str]:
    """Markdown lines: a row per block size of each (selections' name, `overlap_rows` result)."""
    lines = ["| block b | selections | union / K | reuse (b K / union) | useful (K / union) |", "|---|---|---|---|---|"]
    for name, rows in named:
        lines += [f"| {r['block']} | {name} | {r['union_over_k']:.2f} | {r['reuse']:.2f} | {r['useful']:.2f} |"
                  for r in rows]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="checkpoints/default")
    ap.add_argument("--prompts", type=int, default=8, help="held-out documents, one sequence each")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's context)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--heldout", default=None, help="held-out documents, JSON lines (default: the stdlib split)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model = load_model_dir(args.checkpoint, dtype="float32")
    cfg = model.cfg
    topk = cfg.index_topk
    seq_len = args.seq_len or cfg.max_position_embeddings
    if seq_len < 4 * topk:
        raise SystemExit(f"--seq-len {seq_len} leaves no query with a prefix of 2K = {2 * topk} keys and room "
                         "for blocks; use at least 4K")
    tokens = jnp.asarray(heldout_prompts(load_tokenizer(args.checkpoint), args.prompts, seq_len, args.heldout))
    first = 2 * topk
    print(f"{cfg.name}: top-{topk} of up to {seq_len} keys, {args.prompts} held-out sequences, queries from "
          f"position {first}")
    trained = full_layer_indices(model, tokens)
    rand = random_indices(trained[0].shape, np.random.default_rng(0))
    result = {"config": cfg.name, "topk": topk, "seq_len": seq_len, "prompts": args.prompts,
              "random": overlap_rows(rand, topk, args.blocks, first),
              "layers": [overlap_rows(i, topk, args.blocks, first) for i in trained]}
    print("\n".join(overlap_table([("random", result["random"])] +
                                  [(f"trained, group {g}", rows) for g, rows in enumerate(result["layers"])])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
