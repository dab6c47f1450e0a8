"""Does a model use its long context? Held-out loss by position, and a retrieval probe, for one or
two model directories (e.g. before and after long-context mid-training).

    PYTHONPATH=. python3 benchmarks/long_context_eval.py --model checkpoints/default runs/mid128k \
        --heldout runs/long/heldout.jsonl --length 131072 --distance 2048 16384 65536 100000 --json long_eval.json
    PYTHONPATH=. python3 benchmarks/long_context_eval.py --smoke       # a CPU: 512 tokens, a few seconds a model

Loss by position: --rows rows of --length tokens cut from the held-out documents (JSON lines, e.g.
scripts/long_documents.py --heldout-out; default: the standard library's held-out files), each
document from its start and followed by the end-of-text token, documents joined where one is
shorter than a row (a row then holds several). Every target is scored with the model's
log-probability (sparse attention over the indexer's top-k in the absorbed form, as train.py's
held-out evaluation; --attention dense: over every earlier key, what a perfect selection
allows; the logits made --chunk positions at a time so that 128K positions never hold a
[S, vocab] array at once), and the table gives bits per token in the position
buckets 0-4K, 4-16K, 16-64K and 64-128K (--buckets; clipped to --length). A model that uses
its context predicts later positions better; one that cannot reach past its training length
gets worse in the far buckets.

Retrieval probe: --probes rows, each of held-out text in which a made-up identifier (random words
and hex digits, e.g. `merge_quartz_7f3a`) is defined once (`def NAME(v):`), --distance tokens
before the row's end, and used again at the end (`result = NAME(`); the probe scores the
log-probability of the name's tokens after its first word (what only the definition can tell).
The same row with another made-up name of the same token count defined in its place is the
control: "gain" = with - control, in nats, is what the definition far back is worth; "definition
selected" is, per IndexShare group, the share of the definition's tokens in the indexer's top-k
of the queries that predict the name (the sparse attention reads nothing else), and "its rank"
the median rank of the definition's best-scored token among the keys those queries see (1: the
indexer's first choice; a top-k of at least that many would read it). Several
--distance values run the probe at each (same filler text), so the table shows where a model
stops finding the definition.

A model whose max_position_embeddings is below --length is evaluated at its own maximum (said
in the table's length column), the probe's distance then at most 3/4 of it. With
--untrained-extension such a model is also evaluated at --length with its positions extended by
YaRN as train.py's --context-length extends them (`glm_jax.config.extend_context`) but no step
trained: the row that mid-training at that length must beat ("MODEL + YaRN to N, untrained"). Prints markdown tables; --json writes them.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks._heldout import heldout_documents
from benchmarks._report import Table, device_kind, failure, write_json
from glm_jax.checkpoint import load_model_dir
from glm_jax.config import extend_context
from glm_jax.model import abstract_model
from glm_jax.data.tokenizer import eos_id, load_tokenizer
from glm_jax.frontends import cli
from glm_jax.forward_options import ForwardOptions

BUCKETS = (4096, 16384, 65536, 131072)
DEFINITION = "\ndef {}(v):\n    return v\n"
_WORDS = ("merge", "quartz", "ledger", "falcon", "vertex", "cobalt", "lantern", "harbor", "tensor", "orbit",
          "maple", "signal", "copper", "glacier", "pivot", "ember")


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk", "mode"))
def token_logprobs(graphdef, state, inputs, targets, *, chunk: int, mode: str = "sparse"):
    """inputs, targets int32 [B, S] -> float32 [B, S]: ln p(target), the logits made `chunk`
    positions at a time (S a multiple of chunk)."""
    model = nnx.merge(graphdef, state)
    hidden = model(inputs, options=ForwardOptions(mode=mode, form="absorbed")).hidden
    b, s, h = hidden.shape
    pieces = (hidden.reshape(b, s // chunk, chunk, h).swapaxes(0, 1), targets.reshape(b, s // chunk, chunk).swapaxes(0, 1))

    def piece(args):
        x, t = args
        logp = jax.nn.log_softmax(model.logits(x), axis=-1)
        return jnp.take_along_axis(logp, t[..., None], axis=-1)[..., 0]

    return jax.lax.map(piece, pieces).swapaxes(0, 1).reshape(b, s)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def group_selections(graphdef, state, inputs, queries):
    """inputs int32 [B, S], queries int32 [B, Q] (positions) -> (int32 [G, B, Q, topk], the keys
    each IndexShare group's indexer selects for those queries (sparse mode, as `token_logprobs`);
    float32 [G, B, Q, S], its scores of every key for them, -inf past each query)."""
    model = nnx.merge(graphdef, state)
    options = ForwardOptions(mode="sparse", form="absorbed")
    b, s = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    x, picked, scored = model.embed_tokens(inputs), [], []
    for stack in model.stacks:
        stack_graphdef, stack_state = nnx.split(stack)

        def body(x, group_state, stack_graphdef=stack_graphdef):
            group = nnx.merge(stack_graphdef, group_state)
            out = group(x, None, None, options)
            selected = jnp.take_along_axis(out.indices, queries[:, :, None], axis=1)
            return out.x, (selected, _query_scores(group.layers[0], x, positions, queries))

        x, (selected, scores) = jax.lax.scan(body, x, stack_state)
        picked.append(selected)
        scored.append(scores)
    return jnp.concatenate(picked), jnp.concatenate(scored)


def _query_scores(full_layer, x, positions, queries):
    """The Full layer's indexer scores of every key for the query positions, as its selection
    computes them: x [B, S, hidden] the group's input -> float32 [B, Q, S], -inf past each query."""
    h, q_resid, *_ = full_layer.attention_inputs(x, positions)
    keys = full_layer.indexer.keys(h, positions)
    rows = lambda a: jnp.take_along_axis(a, queries[:, :, None], axis=1)    # noqa: E731
    return full_layer.indexer.scores(rows(h), rows(q_resid), queries, keys, jnp.full((x.shape[0],), x.shape[1], jnp.int32))


