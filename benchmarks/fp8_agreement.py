"""Greedy agreement of the FP8 KV cache with the model's dtype on held-out prompts.

Each held-out prompt (`benchmarks/_heldout.py`: the standard library's split, which the default
model never trained on) is decoded greedily twice, `--kv-cache-dtype auto` and `fp8`, in one
batch each, plain or speculative (--speculative K); the report gives, per prompt, the first new
token where the two differ (none: all equal), the tokens equal before it, and with speculation
each cache's acceptance length (1 + accepted drafts per verify step).

    PYTHONPATH=. python3 benchmarks/fp8_agreement.py --prompts 8 --prompt-len 256 --new-tokens 32
    PYTHONPATH=. python3 benchmarks/fp8_agreement.py --speculative 3 --json out.json

A first difference is not an error: greedy decoding follows near-ties of the logits, which any
change of arithmetic (a batch size, a kernel) may flip.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from benchmarks._heldout import heldout_prompts
from benchmarks._report import Table, device_kind, write_json
from glm_jax.frontends import cli

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "default"


def greedy_tokens(model, prompts: np.ndarray, kv_cache_dtype: str, new_tokens: int, speculative: int):
    """prompts int32 [B, P] -> (new tokens int [B, new_tokens], acceptance length or None, the
    cache's layout as the generator names it)."""
    from glm_jax.decoding.builders import build_generator
    from glm_jax.decoding.decode_config import DecodeConfig

    settings = DecodeConfig(max_new_tokens=new_tokens, temperature=0.0, speculative=speculative,
                            kv_cache_dtype=kv_cache_dtype)
    gen, _ = build_generator(model, settings, batch=len(prompts))
    out = gen.generate(prompts, max_new_tokens=new_tokens)
    if not speculative:
        return np.concatenate(list(out), axis=1)[:, :new_tokens], None, gen.cache_layout
    return out, gen.stats.acceptance_length, gen.cache_layout


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if differ.size else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--prompts", type=int, default=8, help="held-out documents, one prompt each")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--speculative", type=int, default=0, metavar="K", help="draft K tokens (0: plain decoding)")
    ap.add_argument("--heldout", default=None, help="held-out documents, JSON lines (default: the stdlib split)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from glm_jax.checkpoint import load_model_dir
    from glm_jax.data.tokenizer import load_tokenizer

    with cli.user_errors():
        model = load_model_dir(args.checkpoint)
        prompts = heldout_prompts(load_tokenizer(args.checkpoint), args.prompts, args.prompt_len, args.heldout)
    runs = {kv: greedy_tokens(model, prompts, kv, args.new_tokens, args.speculative) for kv in ("auto", "fp8")}
    (ref, ref_accept, ref_layout), (got, fp8_accept, fp8_layout) = runs["auto"], runs["fp8"]
    firsts = [first_difference(a, b) for a, b in zip(ref, got)]
    header = (f"device {device_kind()}; {model.cfg.name}; caches {ref_layout} and {fp8_layout}; {args.prompts} "
              f"held-out prompts of {args.prompt_len} tokens, {args.new_tokens} greedy new tokens, "
              + (f"speculative K={args.speculative}" if args.speculative else "plain decoding"))
    print(header)
    table = Table("prompt", "first differing new token", "equal tokens")
    for i, first in enumerate(firsts):
        table.row(i, "none" if first is None else first, int(np.sum(ref[i] == got[i])))
    identical = sum(f is None for f in firsts)
    print(f"{identical}/{args.prompts} completions identical; equal tokens before the first difference, mean "
          f"{np.mean([args.new_tokens if f is None else f for f in firsts]):.1f} of {args.new_tokens}")
    if args.speculative:
        print(f"acceptance length: {ref_accept:.3f} ({ref_layout}), {fp8_accept:.3f} ({fp8_layout})")
    write_json(args.json, dict(header=header, first_difference=firsts, identical=identical,
                               acceptance_length={"auto": ref_accept, "fp8": fp8_accept}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
