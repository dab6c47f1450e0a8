"""Sparse-attention selections for the kernel benchmarks: a trained indexer's top-k on held-out
text (`trained_selections`, cached under runs/real_selections/), uniformly random causal
selections, and how much blocks of adjacent queries share their selected rows (the command
lines: benchmarks/real_selections.py, benchmarks/selection_overlap.py)."""

from __future__ import annotations

import functools
import itertools
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks._heldout import heldout_documents
from glm_jax import ops
from glm_jax.checkpoint import load_model_dir
from glm_jax.data import pipeline
from glm_jax.data.tokenizer import load_tokenizer
from glm_jax.forward_options import ForwardOptions
from glm_jax.layers.embedding import embed

CACHE_DIR = "runs/real_selections"


def heldout_tokens(tok, rows: int, seq_len: int, seed: int) -> np.ndarray:
    """int32 [rows, seq_len]: the standard library's held-out documents
    (`_heldout.heldout_documents`) in an order shuffled by `seed`, each followed by the
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
            return nnx.merge(graphdef, group_state).forward(x, positions, kv_len, ForwardOptions())[0], None

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
            x, _, _, indices = nnx.merge(graphdef, group_state).forward(x, positions, kv_len, ForwardOptions())
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
