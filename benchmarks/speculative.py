"""Plain vs MTP speculative decoding of a trained model: tokens/s, acceptance length, speedup.

    python benchmarks/speculative.py --checkpoint checkpoints/default --batch 1 16 --draft 3 7
    python benchmarks/speculative.py --batch 1 4 16 --draft 1 2 3 --temperature 0.7 --repeat 5 \
        --json docs/data/speculative_cpu.json        # the data of glm_jax/decoding/policy.py

Each configuration runs once to compile, then `--repeat` timed rounds; a round times plain
decoding and every speculative configuration one after the other, so load that comes and goes
on a shared machine hits them alike. Printed: the median tokens/s of the rounds and the median
of the per-round speedups. Prompts are the first lines of held-out standard-library files, so
the text is code the model did not train on. Greedy by default (speculative output is checked
to equal plain output); `--temperature T` samples instead, `--kv-share-ablation` adds runs with
KVShare off. `--json FILE` writes the rows (every round's tokens/s too).

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
from glm_jax.checkpoint import load_model_dir
from glm_jax.data import corpus
from glm_jax.data.tokenizer import load_tokenizer
from glm_jax.decoding.generate import Generator
from glm_jax.decoding.sampling import SamplingParams
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
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    model = load_model_dir(args.checkpoint)
    tok = load_tokenizer(args.checkpoint)
    max_len = args.prompt_len + args.new_tokens + 64
    bandwidth = copy_bandwidth()
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    device = jax.devices()[0].device_kind
    print(f"device {device}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; model {model.cfg.name}; prompt "
          f"{args.prompt_len} tokens; {args.new_tokens} new tokens per sequence; {mode}; median of "
          f"{args.repeat} round(s)")
    table = Table("batch", "decoding", "tokens/s", "acceptance length", "accept rate per draft position", "speedup")
    rows = []
    sampling = dict(max_new_tokens=args.new_tokens, sampling=SamplingParams(temperature=args.temperature))
    for batch in args.batch:
        ids = prompts(tok, batch, args.prompt_len)
        plain = Generator(model, batch=batch, max_len=max_len, prefill_chunk=64, block_size=16)

        def run_plain():
            out = np.concatenate(list(plain.generate(ids, **sampling)), axis=1)
            return out[:, :args.new_tokens]

        ref = run_plain()                                      # compiles
        specs = {}
        for k in args.draft:
            for kv_share in (True, False) if args.kv_share_ablation else (True,):
                spec = SpeculativeGenerator(model, batch=batch, max_len=max_len, num_draft=k, prefill_chunk=64,
                                            kv_share=kv_share)
                out = spec.generate(ids, **sampling)           # compiles
                if args.temperature == 0:
                    assert np.array_equal(out, ref), "greedy speculative decoding must equal greedy plain decoding"
                specs[(k, kv_share)] = spec
        plain_rates, spec_rates = [], {c: [] for c in specs}
        for _ in range(args.repeat):
            plain_rates.append(batch * args.new_tokens / (timed(run_plain) - plain.stats["prefill_s"]))
            for c, spec in specs.items():
                spec.generate(ids, **sampling)
                spec_rates[c].append(batch * args.new_tokens / spec.stats.decode_s)
        plain_rate = float(np.median(plain_rates))
        limit = batch * bandwidth / bytes_per_step(model, batch, args.prompt_len + args.new_tokens)
        table.row(batch, "plain", f"{plain_rate:.1f}", "1.00", "-", "1.00x")
        table.row(batch, "limit: copy bandwidth / bytes read per step", f"{limit:.0f}")
        rows.append(dict(batch=batch, decoding="plain", draft=0, tokens_per_s=plain_rate, rounds=plain_rates,
                         speedup=1.0, limit_tokens_per_s=limit))
        for (k, kv_share), spec in specs.items():
            s = spec.stats
            rate = float(np.median(spec_rates[(k, kv_share)]))
            speedup = float(np.median(np.asarray(spec_rates[(k, kv_share)]) / np.asarray(plain_rates)))
            rates = " ".join(f"{r:.2f}" for r in s.acceptance_rate)
            name = f"speculative K={k}" + ("" if kv_share else ", KVShare off")
            table.row(batch, name, f"{rate:.1f}", f"{s.acceptance_length:.2f}", rates, f"{speedup:.2f}x")
            rows.append(dict(batch=batch, decoding=name, draft=k, kv_share=kv_share, tokens_per_s=rate,
                             rounds=spec_rates[(k, kv_share)], acceptance_length=s.acceptance_length,
                             speedup=speedup))
    write_json(args.json, dict(device=device, backend=jax.default_backend(), checkpoint=args.checkpoint,
                               prompt_len=args.prompt_len, new_tokens=args.new_tokens, temperature=args.temperature,
                               repeat=args.repeat, rows=rows))


if __name__ == "__main__":
    main()