def definition_reach(model, rows: np.ndarray, spans, first, counts) -> tuple[list[float], list[float]]:
    """rows int32 [R, L + 1] with the definition at spans[r] = (start, end) -> per IndexShare
    group, over the queries that predict the name (positions first[r] .. first[r] + counts[r] -
    1) of all rows: (the share of the definition's tokens in the indexer's top-k, 0 meaning the
    sparse attention never reads the definition there; the median rank among the visible keys
    of the definition's best-scored token, 1 the indexer's first choice: a top-k of at least
    that many would select it)."""
    graphdef, state = nnx.split(model)
    shares, ranks = [], []
    for r, (start, end) in enumerate(spans):
        queries = np.arange(first[r], first[r] + counts[r], dtype=np.int32)[None]
        sel, scores = group_selections(graphdef, state, jnp.asarray(rows[r:r + 1, :-1]), jnp.asarray(queries))
        sel, scores = np.asarray(sel), np.asarray(scores)
        shares.append(((sel >= start) & (sel < end)).sum(axis=-1).mean(axis=(1, 2)) / (end - start))   # [G]
        best = scores[..., start:end].max(axis=-1)                                                     # [G, 1, Q]
        ranks.append((1 + (scores > best[..., None]).sum(axis=-1)).reshape(len(best), -1))             # [G, Q]
    return [float(x) for x in np.mean(shares, axis=0)], [float(x) for x in np.median(np.concatenate(ranks, 1), 1)]


def text_stream(tok, docs, need: int):
    """Token ids of the documents in order, each followed by end-of-text, at least `need` of them
    (the documents repeated if they hold fewer)."""
    eos, ids = eos_id(tok), []
    if len(docs) == 0:
        raise ValueError("no held-out documents")
    i = 0
    while len(ids) < need:
        ids += tok.encode(docs[i % len(docs)]).ids + [eos]
        i += 1
    return np.asarray(ids, np.int32)


def position_rows(stream: np.ndarray, rows: int, length: int) -> np.ndarray:
    """int32 [rows, length + 1]: consecutive cuts of the stream (inputs and targets)."""
    return np.stack([stream[r * (length + 1):(r + 1) * (length + 1)] for r in range(rows)])


def bucket_bits(logp: np.ndarray, bounds: list[int]) -> list[float]:
    """logp float [R, S] (ln p of the target at each position) -> bits per token in
    [0, b0), [b0, b1), ... of `bounds` (the last one = S)."""
    out, lo = [], 0
    for hi in bounds:
        out.append(float(-logp[:, lo:hi].mean() / math.log(2)))
        lo = hi
    return out


def clipped_bounds(buckets: tuple[int, ...], length: int) -> list[int]:
    bounds = sorted({min(b, length) for b in buckets})
    return bounds if bounds[-1] == length else bounds + [length]


def made_up_name(rng: np.random.Generator) -> str:
    a, b = rng.choice(len(_WORDS), 2, replace=False)
    return f"{_WORDS[a]}_{_WORDS[b]}_{rng.integers(16 ** 4):04x}"


