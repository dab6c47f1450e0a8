"""Real sparse-attention selections for kernel benchmarks: a trained indexer's top-k on held-out text.

    PYTHONPATH=. python3 benchmarks/real_selections.py --seq-len 65536 --topk 2048 [--checkpoint DIR] [--group 0]

`trained_selections` runs a trained model up to the Full layer of one IndexShare group and
takes that layer's indexer top-k over one long causal row of held-out text, at any length and
any top-k (the model's own top-k path, `ops.indexer_topk`: chunked over queries, so at 64K no
[S, S] scores are live). The result is cached under runs/real_selections/ and loaded from
there. The command line builds (or loads) one file and prints how much blocks of adjacent
queries share their rows (`_selections.overlap_rows`) beside uniformly random causal
selections, the ones the sparse MLA benchmarks time.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks._selections import CACHE_DIR, cache_path, overlap_rows, overlap_table, random_indices, \
    trained_selections


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
