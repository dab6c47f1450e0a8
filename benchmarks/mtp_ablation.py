"""The published MTP ablation on our model: acceptance length over 7 draft steps, row by row.

    PYTHONPATH=. python3 benchmarks/mtp_ablation.py --smoke --json docs/data/mtp_ablation_cpu_smoke.json
    PYTHONPATH=. python3 benchmarks/mtp_ablation.py --checkpoint runs/default-py --prompts 64 \
        --finetune-steps 1000 --train-depth 7 --json mtp_ablation.json         # a trained model, on a GPU
    PYTHONPATH=. python3 benchmarks/plot.py mtp_ablation mtp_ablation.json mtp_ablation.svg

Rows, as GLM-5.2 published them (acceptance length on coding prompts, 7 draft steps):
  (a) base MTP: an MTP layer trained without KVShare (its depths >= 2 compute their own KV and
      top-k), drafting without KVShare (each draft step runs the MTP indexer over target + draft
      KV), verified by the base rule: a draft is accepted iff it equals the token sampled from
      the target at its position (`glm_jax.decoding.rejection.match_sample`)
  (b) + IndexShare + KVShare: an MTP layer trained with KVShare; drafting with KVShare (steps
      2..K reuse step 1's top-k and read only target KV); the base rule
  (c) + rejection sampling: (b) verified by exact rejection sampling (accept with probability
      min(1, p/q)); at temperature 0 both rules are greedy matching, so (c) equals (b) there
  (d) + end-to-end TV loss: an MTP layer trained with KVShare and the end-to-end TV loss; as (c)
Every trained variant fine-tunes only the MTP layer, starting from the checkpoint's, on the same
batches of the training split, with the backbone (embedding, decoder layers, head) frozen and
shared. Prompts are the first --prompt-len tokens of held-out files (the standard library's
held-out split, or --heldout JSON lines such as scripts/build_python_corpus.py writes), one per
file, decoded together; each prompt's acceptance length (1 + accepted drafts per verify step)
is one sample of the spread (mean, standard deviation, quartiles).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from flax import nnx

from benchmarks._heldout import heldout_prompts
from benchmarks._report import device_kind, write_json
from glm_jax import ops
from glm_jax.checkpoint import load_model_dir
from glm_jax.data import corpus, pipeline, sources
from glm_jax.data.tokenizer import load_tokenizer
from glm_jax.decoding.runtime import committed
from glm_jax.decoding.sampling import SamplingParams
from glm_jax.decoding.speculative import SpeculativeGenerator
from glm_jax.forward_options import ForwardOptions
from glm_jax.training.step import Batch, LossWeights, OptimizerConfig, StepConfig, train_step_program

PUBLISHED = {"a": 4.56, "b": 5.10, "c": 5.29, "d": 5.47}
METHODS = {"a": "base MTP", "b": "+ IndexShare + KVShare", "c": "+ rejection sampling", "d": "+ end-to-end TV loss"}
#: row -> (trained MTP layer, drafting with KVShare, verification rule)
ROWS = {"a": ("no KVShare", False, "match"), "b": ("KVShare", True, "match"), "c": ("KVShare", True, "rejection"),
        "d": ("KVShare + TV", True, "rejection")}
MTP_PARAMS = nnx.All(nnx.Param, nnx.PathContains("mtp"))


def finetune_mtp(model, docs, tok, weights: LossWeights, args) -> tuple[nnx.State, list[float]]:
    """The model's MTP parameters after --finetune-steps steps on `docs` with the backbone frozen
    (the same batches for every call) -> (MTP params, loss of each step)."""
    graphdef, params, rest = nnx.split(model, MTP_PARAMS, ...)
    optimizer = OptimizerConfig(args.lr, args.finetune_steps, max(1, args.finetune_steps // 10))
    tx = optimizer.tx
    config = StepConfig(optimizer, forward=ForwardOptions(mode="sparse", form="expanded", kernels=ops.KernelChoice()),
                        weights=weights)
    params = committed(jax.tree.map(lambda x: x.copy(), params))   # train_step donates them
    opt_state = committed(tx.init(params))     # as train_step's outputs are: else it compiles twice
    batches = pipeline.PackedBatches(docs, pipeline.token_encoder(tok), seq_len=args.seq_len,
                                     batch_size=args.batch_size, seed=0)
    losses = []
    for step in range(1, args.finetune_steps + 1):
        b = next(batches)
        params, opt_state, terms = train_step_program(graphdef, params, rest, opt_state,
                                                      Batch(b.inputs, b.targets, b.segment_ids), config=config)
        losses.append(float(terms["mtp"] + terms.get("mtp_tv", 0.0) * weights.tv))
        if step == 1 or step % max(1, args.finetune_steps // 5) == 0 or step == args.finetune_steps:
            print(f"  fine-tuning step {step}/{args.finetune_steps}: MTP loss {losses[-1]:.3f}", flush=True)
    return params, losses


def spread(values: np.ndarray) -> dict:
    q25, median, q75 = np.percentile(values, [25, 50, 75])
    return dict(mean=float(values.mean()), std=float(values.std()), q25=float(q25), median=float(median),
                q75=float(q75))


def paired_gains(rows: list[dict], temperature: float) -> list[str]:
    """Markdown rows: each ablation step's gain in acceptance length, as the mean of the per-prompt
    differences (the same prompts in every row) ± its standard error, and on how many prompts the
    later row was longer."""
    by_row = {r["row"]: np.asarray(r["per_prompt"]) for r in rows if r["temperature"] == temperature}
    out = []
    for before, after in (("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")):
        diff = by_row[after] - by_row[before]
        sem = diff.std() / np.sqrt(diff.size)
        verdict = "yes" if diff.mean() > sem else "no"
        out.append(f"| {before} -> {after} | {temperature} | {diff.mean():+.2f} ± {sem:.2f} | {verdict} | "
                   f"{int((diff > 0).sum())} of {diff.size} |")
    return out


def print_gains(rows: list[dict], temperatures) -> None:
    print("| step | T | gain (paired mean ± standard error) | gain > its spread | prompts where it helped |")
    print("|---|---|---|---|---|")
    for t in temperatures:
        print("\n".join(paired_gains(rows, t)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/default")
    ap.add_argument("--heldout", default=None, help="held-out documents, JSON lines (default: the stdlib split)")
    ap.add_argument("--train-data", default=None,
                    help="fine-tuning documents, JSON lines (default: the stdlib split)")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft", type=int, default=7)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--finetune-steps", type=int, default=300)
    ap.add_argument("--train-depth", type=int, default=3, help="MTP depths trained (shared parameters)")
    ap.add_argument("--tv-weight", type=float, default=1.0)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--smoke", action="store_true",
                    help="a quick CPU check: 8 prompts of 32 tokens, 16 new tokens, 2 fine-tuning steps of "
                         "4 x 64 tokens at depth 2")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--gains-of", default=None, metavar="JSON",
                    help="only print the paired gains of an earlier run's --json file")
    args = ap.parse_args(argv)
    if args.gains_of:
        saved = json.loads(open(args.gains_of).read())
        print_gains(saved["rows"], sorted({r["temperature"] for r in saved["rows"]}))
        return
    if args.smoke:
        args.prompts, args.prompt_len, args.new_tokens = 8, 32, 16
        args.finetune_steps, args.train_depth, args.seq_len, args.batch_size = 2, 2, 64, 4
    t_start = time.perf_counter()
    model = load_model_dir(args.checkpoint)
    tok = load_tokenizer(args.checkpoint)
    ids = heldout_prompts(tok, args.prompts, args.prompt_len, args.heldout)
    train_docs = sources.open_documents([args.train_data]) if args.train_data else sources.TextFiles(
        corpus.split_files(corpus.stdlib_source_files())[0])

    trained, finetune = {}, {}
    for name, kv_share, tv in (("no KVShare", False, 0.0), ("KVShare", True, 0.0),
                               ("KVShare + TV", True, args.tv_weight)):
        weights = LossWeights(mtp=1.0, mtp_depth=args.train_depth, kv_share=kv_share, tv=tv)
        print(f"MTP layer '{name}' ({time.perf_counter() - t_start:.0f} s)", flush=True)
        trained[name], losses = finetune_mtp(model, train_docs, tok, weights, args)
        finetune[name] = dict(kv_share=kv_share, tv_weight=tv, first_loss=losses[0], last_loss=losses[-1])

    t_decode = time.perf_counter()
    max_len = args.prompt_len + args.new_tokens + 2 * (args.draft + 1)
    rows, compile_s = [], 0.0
    for temperature in args.temperature:
        sampling = SamplingParams(temperature=temperature)
        for row, (layer, kv_share, rule) in ROWS.items():
            nnx.update(model, trained[layer])
            print(f"decoding row {row} ({METHODS[row]}) at T={temperature} "
                  f"({time.perf_counter() - t_start:.0f} s)", flush=True)
            gen = SpeculativeGenerator(model, batch=len(ids), max_len=max_len, num_draft=args.draft,
                                       kv_share=kv_share, verification=rule, prefill_chunk=64)
            gen.generate(ids, max_new_tokens=args.new_tokens, sampling=sampling, seed=0)
            lengths, compile_s = gen.stats.acceptance_lengths, compile_s + gen.stats.compile_s
            rows.append(dict(row=row, method=METHODS[row], mtp_layer=layer, kv_share=kv_share, verification=rule,
                             temperature=temperature, published=PUBLISHED[row], per_prompt=lengths.tolist(),
                             **spread(lengths)))
        if temperature == 0:
            b, c = (r["per_prompt"] for r in rows[-3:-1])
            assert b == c, "at temperature 0 rejection sampling and the base rule are both greedy matching"

    kind = "SMOKE numbers (a few fine-tuning steps, few prompts: a check that it runs, not a result)" \
        if args.smoke else "measured"
    print(f"{kind}; device {jax.devices()[0].device_kind}; checkpoint {args.checkpoint}; {len(ids)} held-out "
          f"prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens, {args.draft} draft steps; MTP "
          f"layer fine-tuned alone (backbone frozen, shared) for {args.finetune_steps} steps of "
          f"{args.batch_size} x {args.seq_len} tokens at depth {args.train_depth}; fine-tuning "
          f"{t_decode - t_start:.0f} s, decoding {time.perf_counter() - t_decode:.0f} s (of which compiling the "
          f"decode programs {compile_s:.0f} s)")
    temps = args.temperature
    print("| row | method | published (GLM-5.2) | "
          + " | ".join(f"ours, T={t}: mean ± std [IQR]" for t in temps) + " |")
    print("|---|---|---|" + "---|" * len(temps))
    for row in ROWS:
        cells = [next(r for r in rows if r["row"] == row and r["temperature"] == t) for t in temps]
        print(f"| {row} | {METHODS[row]} | {PUBLISHED[row]:.2f} | " + " | ".join(
            f"{c['mean']:.2f} ± {c['std']:.2f} [{c['q25']:.2f}, {c['q75']:.2f}]" for c in cells) + " |")
    print_gains(rows, temps)
    for name, f in finetune.items():
        print(f"fine-tuned MTP layer '{name}': loss {f['first_loss']:.3f} -> {f['last_loss']:.3f}")
    write_json(args.json, dict(smoke=args.smoke, device=device_kind(), checkpoint=args.checkpoint,
                               prompts=len(ids), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                               draft=args.draft, finetune_steps=args.finetune_steps, train_depth=args.train_depth,
                               seq_len=args.seq_len, batch_size=args.batch_size, finetune=finetune, rows=rows))


if __name__ == "__main__":
    main()