def probe_row(tok, filler: np.ndarray, name: str, defined: str, length: int, distance: int):
    """-> (ids int32 [length + 1], first scored target index, count, the definition's token
    span (start, end) in ids): filler text with
    `def DEFINED(v):` ending `distance` tokens before the row's end, and `result = NAME(`
    at the end, NAME's tokens after its first word the scored targets."""
    first, rest = name.split("_", 1)
    definition = np.asarray(tok.encode(DEFINITION.format(defined)).ids, np.int32)
    cue = np.asarray(tok.encode(f"\nresult = {first}_").ids, np.int32)
    answer = np.asarray(tok.encode(rest).ids + tok.encode("(").ids, np.int32)
    tail = len(cue) + len(answer)
    before = length + 1 - distance - len(definition)
    after = distance - tail
    if before < 1 or after < 0:
        raise ValueError(f"--distance {distance} does not fit a row of {length} tokens")
    ids = np.concatenate([filler[:before], definition, filler[before:before + after], cue, answer])
    return ids, length + 1 - len(answer) - 1, len(answer), (before, before + len(definition))


def probe_rows(tok, stream: np.ndarray, count: int, length: int, distance: int, seed: int):
    """-> (ids [count * 2, length + 1], first target, answer lengths, definition spans): for each
    probe a row with its name defined and one with a decoy of the same token count defined instead."""
    rng = np.random.default_rng(seed)
    rows, first_scored, counts, spans = [], [], [], []
    for p in range(count):
        name = made_up_name(rng)
        n = len(tok.encode(DEFINITION.format(name)).ids)
        decoy = made_up_name(rng)
        while decoy.split("_", 1)[0] == name.split("_", 1)[0] or \
                len(tok.encode(DEFINITION.format(decoy)).ids) != n:
            decoy = made_up_name(rng)
        filler = stream[(p * (length + 1)) % max(len(stream) - length - 1, 1):][:length + 1]
        for defined in (name, decoy):
            ids, first, k, span = probe_row(tok, filler, name, defined, length, distance)
            rows.append(ids)
            first_scored.append(first)
            counts.append(k)
            spans.append(span)
    return np.stack(rows), first_scored, counts, spans


def score(model, rows: np.ndarray, chunk: int, batch: int, mode: str = "sparse") -> np.ndarray:
    """rows int32 [R, L + 1] -> ln p of each target, float64 [R, L]."""
    graphdef, state = nnx.split(model)
    out = []
    for b in range(0, len(rows), batch):
        part = rows[b:b + batch]
        out.append(np.asarray(token_logprobs(graphdef, state, jnp.asarray(part[:, :-1]), jnp.asarray(part[:, 1:]),
                                             chunk=chunk, mode=mode), np.float64))
    return np.concatenate(out)


def extended(model, length: int):
    """`model`'s weights with its positions extended to `length` by YaRN, untrained."""
    cfg = extend_context(model.cfg, length)
    graphdef, _ = nnx.split(abstract_model(cfg))
    return nnx.merge(graphdef, nnx.state(model))


def evaluate(path: str, args, extend: bool = False) -> dict:
    model, tok = load_model_dir(path), load_tokenizer(path)
    if extend:
        model = extended(model, args.length)
    length = min(args.length, model.cfg.max_position_embeddings)
    chunk = math.gcd(length, args.chunk)
    docs = heldout_documents(args.heldout)
    stream = text_stream(tok, docs, (max(args.rows, args.probes) + 1) * (length + 1))
    t = time.perf_counter()
    logp = score(model, position_rows(stream, args.rows, length), chunk, args.batch_size, args.attention)
    bounds = clipped_bounds(args.buckets, length)
    name = f"{path} + YaRN to {length}, untrained" if extend else path
    result = {"model": name, "length": length, "bounds": bounds, "bits_per_token": bucket_bits(logp, bounds),
              "rows": args.rows}
    if args.probes:
        result["probe"] = [probe(model, tok, stream, args, length, chunk, d) for d in probe_distances(args.distance, length)]
    result["seconds"] = time.perf_counter() - t
    return result


