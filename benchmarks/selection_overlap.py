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

import jax.numpy as jnp
import numpy as np

from benchmarks._heldout import heldout_prompts
from benchmarks._report import write_json
from benchmarks._selections import full_layer_indices, overlap_rows, overlap_table, random_indices
from glm_jax.checkpoint import load_model_dir
from glm_jax.data.tokenizer import load_tokenizer


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
    write_json(args.json, result)


if __name__ == "__main__":
    main()
