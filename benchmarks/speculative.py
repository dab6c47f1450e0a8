"""Plain vs MTP speculative decoding of a trained model: tokens/s, acceptance length, speedup.

    python benchmarks/speculative.py --checkpoint checkpoints/default --batch 1 16 --draft 3 7

Each configuration is run twice with the same inputs; the second (compiled) run is timed.
Prompts are the first lines of held-out standard-library files, so the text is code the model
did not train on. Greedy decoding (temperature 0), where speculative output equals plain output.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from glm_jax.checkpoint import load_model_dir
from glm_jax.data import corpus
from glm_jax.data.tokenizer import load_tokenizer
from glm_jax.decoding.generate import Generator
from glm_jax.decoding.speculative import SpeculativeGenerator


def prompts(tok, batch: int, length: int) -> np.ndarray:
    _, heldout = corpus.split_files(corpus.stdlib_source_files())
    rows = []
    for text in corpus.read_texts(heldout):
        ids = tok.encode(text).ids
        if len(ids) >= length:
            rows.append(ids[:length])
        if len(rows) == batch:
            break
    while len(rows) < batch:
        rows.append(rows[len(rows) % max(len(rows), 1)])
    return np.asarray(rows, np.int32)


def timed(fn):
    fn()                                   # compile
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/default")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--draft", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    model = load_model_dir(args.checkpoint)
    tok = load_tokenizer(args.checkpoint)
    max_len = args.prompt_len + args.new_tokens + 64
    print(f"device {jax.devices()[0].device_kind}; model {model.cfg.name}; prompt {args.prompt_len} tokens; "
          f"{args.new_tokens} new tokens per sequence; greedy")
    print("| batch | decoding | tokens/s | acceptance length | accept rate per draft position | speedup |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        ids = prompts(tok, batch, args.prompt_len)
        plain = Generator(model, batch=batch, max_len=max_len, prefill_chunk=64, block_size=16)

        def run_plain():
            out = np.concatenate(list(plain.generate(ids, max_new_tokens=args.new_tokens)), axis=1)
            return out[:, :args.new_tokens]

        ref, t_plain = timed(run_plain)
        plain_rate = batch * args.new_tokens / (t_plain - plain.stats["prefill_s"])
        print(f"| {batch} | plain | {plain_rate:.1f} | 1.00 | - | 1.00x |", flush=True)
        for k in args.draft:
            spec = SpeculativeGenerator(model, batch=batch, max_len=max_len, num_draft=k, prefill_chunk=64)
            out, _ = timed(lambda: spec.generate(ids, max_new_tokens=args.new_tokens))
            assert np.array_equal(out, ref), "greedy speculative decoding must equal greedy plain decoding"
            s = spec.stats
            rate = batch * args.new_tokens / s.decode_s
            rates = " ".join(f"{r:.2f}" for r in s.acceptance_rate)
            print(f"| {batch} | speculative K={k} | {rate:.1f} | {s.acceptance_length:.2f} | {rates} | "
                  f"{rate / plain_rate:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
