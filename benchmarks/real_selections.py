"""Real sparse-attention selections for kernel benchmarks: a trained indexer's top-k on held-out text.

    PYTHONPATH=. python3 benchmarks/real_selections.py --seq-len 65536 --topk 2048 [--checkpoint DIR] [--group 0]

`trained_selections` runs a trained model up to the Full layer of one IndexShare group and
takes that layer's indexer top-k over one long causal row of held-out text, at any length and
any top-k (the model's own top-k path, `ops.indexer_topk`: chunked over queries, so at 64K no
[S, S] scores are live). The result is cached under runs/real_selections/ and loaded from
there. The command line builds (or loads) one file and prints how much blocks of adjacent
queries share their rows (`selection_overlap.overlap_rows`) beside uniformly random causal
selections, the ones the sparse MLA benchmarks time.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.mtp_ablation import heldout_documents
from benchmarks.selection_overlap import overlap_rows, overlap_table, random_indices
from glm_jax import ops
from glm_jax.checkpoint import load_model_dir
from glm_jax.data import pipeline
from glm_jax.data.tokenizer import load_tokenizer
from glm_jax.layers.decoder import AttentionSettings
from glm_jax.layers.embedding import embed

CACHE_DIR = "runs/real_selections"


def heldout_tokens(tok, rows: int, seq_len: int, seed: int) -> np.ndarray:
    """int32 [rows, seq_len]: the standard library's held-out documents
    (`mtp_ablation.heldout_documents`) in an order shuffled by `seed`, each followed by the
    end-of-text token (as training packs them), concatenated and cut into rows. Where they
    hold fewer than rows * seq_len tokens (about 150K with the default tokenizer) the documents
    repeat in the same order, so later queries then see earlier text again."""
    docs = heldout_documents(None)
    encode = pipeline.token_encoder(tok)
    need, pieces, total = rows * seq_len, [], 0
    for n, i in enumerate(itertools.cycle(np.random.default_rng(seed).permutation(len(docs))), 1):
        pieces.append(encode(docs[i]))
        total += len(pieces[-1])
        if total >= need:
            break
    if n > len(docs):
        print(f"held-out text: {sum(map(len, pieces[:len(docs)]))} tokens in {len(docs)} documents, "
              f"repeated to fill {need}", flush=True)
    return np.concatenate(pieces)[:need].reshape(rows, seq_len)


@functools.partial(nnx.jit, static_argnames=("group", "topk"))
def select_group(model, tokens: jax.Array, *, group: int, topk: int) -> jax.Array:
    """tokens int32 [B, S] (positions 0..S-1) -> int32 [B, S, topk]: the top-k of IndexShare
    group `group`'s indexer, on the hidden state entering its Full layer (only the groups
    before it run, in sparse mode as in the model's forward). Row s holds the min(topk, s + 1)
    keys t <= s with the largest scores, by descending score, then -1."""
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    kv_len = jnp.full((b,), s, jnp.int32)
    x = embed(model.embed_tokens, tokens)
    for stack, plan in zip(model.stacks, model.plan):
        graphdef, state = nnx.split(stack)

        def body(x, group_state, graphdef=graphdef):
            return nnx.merge(graphdef, group_state).forward(x, positions, kv_len, AttentionSettings())[0], None

        if before := min(group, plan.count):
            x, _ = jax.lax.scan(body, x, jax.tree.map(lambda a: a[:before], state))
        if group < plan.count:
            layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[group], state)).layers[0]
            break
        group -= plan.count
    h = layer.input_layernorm(x)
    indexer = layer.indexer
    q = indexer.queries(layer.self_attn.query_residual(h), positions)
    return ops.indexer_topk(q, indexer.keys(h, positions), indexer.head_weights(h), topk=topk, q_pos=positions,
                            kv_len=kv_len)


def cache_path(cache_dir: str | Path, checkpoint: str, seq_len: int, topk: int, group: int, seed: int,
               batch: int) -> Path:
    """CACHE_DIR/<checkpoint name>_s<seq_len>_k<topk>_g<group>_seed<seed>.npy (`_b<batch>` added
    before .npy when batch > 1)."""
    rows = f"_b{batch}" if batch > 1 else ""
    return Path(cache_dir) / f"{Path(checkpoint).name}_s{seq_len}_k{topk}_g{group}_seed{seed}{rows}.npy"


def trained_selections(seq_len: int, *, topk: int, checkpoint: str = "checkpoints/default", group: int = 0,
                       seed: int = 0, batch: int = 1, cache_dir: str | Path = CACHE_DIR) -> np.ndarray:
    """int32 [batch, seq_len, topk]: the indexer top-k of IndexShare group `group` of the model
    in `checkpoint` (run in float32), on `heldout_tokens(tok, batch, seq_len, seed)`, one causal
    row each with positions 0..seq_len-1 (past the model's trained context where seq_len
    exceeds it). Query s selects among keys t <= s: min(topk, s + 1) distinct keys by descending
    score, then -1 (the model's sparse attention indices). `topk` need not be the model's own.

    Loaded from `cache_path(cache_dir, ...)` when that file exists, else computed and written
    there (the name does not see the checkpoint's contents: delete the file after retraining)."""
    path = cache_path(cache_dir, checkpoint, seq_len, topk, group, seed, batch)
    if path.exists():
        print(f"loading {path}", flush=True)
        return np.load(path)
    model = load_model_dir(checkpoint, dtype="float32")
    sizes = [len(p.kinds) for p in model.plan for _ in range(p.count)]
    if not 0 <= group < len(sizes):
        raise ValueError(f"{checkpoint} has IndexShare groups 0..{len(sizes) - 1}, not {group}")
    tokens = heldout_tokens(load_tokenizer(checkpoint), batch, seq_len, seed)
    print(f"{model.cfg.name}: top-{topk} (its own: {model.cfg.index_topk}) of group {group}'s indexer (after "
          f"{sum(sizes[:group])} decoder layers) over {seq_len} tokens, {batch} row(s)", flush=True)
    rows = []
    for b in range(batch):
        start = time.perf_counter()
        rows.append(np.asarray(select_group(model, jnp.asarray(tokens[b:b + 1]), group=group, topk=topk)))
        print(f"  row {b + 1}/{batch}: {time.perf_counter() - start:.1f} s" + (" (with compiling)" if b == 0 else ""),
              flush=True)
    out = np.concatenate(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".tmp"), "wb") as f:
        np.save(f, out)
    os.replace(path.with_suffix(".tmp"), path)
    print(f"wrote {path}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--topk", type=int, required=True)
    ap.add_argument("--checkpoint", default="checkpoints/default")
    ap.add_argument("--group", type=int, default=0, help="IndexShare group whose indexer selects")
    ap.add_argument("--seed", type=int, default=0, help="order of the held-out documents, and the random picks")
    ap.add_argument("--batch", type=int, default=1, help="rows of seq-len tokens")
    ap.add_argument("--cache-dir", default=CACHE_DIR)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    first = 2 * args.topk
    if args.seq_len < first + max(args.blocks):
        raise SystemExit(f"--seq-len {args.seq_len} leaves no block of queries with a prefix of 2K = {first} keys")

    trained = trained_selections(args.seq_len, topk=args.topk, checkpoint=args.checkpoint, group=args.group,
                                 seed=args.seed, batch=args.batch, cache_dir=args.cache_dir)
    print(f"{cache_path(args.cache_dir, args.checkpoint, args.seq_len, args.topk, args.group, args.seed, args.batch)}"
          f": {trained.dtype} {list(trained.shape)}")
    print(f"drawing uniformly random causal selections; block overlap of queries from position {first} on",
          flush=True)
    rand = random_indices(trained.shape, np.random.default_rng(args.seed))
    print("\n".join(overlap_table([("random", overlap_rows(rand, args.topk, args.blocks, first)),
                                   (f"trained, group {args.group}",
                                    overlap_rows(trained, args.topk, args.blocks, first))])))


if __name__ == "__main__":
    main()
