"""Plain vs MTP speculative decoding of a trained model: tokens/s, acceptance length, speedup.

    python benchmarks/speculative.py --checkpoint checkpoints/default --batch 1 16 --draft 3 7
    python benchmarks/speculative.py --batch 1 4 16 --draft 1 2 3 --temperature 0.7 --repeat 5 \
        --json docs/data/speculative_cpu.json        # the data of glm_jax/decoding/policy.py

Each configuration runs once to compile, then `--repeat` timed rounds; a round times plain
decoding and every speculative configuration one after the other, so load that comes and goes
on a shared machine hits them alike. Printed: the median tokens/s of the rounds and the median
of the per-round speedups. Prompts are the first lines of held-out standard-library files, so
the text is code the model did not train on. Greedy by default: every configuration's tokens
are compared with each prompt decoded alone (plain, batch 1, same mode), and the table says how
many rows differ and at which token; `--batch-invariant` runs every configuration in the
batch-invariant mode too (its cost printed against the default mode), and the run fails if
that mode gives any prompt other tokens. `--temperature T` samples instead, `--kv-share-ablation`
adds runs with KVShare off. `--json FILE` writes the rows (every round's tokens/s too).

The physical limit printed beside plain decoding: a decode step must read every weight and the
KV it attends, so tokens/s <= batch x copy bandwidth / (weight bytes + KV bytes read per step),
with the device's copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks._report import Table, write_json
from glm_jax import ops
from glm_jax.checkpoint import load_model_dir
from glm_jax.data import corpus
from glm_jax.data.tokenizer import load_tokenizer
from glm_jax.decoding.generate import Generator
from glm_jax.decoding.programs import compiler_options
from glm_jax.decoding.sampling import SamplingParams
from glm_jax.decoding.speculative import SpeculativeGenerator
from glm_jax.forward_options import ForwardOptions


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


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write), median of 10."""
    n = (256 if jax.default_backend() != "cpu" else 32) * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / float(np.median(times))


def bytes_per_step(model, batch: int, context: int) -> int:
    """Weights (all of them) plus, per sequence, the latent rows attended on every layer and the
    indexer keys scanned on Full layers, at the given context."""
    cfg = model.cfg
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
    item = jnp.dtype(cfg.dtype).itemsize
    kv = (cfg.num_hidden_layers * min(cfg.index_topk, context) * cfg.latent_dim
          + len(cfg.full_layers) * context * cfg.index_head_dim) * item
    return weights + batch * kv


