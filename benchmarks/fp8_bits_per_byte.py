"""Held-out bits per byte with the FP8 KV cache against the model's dtype, at long prompts.

    PYTHONPATH=. python3 benchmarks/fp8_bits_per_byte.py --context 4096 --json fp8_bpb_4k.json   # checkpoints/default
    PYTHONPATH=. python3 benchmarks/fp8_bits_per_byte.py --config configs/small-128k.yaml --context 32768 --rows 4
    PYTHONPATH=. python3 benchmarks/fp8_bits_per_byte.py --smoke           # CPU: 2 rows of 128 tokens

Sequences: the held-out documents (`benchmarks/_heldout.py`: the standard library's held-out
split, or --heldout JSON lines), each tokenized as train.py's pipeline tokenizes a document (its
ids, then the end-of-text token), joined in order without repeating any, cut into --rows rows of
--context + 1 tokens: a row's first --context tokens are its inputs, each followed by its target.

Scoring reads the cache as decoding reads it. Per layout (`--kv-cache-dtype` auto, then fp8) a
`DecodeRuntime` built with that layout makes the cache (`new_cache`), and the one prefill
program (`decoding.prefill.prefill_chunk`, as the engine scores a prompt's log-probabilities)
runs the rows --prefill-chunk tokens at a time, given the targets: each chunk writes its rows to
the cache (quantized when written, in FP8) and attends the rows of the chunks before it from the
cache. Both layouts run the same chunks of the same rows.

Reported per context and layout: nats per token (the mean -ln p of every target) and bits per
byte, bits per token x the tokens per byte of the documents the rows were cut from (their UTF-8
bytes over their tokens, end-of-text included; the same factor for both layouts), and the
relative difference of fp8's from auto's (target: within 1%). The model is --checkpoint (default
checkpoints/default), or with --config that config's model with random weights (seed 0; the
tokens from --checkpoint's tokenizer), which the rows say. A context above the model's
max_position_embeddings is refused in one line. A layout that fails keeps a row with its
exception (`_report.failure`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

from benchmarks._heldout import heldout_documents
from benchmarks._report import Table, device_kind, failure, write_json

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "default"
LAYOUTS = ("auto", "fp8")


def heldout_rows(tok, heldout: str | None, rows: int, context: int) -> tuple[np.ndarray, float]:
    """(int32 [rows, context + 1]: consecutive cuts of the held-out documents joined, each
    followed by end-of-text; the tokens per UTF-8 byte of the documents taken). ValueError when
    the documents hold fewer tokens."""
    from glm_jax.data.pipeline import token_encoder

    encode, docs = token_encoder(tok), heldout_documents(heldout)
    need, ids, tokens, size = rows * (context + 1), [], 0, 0
    for i in range(len(docs)):
        if tokens >= need:
            break
        piece = encode(docs[i])
        ids.append(piece)
        tokens, size = tokens + len(piece), size + len(docs[i].encode("utf-8"))
    if tokens < need:
        raise ValueError(f"the held-out documents hold {tokens} tokens; {rows} rows of {context} need {need}: "
                         "lower --rows")
    return np.concatenate(ids)[:need].reshape(rows, context + 1), tokens / size


def score_rows(runtime, rows: np.ndarray) -> np.ndarray:
    """rows int32 [R, S + 1] -> float64 [R, S]: ln p of each row's target (token s + 1) at each
    position s, as the prefill program scores it over `runtime`'s cache (its layout), the rows
    `runtime.batch` at a time, `runtime.prefill_chunk` positions per call."""
    from glm_jax.decoding.prefill import prefill_chunk

    b, c, width = runtime.batch, runtime.prefill_chunk, rows.shape[1] - 1
    out = np.zeros((len(rows), width), np.float64)
    for first in range(0, len(rows), b):
        group = np.zeros((b, width + 1), np.int32)
        real = rows[first:first + b]
        group[:len(real)] = real
        cache = runtime.new_cache(b, runtime.cache_rows(width))
        for start in range(0, width, c):
            n = min(c, width - start)
            tokens, targets = (np.zeros((b, c), np.int32) for _ in range(2))
            tokens[:, :n], targets[:, :n] = group[:, start:start + n], group[:, start + 1:start + n + 1]
            _, _, cache, _, _, scores = runtime.program(prefill_chunk)(
                runtime.layout, runtime.params, cache, runtime.put(tokens, ("batch", None)),
                runtime.put(np.full((b,), n, np.int32), ("batch",)), runtime.forward,
                targets=runtime.put(targets, ("batch", None)))
            out[first:first + len(real), start:start + n] = np.asarray(scores.logprob, np.float64)[:len(real), :n]
    return out


def measure(model, rows: np.ndarray, tokens_per_byte: float, *, layout: str, batch: int, prefill_chunk: int) -> dict:
    """One layout's scores of `rows` (int32 [R, S + 1]) -> nats per token, bits per byte."""
    from glm_jax.decoding.runtime import DecodeRuntime

    context = rows.shape[1] - 1
    runtime = DecodeRuntime(model, batch=min(batch, len(rows)), max_len=context, prefill_chunk=prefill_chunk,
                            kv_cache_dtype=layout)
    logp = score_rows(runtime, rows)
    nats = float(-logp.mean())
    return dict(cache=runtime.cache_layout, nats_per_token=nats,
                bits_per_byte=nats / math.log(2) * tokens_per_byte, finite=bool(np.isfinite(logp).all()))


