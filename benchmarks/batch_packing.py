"""How long train.py's loop waits for its next packed batch, with and without packing ahead.

    PYTHONPATH=. python3 benchmarks/batch_packing.py                     # 16 x 4096, a 250 ms step
    PYTHONPATH=. python3 benchmarks/batch_packing.py --batch-size 4 --seq-len 512 --batches 10   # quick

Batches are packed from the standard library's training split with checkpoints/default's
tokenizer, as train.py packs them (`pipeline.PackedBatches`). After each batch the loop
"runs the step": it sleeps --step-ms, as the host does while the device works. Printed per
prefetch depth (0: the batch is packed on the loop's thread, as train.py does on a CPU; N: a
thread packs up to N ahead, `Prefetched`): the wait for a batch (median, mean, max) beside
the step time it is hidden behind.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from benchmarks._report import Table
from glm_jax.data import corpus, pipeline, sources
from glm_jax.data.prefetch import Prefetched
from glm_jax.data.tokenizer import load_tokenizer


def waits(depth: int, docs, encode, args) -> np.ndarray:
    """Seconds the loop waited for each of --batches batches (after one warm-up batch)."""
    batches = pipeline.PackedBatches(docs, encode, seq_len=args.seq_len, batch_size=args.batch_size, seed=0)
    source = Prefetched(batches, depth=depth) if depth else batches
    next(source)
    out = []
    for _ in range(args.batches):
        time.sleep(args.step_ms / 1e3)
        t = time.perf_counter()
        next(source)
        out.append(time.perf_counter() - t)
    if depth:
        source.close()
    return np.asarray(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="checkpoints/default", help="a model directory's tokenizer.json")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--step-ms", type=float, default=250.0, help="the step's time the packing may hide behind")
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 2])
    args = ap.parse_args(argv)
    encode = pipeline.token_encoder(load_tokenizer(Path(args.tokenizer)))
    docs = sources.TextFiles(corpus.split_files(corpus.stdlib_source_files(), seed=0)[0])
    print(f"{args.batch_size} x {args.seq_len} tokens a batch, {args.batches} batches, a {args.step_ms:.0f} ms "
          "step between them")
    table = Table("batches packed ahead", "wait median ms", "wait mean ms", "wait max ms", "mean wait / step")
    for depth in args.depths:
        w = waits(depth, docs, encode, args) * 1e3
        table.row(depth, f"{np.median(w):.1f}", f"{w.mean():.1f}", f"{w.max():.1f}", f"{w.mean() / args.step_ms:.2f}")


if __name__ == "__main__":
    main()