def timed(fn) -> float:
    """Seconds of one call of fn()."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def differing(out: np.ndarray, ref: np.ndarray) -> list[tuple[int, int]]:
    """[(row, first differing token)] of out against ref (int [B, N] each; -1 past a stop)."""
    return [(i, int(np.argmax(a != b))) for i, (a, b) in enumerate(zip(out, ref)) if not np.array_equal(a, b)]


def describe(diffs: list[tuple[int, int]], rows: int) -> str:
    """'0/8', or '2/8 (rows 1@13 4@21)': rows differing and where (row@first token)."""
    where = " ".join(f"{i}@{t}" for i, t in diffs[:6]) + (" ..." if len(diffs) > 6 else "")
    return f"{len(diffs)}/{rows}" + (f" ({where})" if diffs else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/default")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--draft", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=1, help="timed rounds (medians are printed)")
    ap.add_argument("--kv-share-ablation", action="store_true", help="also run with KVShare off")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="run every configuration in batch-invariant mode too (KernelChoice.batch_invariant), "
                         "in the same rounds; its cost is its tokens/s against the default mode's")
    ap.add_argument("--invariant-rows", type=int, nargs="+", default=None, metavar="N",
                    help="with --batch-invariant: one batch-invariant mode per chunk size N (tokens per chunk, "
                         "KernelChoice.invariant_rows; default: the backend's)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="on a GPU, compile the generators' programs as CUDA graphs, loops included "
                         "(Generator(cuda_graphs=True))")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    model = load_model_dir(args.checkpoint)
    tok = load_tokenizer(args.checkpoint)
    max_len = args.prompt_len + args.new_tokens + 64
    bandwidth = copy_bandwidth()
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    device = jax.devices()[0].device_kind
    modes = {"default": ForwardOptions()}
    if args.invariant_rows and not args.batch_invariant:
        ap.error("--invariant-rows needs --batch-invariant")
    if args.invariant_rows and min(args.invariant_rows) < 1:
        ap.error(f"--invariant-rows must be positive, got {args.invariant_rows}")
    if args.batch_invariant:
        for n in args.invariant_rows or [None]:
            name = "batch-invariant" if n is None else f"batch-invariant, {n} rows"
            modes[name] = ForwardOptions(kernels=ops.KernelChoice(batch_invariant=True, invariant_rows=n))
    print(f"device {device}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; model {model.cfg.name}; prompt "
          f"{args.prompt_len} tokens; {args.new_tokens} new tokens per sequence; {mode}; median of "
          f"{args.repeat} round(s); modes: {', '.join(modes)}; CUDA graphs "
          f"{'on' if compiler_options(jax.default_backend(), args.cuda_graphs) else 'off'}")
    greedy = args.temperature == 0
    table = Table("batch", "mode", "decoding", "tokens/s", "acceptance length", "accept rate per draft position",
                  "speedup", "cost of the mode", "rows differing from each prompt alone")
    rows, failures = [], []
    sampling = dict(max_new_tokens=args.new_tokens, sampling=SamplingParams(temperature=args.temperature))
    ids_all = prompts(tok, max(args.batch), args.prompt_len)
    alone = {name: alone_tokens(model, ids_all, max_len, forward, sampling) if greedy else None
             for name, forward in modes.items()}
    for batch in args.batch:
        ids = ids_all[:batch]
        runs = {}                                              # (mode, k, kv_share) -> generator; k 0: plain
        for name, forward in modes.items():
            runs[(name, 0, True)] = Generator(model, batch=batch, max_len=max_len, prefill_chunk=64, block_size=16,
                                              forward=forward, cuda_graphs=args.cuda_graphs)
            for k in args.draft:
                for kv_share in (True, False) if args.kv_share_ablation else (True,):
                    runs[(name, k, kv_share)] = SpeculativeGenerator(model, batch=batch, max_len=max_len,
                                                                     num_draft=k, prefill_chunk=64,
                                                                     kv_share=kv_share, forward=forward,
                                                                     cuda_graphs=args.cuda_graphs)
        first = {c: generate(gen, ids, sampling, args.new_tokens) for c, gen in runs.items()}  # compiles
        diffs = {c: differing(tokens, alone[c[0]][:batch]) for c, tokens in first.items()} if greedy else {}
        rates = {c: [] for c in runs}
        for _ in range(args.repeat):
            for c, gen in runs.items():
                generate(gen, ids, sampling, args.new_tokens)
                decode_s = gen.stats.decode_s
                rates[c].append(batch * args.new_tokens / decode_s)
        limit = batch * bandwidth / bytes_per_step(model, batch, args.prompt_len + args.new_tokens)
        for c, gen in runs.items():
            name, k, kv_share = c
            rate = float(np.median(rates[c]))
            speedup = float(np.median(np.asarray(rates[c]) / np.asarray(rates[(name, 0, True)])))
            cost = float(np.median(np.asarray(rates[c]) / np.asarray(rates[("default", k, kv_share)])))
            differ = describe(diffs[c], batch) if greedy else "-"
            row = dict(batch=batch, mode=name, draft=k, kv_share=kv_share, tokens_per_s=rate, rounds=rates[c],
                       speedup=speedup, tokens_per_s_vs_default_mode=cost,
                       rows_differing=[list(d) for d in diffs.get(c, [])])
            if k == 0:
                table.row(batch, name, "plain", f"{rate:.1f}", "1.00", "-", "1.00x", f"{cost:.2f}x", differ)
                row.update(decoding="plain", limit_tokens_per_s=limit)
            else:
                s = gen.stats
                accept = " ".join(f"{r:.2f}" for r in s.acceptance_rate)
                label = f"speculative K={k}" + ("" if kv_share else ", KVShare off")
                table.row(batch, name, label, f"{rate:.1f}", f"{s.acceptance_length:.2f}", accept,
                          f"{speedup:.2f}x", f"{cost:.2f}x", differ)
                row.update(decoding=label, acceptance_length=s.acceptance_length)
            rows.append(row)
            if name.startswith("batch-invariant") and diffs.get(c):
                failures.append(f"batch {batch} {row['decoding']}: {describe(diffs[c], batch)}")
        table.row(batch, "", "limit: copy bandwidth / bytes read per step", f"{limit:.0f}")
    write_json(args.json, dict(device=device, backend=jax.default_backend(), checkpoint=args.checkpoint,
                               prompt_len=args.prompt_len, new_tokens=args.new_tokens, temperature=args.temperature,
                               repeat=args.repeat, modes=list(modes), cuda_graphs=args.cuda_graphs, rows=rows))
    if failures:
        raise SystemExit("batch-invariant mode gave a prompt other tokens than alone: " + "; ".join(failures))


def generate(gen, ids: np.ndarray, sampling: dict, new_tokens: int) -> np.ndarray:
    """int [B, new_tokens] from a plain or speculative generator."""
    if isinstance(gen, SpeculativeGenerator):
        return gen.generate(ids, **sampling)
    return np.concatenate(list(gen.generate(ids, **sampling)), axis=1)[:, :new_tokens]


def alone_tokens(model, ids: np.ndarray, max_len: int, forward, sampling: dict) -> np.ndarray:
    """int [B, N]: each prompt's tokens decoded by itself (plain decoding, batch 1)."""
    gen = Generator(model, batch=1, max_len=max_len, prefill_chunk=64, block_size=16, forward=forward)
    return np.concatenate([generate(gen, row[None], sampling, sampling["max_new_tokens"]) for row in ids])


if __name__ == "__main__":
    main()