def load(args):
    """(model, tokenizer, how the rows name the model)."""
    from flax import nnx

    from glm_jax.checkpoint import load_model_dir
    from glm_jax.config import load_config
    from glm_jax.data.tokenizer import load_tokenizer
    from glm_jax.model import GLMModel

    tok = load_tokenizer(args.checkpoint)
    if args.config is None:
        return load_model_dir(args.checkpoint), tok, f"{args.checkpoint}"
    model = GLMModel(load_config(args.config), rngs=nnx.Rngs(0))
    if tok.get_vocab_size() > model.cfg.vocab_size:
        raise ValueError(f"{args.checkpoint}'s tokenizer has {tok.get_vocab_size()} tokens, more than the "
                         f"{model.cfg.vocab_size} of --config {args.config}")
    return model, tok, f"{args.config}, random weights (seed 0), {args.checkpoint}'s tokenizer"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="the model (and the tokenizer)")
    ap.add_argument("--config", default=None, help="a config's model with random weights in place of the checkpoint's")
    ap.add_argument("--context", type=int, nargs="+", default=None, help="tokens per row (default 4096; smoke 128)")
    ap.add_argument("--rows", type=int, default=None, help="rows per context (default 8; smoke 2)")
    ap.add_argument("--batch", type=int, default=4, help="rows per prefill call")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill call (default 2048; smoke 32)")
    ap.add_argument("--heldout", default=None, help="held-out documents, JSON lines (default: the stdlib split)")
    ap.add_argument("--smoke", action="store_true", help="2 rows of 128 tokens on the CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    pick = lambda value, full, tiny: value if value is not None else (tiny if args.smoke else full)  # noqa: E731
    contexts, rows, chunk = pick(args.context, [4096], [128]), pick(args.rows, 8, 2), pick(args.prefill_chunk, 2048, 32)
    try:
        model, tok, name = load(args)
        for context in contexts:
            if context > model.cfg.max_position_embeddings:
                raise ValueError(f"--context {context} exceeds the model's max_position_embeddings "
                                 f"({model.cfg.max_position_embeddings})")
        data = {c: heldout_rows(tok, args.heldout, rows, c) for c in contexts}
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"device {device_kind()}; model {name} ({model.cfg.name}); {rows} held-out rows per context, "
          f"prefill chunks of {chunk}")
    table = Table("context", "layout", "cache", "nats/token", "bits/byte", "vs auto")
    results = []
    for context, (cut, tokens_per_byte) in data.items():
        base = None
        for layout in LAYOUTS:
            row = dict(context=context, layout=layout, rows=rows, prefill_chunk=chunk, model=name,
                       tokens_per_byte=tokens_per_byte)
            try:
                row.update(measure(model, cut, tokens_per_byte, layout=layout, batch=args.batch, prefill_chunk=chunk))
                base = row["bits_per_byte"] if layout == "auto" else base
                row["relative_to_auto"] = row["bits_per_byte"] / base - 1 if base else float("nan")
                table.row(context, layout, row["cache"], f"{row['nats_per_token']:.4f}", f"{row['bits_per_byte']:.4f}",
                          f"{row['relative_to_auto']:+.3%}")
            except Exception as e:                          # a layout that fails keeps its row
                row["error"] = failure(e)
                table.row(context, layout, f"failed: {row['error']}")
            results.append(row)
            write_json(args.json, dict(device=device_kind(), model=name, rows=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
