"""The default recipe's train step: the step alone per stage and form, its parts beside their
limits, and train.py's steady loop on the same batch shape.

    PYTHONPATH=. python3 benchmarks/train_step_parts.py steps --json OUT/steps.json [--variants dense:absorbed ...]
    PYTHONPATH=. python3 benchmarks/train_step_parts.py steps --params checkpoints/default --json OUT/steps-trained.json
    PYTHONPATH=. python3 benchmarks/train_step_parts.py parts --json OUT/parts.json
    PYTHONPATH=. python3 benchmarks/train_step_parts.py loop --json OUT/loop.json --run-dir runs/loop
    PYTHONPATH=. python3 benchmarks/train_step_parts.py table OUT          # the markdown of docs/training.md
    ... --smoke                                                            # tiny sizes, CPU

The recipe is scripts/gpu_default_model.sh's: configs/default-py.yaml, 16 x 4096 packed
tokens, --remat, MTP depth 3 (weight 0.3), end-to-end TV 0.5, indexer weight 1. `--dense-kl
pallas_gpu` (and the parts' Pallas KL rows) run the Pallas GPU kernels of
lab/dense_indexer_kl_gpu.py, registered as that impl for the run.

* steps: one optimizer step (`train_step`) on one packed batch of the Python standard library,
  timed alone (median of --reps calls after the compiling one, each ended by
  block_until_ready), for each stage:form variant, each in its own process so that its peak
  memory is its own.
* parts: each part of the step, forward + backward, in the old form (as the step ran before)
  and the new, beside the part's limit: max(matmul FLOPs / the measured bf16 matmul rate,
  bytes it must move / the measured copy bandwidth), both measured in the same run.
* loop: train.py itself on the same shape (dense steps then sparse steps), its logged tokens/s
  over the steady steps, against the step alone from `steps` (same stage and form).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._report import child_failure, device_kind, write_json
from benchmarks._traces import summarize

RECIPE = dict(config="configs/default-py.yaml", seq_len=4096, batch_size=16, mtp_depth=3, mtp_weight=0.3,
              tv_weight=0.5, lr=1e-3, warmup_steps=200, steps=4000)
SMOKE = dict(RECIPE, config="configs/tiny.yaml", seq_len=128, batch_size=2, mtp_depth=2)
TRACED_STEPS = 2
VARIANTS = ("dense:expanded", "dense:absorbed", "sparse:expanded", "sparse:absorbed")


# ---------------------------------------------------------------------------------- data
def real_batch(recipe: dict, vocab_size: int, seed: int = 0, data: str | None = None, tokenizer_dir: str | None = None):
    """One packed batch (pipeline.Batch, int32 [B, L]): of `data` (documents as train.py --data
    reads them) or else the standard library's source, tokenised by `tokenizer_dir`'s tokenizer
    or else a BPE trained on a slice of the documents (cached in runs/)."""
    from glm_jax.data import corpus, pipeline, sources
    from glm_jax.data import tokenizer as tok_lib

    if data:
        docs = sources.open_documents([data])
    else:
        files, _ = corpus.split_files(corpus.stdlib_source_files(), seed=seed)
        docs = sources.TextFiles(files)
    cache = Path(tokenizer_dir) if tokenizer_dir else Path("runs") / f"bench-tokenizer-{vocab_size}"
    if not tokenizer_dir and not (cache / "tokenizer.json").exists():
        cache.mkdir(parents=True, exist_ok=True)
        tok_lib.save_tokenizer(tok_lib.train_bpe((docs[i] for i in range(min(len(docs), 2000))),
                                                 vocab_size=vocab_size), cache)
    tok = tok_lib.load_tokenizer(cache)
    batches = pipeline.PackedBatches(docs, pipeline.token_encoder(tok), seq_len=recipe["seq_len"],
                                     batch_size=recipe["batch_size"], seed=seed)
    return next(batches)


# ---------------------------------------------------------------------------------- steps
def time_step(variant: str, recipe: dict, reps: int, smoke: bool, trace_dir: str | None = None,
              dense_kl: str = "xla", params_dir: str | None = None, data: str | None = None,
              max_segments: int | None = None) -> dict:
    """ms per `train_step` of one stage:form variant, its MFU and the process's peak memory;
    with `trace_dir`, two more steps traced by the JAX profiler into it. params_dir: start from
    that model directory's weights (and its config, in place of the recipe's) and batch with
    its tokenizer; data: the batch's documents; max_segments: the dense absorbed step's static
    segment bound in place of the batch's own (train.py's grows with the data it has seen)."""
    from flax import nnx

    from glm_jax import costs, ops
    from glm_jax.config import load_config
    from glm_jax.forward_options import ForwardOptions
    from glm_jax.layers.segments import count_segments, segment_bound
    from glm_jax.model import GLMModel, params_by_part
    from glm_jax.training.metrics import memory_in_use
    from glm_jax.training.step import Batch, LossWeights, OptimizerConfig, StepConfig, train_step_program

    stage, form = variant.split(":")
    if params_dir:
        from glm_jax.checkpoint import load_model_dir

        model = load_model_dir(params_dir)
        cfg = model.cfg
    else:
        cfg = load_config(recipe["config"])
        model = GLMModel(cfg, rngs=nnx.Rngs(0))
    active = costs.active_params(cfg, params_by_part(model))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    del model
    optimizer = OptimizerConfig(recipe["lr"], recipe["steps"], recipe["warmup_steps"])
    opt_state = optimizer.tx.init(params)
    batch = real_batch(recipe, cfg.vocab_size, data=data, tokenizer_dir=params_dir)
    weights = LossWeights(indexer=1.0, mtp=recipe["mtp_weight"], mtp_depth=recipe["mtp_depth"],
                          tv=recipe["tv_weight"])
    kernels = ops.KernelChoice(interpret=smoke, dense_indexer_kl=dense_kl)
    if (stage, form) != ("dense", "absorbed"):
        max_segments = None
    elif max_segments is None:
        max_segments = segment_bound(count_segments(batch.segment_ids))
    inputs, targets, segments = (jnp.asarray(a) for a in (batch.inputs, batch.targets, batch.segment_ids))

    config = StepConfig(optimizer, forward=ForwardOptions(mode=stage, form=form, kernels=kernels, remat=True,
                                                          max_segments=max_segments), weights=weights)

    def run(p, o):
        return train_step_program(graphdef, p, rest, o, Batch(inputs, targets, segments), config=config)

    t = time.perf_counter()
    params, opt_state, terms = run(params, opt_state)
    jax.block_until_ready(terms)
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        params, opt_state, terms = run(params, opt_state)
        jax.block_until_ready(terms)
        times.append(time.perf_counter() - t)
    if trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(TRACED_STEPS):
                params, opt_state, terms = run(params, opt_state)
            jax.block_until_ready(terms)
    step_s = float(np.median(times)) if times else float("nan")
    tokens = batch.inputs.size
    flops = costs.training_flops_per_token(cfg, recipe["seq_len"], active, sparse=stage == "sparse",
                                           positions=batch.positions) * tokens
    return dict(variant=variant if dense_kl == "xla" else f"{variant}+kl:{dense_kl}",
                params=params_dir or "initialisation", data=data or "standard library",
                step_ms=step_s * 1e3, first_step_s=first, tokens_per_s=tokens / step_s,
                model_tflops=flops / 1e12, peak_gib=memory_in_use() / 2**30, loss=float(terms["loss"]),
                max_segments=max_segments)


def steps_main(args, recipe: dict) -> None:
    """Each variant in a child process (`--one VARIANT`): its own peak memory, one failure alone."""
    rows = []
    for variant in args.variants:
        cmd = [sys.executable, __file__, "steps", "--one", variant, "--reps", str(args.reps),
               "--dense-kl", args.dense_kl] + _batch_flags(args)
        print(f"== step {variant}", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
        if done.returncode or not lines:
            rows.append(dict(variant=variant, failed=child_failure(done.stderr, done.returncode)))
        else:
            rows.append(json.loads(lines[-1]))
        print(json.dumps(rows[-1]), flush=True)
        write_json(args.json, dict(device=device_kind(), recipe=recipe, rows=rows))
    if args.profile:
        for variant in args.variants:
            profile_variant(variant, args)


def _batch_flags(args) -> list[str]:
    """The flags a `steps --one` child needs to time the same model state and batch."""
    flags = ["--smoke"] if args.smoke else []
    for flag, value in (("--params", args.params), ("--data", args.data), ("--max-segments", args.max_segments)):
        flags += [flag, str(value)] if value is not None else []
    return flags


def profile_variant(variant: str, args) -> None:
    """Two steps of `variant` traced in a child process with XLA command buffers off (so each
    kernel is its own device event) into runs/step-traces/<variant>/, summarized into
    PROFILE/<variant>.txt."""
    name = (variant.replace(":", "-") + ("" if args.dense_kl == "xla" else f"-kl-{args.dense_kl}")
            + ("-trained" if args.params else ""))
    trace_dir = Path("runs/step-traces") / name
    cmd = [sys.executable, __file__, "steps", "--one", variant, "--reps", "0", "--trace-dir", str(trace_dir),
           "--dense-kl", args.dense_kl] + _batch_flags(args)
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip())
    print(f"== profile {variant}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    if done.returncode:
        print(f"profile of {variant} failed: {child_failure(done.stderr, done.returncode)}", flush=True)
        return
    try:
        text = summarize(str(trace_dir), steps=TRACED_STEPS)
    except ValueError as e:
        print(f"profile of {variant}: {e}", flush=True)
        return
    Path(args.profile).mkdir(parents=True, exist_ok=True)
    (Path(args.profile) / f"{name}.txt").write_text(text + "\n")
    print(text, flush=True)


# ---------------------------------------------------------------------------------- loop
def loop_main(args, recipe: dict) -> None:
    """train.py on the recipe's shape, once per --prefetch-batches value: --loop-dense dense steps
    then --loop-sparse sparse steps, logged every --log-every; the steady rate of a stage is the
    median tokens/s of its logged steps after the first of that stage (which holds its
    compilation)."""
    rows, runs = [], []
    for depth in args.prefetch_batches:
        run_dir = Path(args.run_dir) / f"prefetch-{depth}"
        shutil.rmtree(run_dir, ignore_errors=True)
        steps = args.loop_dense + args.loop_sparse
        cmd = [sys.executable, "train.py", "--config", recipe["config"], "--out", str(run_dir),
               "--seq-len", str(recipe["seq_len"]), "--batch-size", str(recipe["batch_size"]), "--remat",
               "--steps", str(steps), "--dense-steps", str(args.loop_dense), "--lr", str(recipe["lr"]),
               "--warmup-steps", str(recipe["warmup_steps"]), "--mtp-depth", str(recipe["mtp_depth"]),
               "--mtp-weight", str(recipe["mtp_weight"]), "--tv-weight", str(recipe["tv_weight"]),
               "--log-every", str(args.log_every), "--eval-every", str(10 * steps), "--save-every", str(10 * steps),
               "--attention-form", args.form, "--prefetch-batches", str(depth)]
        if args.smoke:
            cmd += ["--max-files", "40", "--eval-batches", "1"]
        print("== train.py:", " ".join(cmd), flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t = time.perf_counter()
        done = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
        wall = time.perf_counter() - t
        print(done.stdout[-4000:], done.stderr[-2000:] if done.returncode else "", flush=True)
        records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()] \
            if (run_dir / "metrics.jsonl").exists() else []
        for stage in ("dense", "sparse"):
            rates = [r["tokens_per_s"] for r in records if r.get("stage") == stage and "tokens_per_s" in r][1:]
            rows.append(dict(stage=stage, form=args.form, prefetch=depth, logged=len(rates),
                             tokens_per_s=float(np.median(rates)) if rates else None,
                             step_ms=recipe["seq_len"] * recipe["batch_size"] / np.median(rates) * 1e3
                             if rates else None))
        runs.append(dict(command=" ".join(cmd), returncode=done.returncode, wall_s=wall))
        write_json(args.json, dict(device=device_kind(), recipe=recipe, runs=runs, rows=rows))
        print(json.dumps(rows[-2:]), flush=True)


# ---------------------------------------------------------------------------------- parts
def parts_main(args, recipe: dict) -> None:
    from benchmarks import _train_parts

    _train_parts.main(args, recipe)


# ---------------------------------------------------------------------------------- table
def table_main(args) -> None:
    """Markdown of what `steps` (steps*.json), `parts` (parts.json) and `loop` (loop.json) wrote
    into args.dir."""
    d = Path(args.dir)
    load = lambda name: json.loads((d / name).read_text()) if (d / name).exists() else None
    step_files = sorted(d.glob("steps*.json"))
    steps = None
    if step_files:                      # several `steps` runs (e.g. one per command) as one table
        runs = [json.loads(f.read_text()) for f in step_files]
        steps = dict(runs[0], rows=[r for run in runs for r in run["rows"]])
    parts, loop = load("parts.json"), load("loop.json")
    out = []
    device = next((x["device"] for x in (steps, parts, loop) if x), "?")
    out.append(f"Measured on {device}.\n")
    if steps:
        out += ["| step alone (stage:form) | ms/step | tokens/s | model TFLOP/s | peak GiB | first call s |",
                "|---|---:|---:|---:|---:|---:|"]
        for r in steps["rows"]:
            if "failed" in r:
                out.append(f"| {r['variant']} | failed: {r['failed']} | | | | |")
            else:
                out.append(f"| {r['variant']} | {r['step_ms']:.0f} | {r['tokens_per_s']:,.0f} | "
                           f"{r['model_tflops'] / r['step_ms'] * 1e3:.1f} | {r['peak_gib']:.1f} | "
                           f"{r['first_step_s']:.0f} |")
        out.append("")
    if loop and steps:
        alone = {r["variant"]: r for r in steps["rows"] if "failed" not in r}
        out += ["| train.py loop (stage:form, batches packed ahead) | steady tokens/s | ms/step | step alone ms "
                "| loop / step alone | within 15% |", "|---|---:|---:|---:|---:|---|"]
        for r in loop["rows"]:
            name = f"{r['stage']}:{r['form']}, {r.get('prefetch', 0)} ahead"
            a = alone.get(f"{r['stage']}:{r['form']}")
            if r["tokens_per_s"] is None:
                out.append(f"| {name} | no steady steps logged | | | | |")
                continue
            ratio = a["step_ms"] / r["step_ms"] if a else None
            out.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.0f} | "
                       + (f"{a['step_ms']:.0f} | {ratio:.2f} | {'yes' if ratio >= 0.85 else 'no'} |" if a
                          else "- | - | - |"))
        out.append("")
    if parts:
        out += [f"Ceilings measured in the parts run: copy {parts['copy_gbs']:,.0f} GB/s, "
                f"bf16 matmul {parts['matmul_tflops']:.0f} TFLOP/s.\n",
                "| part (fwd + bwd) | implementation | ms | limit ms | x limit | what the limit counts |",
                "|---|---|---:|---:|---:|---|"]
        for r in parts["rows"]:
            if "failed" in r:
                out.append(f"| {r['part']} | {r['impl']} | failed: {r['failed'][:120]} | | | |")
            else:
                out.append(f"| {r['part']} | {r['impl']} | {r['ms']:.2f} | {r['limit_ms']:.2f} | "
                           f"{r['ms'] / r['limit_ms']:.1f} | {r['limit_what']} |")
    text = "\n".join(out)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["steps", "parts", "loop", "table"])
    ap.add_argument("dir", nargs="?", help="table: the folder holding steps.json, parts.json, loop.json")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--markdown", help="table: also write the markdown here")
    ap.add_argument("--smoke", action="store_true", help="tiny model and batch (CPU)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", help="steps: also trace each variant (command buffers off) and summarize into this folder")
    ap.add_argument("--trace-dir", help=argparse.SUPPRESS)
    ap.add_argument("--dense-kl", default="xla", choices=["xla", "pallas_gpu"],
                    help="steps: the dense stage's absorbed indexer KL (ops.KernelChoice's dense_indexer_kl)")
    ap.add_argument("--params", default=None, metavar="DIR",
                    help="steps: start from this model directory's weights and tokenizer (e.g. checkpoints/default: a "
                         "trained indexer's selections) instead of the initialisation")
    ap.add_argument("--data", default=None, metavar="PATH",
                    help="steps: the batch's documents, as train.py --data reads them (default: the standard library)")
    ap.add_argument("--max-segments", type=int, default=None,
                    help="steps: the dense absorbed step's segment bound (default: the batch's own)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds for each child process")
    ap.add_argument("--parts", nargs="+", default=None, help="parts: only these parts")
    ap.add_argument("--run-dir", default="runs/loop-bench", help="loop: train.py's runs go to DIR/prefetch-N (emptied first)")
    ap.add_argument("--form", default="absorbed", choices=["auto", "expanded", "absorbed"], help="loop: the form")
    ap.add_argument("--loop-dense", type=int, default=30)
    ap.add_argument("--loop-sparse", type=int, default=40)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--prefetch-batches", type=int, nargs="+", default=[0, 2],
                    help="loop: run train.py once per value of its --prefetch-batches")
    args = ap.parse_args()
    from lab import dense_indexer_kl_gpu_vjp

    with dense_indexer_kl_gpu_vjp.registered():          # --dense-kl pallas_gpu: the lab's kernels
        _run(args)


def _run(args) -> None:
    recipe = SMOKE if args.smoke else RECIPE
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
    if args.mode == "table":
        table_main(args)
    elif args.mode == "steps" and args.one:
        print(json.dumps(time_step(args.one, recipe, args.reps, args.smoke, args.trace_dir, args.dense_kl,
                                   params_dir=args.params, data=args.data, max_segments=args.max_segments)),
              flush=True)
    elif args.mode == "steps":
        steps_main(args, recipe)
    elif args.mode == "loop":
        import shutil

        shutil.rmtree(args.run_dir, ignore_errors=True)
        loop_main(args, recipe)
    else:
        parts_main(args, recipe)


if __name__ == "__main__":
    main()