def probe_distances(distances, length: int) -> list[int]:
    """The probe's distances that a row of `length` tokens holds: each at most 3/4 of it, in
    increasing order, each once."""
    return sorted({min(d, length * 3 // 4) for d in distances})


def probe(model, tok, stream, args, length: int, chunk: int, distance: int) -> dict:
    """The retrieval probe at one distance: mean ln p of the names' tokens with the definition and
    with the control's decoy, their difference (gain, nats), the share of probes it is > 0, and
    per IndexShare group the share of the definition's tokens its indexer selects for the
    queries that predict the name and the median rank of the definition among the keys
    (`definition_reach`)."""
    rows, first, counts, spans = probe_rows(tok, stream, args.probes, length, distance, args.seed)
    lp = score(model, rows, chunk, args.batch_size, args.attention)
    answers = np.array([lp[r, first[r]:first[r] + counts[r]].sum() for r in range(len(rows))])
    with_def, control = answers[0::2], answers[1::2]
    selected, rank = definition_reach(model, rows[0::2], spans[0::2], first[0::2], counts[0::2]) \
        if args.attention == "sparse" else ([], [])
    return {"distance": distance, "probes": args.probes, "probe_logp": float(with_def.mean()),
            "control_logp": float(control.mean()), "gain": float((with_def - control).mean()),
            "found": float((with_def > control).mean()), "definition_selected": selected, "definition_rank": rank}


def _positions(path: str) -> int:
    """The max_position_embeddings of a model directory's config."""
    from glm_jax.config import load_config

    return load_config(f"{path}/config.yaml").max_position_embeddings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=None, help="model directories (default: checkpoints/default)")
    ap.add_argument("--heldout", default=None, help="held-out JSON lines (default: the standard library's split)")
    ap.add_argument("--length", type=int, default=131072, help="tokens per row (clipped to the model's positions)")
    ap.add_argument("--rows", type=int, default=2, help="rows scored for the loss by position")
    ap.add_argument("--buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=BUCKETS,
                    help="upper ends of the position buckets (default 4096,16384,65536,131072)")
    ap.add_argument("--probes", type=int, default=4, help="retrieval probes (each also run as its control)")
    ap.add_argument("--distance", type=int, nargs="+", default=[100_000], metavar="TOKENS",
                    help="tokens from the definition to the row's end; several: the probe at each (default 100000)")
    ap.add_argument("--chunk", type=int, default=4096, help="positions whose logits are made at once")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", choices=("sparse", "dense"), default="sparse",
                    help="sparse: over the indexer's top-k, as the model decodes (default); dense: over every "
                         "earlier key (what the model could do with a perfect selection)")
    ap.add_argument("--untrained-extension", action="store_true",
                    help="also evaluate each model shorter than --length extended to it by YaRN, untrained")
    ap.add_argument("--smoke", action="store_true", help="512-token rows, buckets 128,256,512, distance 384")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cli.choose_platforms()      # before jax starts a backend: no TPU runtime (libtpu) on a host without TPU chips
    if args.smoke:
        args.length, args.buckets, args.distance, args.chunk, args.rows, args.probes = 512, (128, 256, 512), [384], 128, 1, 2
    models = args.model or ["checkpoints/default"]
    print(f"device: {device_kind()}; rows of up to {args.length} tokens", file=sys.stderr)
    results = []
    runs = [(path, False) for path in models]
    if args.untrained_extension:
        runs += [(path, True) for path in models if _positions(path) < args.length]
    for path, extend in runs:
        try:
            results.append(evaluate(path, args, extend))
        except Exception as e:  # noqa: BLE001 - a failed model is a row, the others still run
            results.append({"model": path + (" + YaRN, untrained" if extend else ""), "failed": failure(e)})
        write_json(args.json, {"args": vars(args), "results": results})
    ok = [r for r in results if "failed" not in r]
    if ok:
        bounds = max((r["bounds"] for r in ok), key=len)
        names = [f"{lo // 1024 if lo >= 1024 else lo}{'K' if lo >= 1024 else ''}-"
                 f"{hi // 1024 if hi >= 1024 else hi}{'K' if hi >= 1024 else ''}" for lo, hi in zip([0] + bounds, bounds)]
        table = Table("model", "length", *[f"bits/token {n}" for n in names])
        for r in ok:
            table.row(r["model"], r["length"], *[f"{b:.3f}" for b in r["bits_per_token"]])
        if any(r.get("probe") for r in ok):
            print()
            table = Table("model", "distance", "probes", "ln p(name), defined", "ln p(name), control", "gain (nats)",
                          "defined > control", "definition selected, by group", "its rank (median), by group")
            for r in ok:
                for p in r.get("probe", []):
                    table.row(r["model"], p["distance"], p["probes"], f"{p['probe_logp']:.2f}",
                              f"{p['control_logp']:.2f}", f"{p['gain']:+.2f}", f"{p['found']:.0%}",
                              " / ".join(f"{x:.0%}" for x in p["definition_selected"]),
                              " / ".join(f"{x:,.0f}" for x in p["definition_rank"]))
    for r in results:
        if "failed" in r:
            print(f"{r['model']}: failed: {r['failed']}")
    return 1 if len(ok) < len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
