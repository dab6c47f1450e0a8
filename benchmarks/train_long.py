"""Training throughput at 128K tokens: sparse (DSA) training against dense-attention training.

    PYTHONPATH=. python3 benchmarks/train_long.py                        # on a GPU
    PYTHONPATH=. python3 benchmarks/train_long.py --smoke                # tiny, CPU
    PYTHONPATH=. python3 benchmarks/train_long.py --config configs/default-py.yaml --seq-len 4096 \
        --batch-size 16 --stages dense sparse --sparse-impls pallas_gpu  # a train.py run's batch shape

One optimizer step (forward, backward, AdamW) of `configs/small-128k.yaml` (about 0.3B
parameters: 8 layers in 2 IndexShare groups, an 8-expert MoE, GLM-5.2's MLA latent and
indexer, top-2048, one MTP layer) on --batch-size sequences (default 1) of --seq-len tokens,
in the two stages:

* dense: causal attention over every earlier token through the fused attention kernel (LM and
  MTP losses; by default the indexer is not trained; with --dense-kl IMPL also the dense warm-up's
  indexer KL of train.py's --dense-steps, computed by that implementation of the op, pallas_gpu
  being the Pallas GPU kernels of lab/dense_indexer_kl_gpu.py, registered for the run);
* sparse: attention over the indexer's top-2048 through sparse MLA, with the selected-set
  indexer KL and the MTP losses; once per implementation in --sparse-impls (the Pallas GPU
  kernel, whose backward adds the latent rows' gradient atomically, and the XLA impl chunked
  over queries, whose backward scatter-adds it).

Both use the "absorbed" form (no [S, S] matrices) and rematerialise each layer.
Prints ms per step, tokens/s and MFU (the FLOPs each stage really does, from
`glm_jax.costs.training_flops_per_token`) against the bf16 matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from benchmarks._report import failure, write_json
from benchmarks._traces import summarize
from benchmarks._measure import ceilings
from glm_jax import costs, ops
from glm_jax.config import load_config
from glm_jax.forward_options import ForwardOptions
from glm_jax.model import GLMModel, params_by_part
from glm_jax.training.step import Batch, LossWeights, OptimizerConfig, StepConfig, train_step_program
from lab import dense_indexer_kl_gpu_vjp
from pallas_kernels.sparse_mla.cuda import SparseMLACudaConfig


def main() -> None:
    with dense_indexer_kl_gpu_vjp.registered():          # --dense-kl pallas_gpu: the lab's kernels
        _run()


def _run() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/small-128k.yaml")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per step (train.py's --batch-size)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per stage (after one compiling step)")
    ap.add_argument("--stages", nargs="+", default=["sparse", "dense"], choices=["dense", "sparse"])
    ap.add_argument("--sparse-impls", nargs="+", default=["pallas_gpu", "xla"],
                    choices=ops.impl_choices("sparse_mla") + ("cuda-wgmma",),
                    help="sparse attention kernels to time (cuda-wgmma: impl cuda with the warpgroup forward, "
                         "SparseMLACudaConfig(forward='wgmma'), which also serves the indexer target)")
    ap.add_argument("--dense-kl", nargs="+", default=["none"], choices=("none",) + ops.impl_choices("dense_indexer_kl"),
                    help="the dense stage once per entry: none trains no indexer (the dense attention alone), an "
                         "implementation of pallas_kernels.dense_indexer_kl adds the dense warm-up's indexer KL "
                         "(train.py's --dense-steps) computed by it")
    ap.add_argument("--smoke", action="store_true", help="tiny model and sequence (CPU)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--sparse-config", metavar="JSON",
                    help="settings of the pallas_gpu sparse MLA: a JSON dict of SparseMLAGpuConfig fields, or a file "
                         "holding one (e.g. sparse_mla_fwd_sweep.py --best)")
    ap.add_argument("--keep-attention", action="store_true",
                    help="run the sparse stage twice: layers rematerialised whole, then keeping the sparse "
                         "attention's outputs (train.py --keep-attention)")
    ap.add_argument("--profile", metavar="DIR",
                    help="also trace one more step of each stage into DIR/STAGE-IMPL and print where its GPU time "
                         "goes (benchmarks/trace_summary.py; run with XLA_FLAGS=--xla_gpu_enable_command_buffer= "
                         "so each kernel is named)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    seq_len = args.seq_len
    if args.smoke:
        cfg = load_config("configs/tiny.yaml").replace(index_topk=16)
        seq_len = 256
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, seq_len))
    _, matmul = ceilings(args.smoke)
    model = GLMModel(cfg, rngs=nnx.Rngs(0))
    active = costs.active_params(cfg, params_by_part(model))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    del model
    optimizer = OptimizerConfig(3e-4, 1000, 10)
    tx = optimizer.tx
    if args.batch_size < 1:
        ap.error("--batch-size must be at least 1")
    batch = args.batch_size
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq_len + 1)).astype(np.int32)
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    print(f"device {jax.devices()[0].device_kind}; bf16 matmul {matmul / 1e12:.0f} TFLOP/s; "
          f"{cfg.name}: {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.0f}M parameters, "
          f"{active / 1e6:.0f}M active; {batch} x {seq_len} tokens per step")
    sparse_config = None
    if args.sparse_config:
        text = args.sparse_config
        if not text.lstrip().startswith("{"):
            with open(text) as f:
                text = f.read()
        sparse_config = pallas_kernels.SparseMLAGpuConfig(**json.loads(text))
        print(f"pallas_gpu sparse MLA settings: {sparse_config}")
    print("| stage | attention | ms/step | tokens/s | TFLOP/s (model FLOPs) | MFU vs measured matmul | loss |")
    print("|---|---|---|---|---|---|---|")
    rows = []

    def save():             # after every stage, so a run cut short keeps what it measured
        write_json(args.json, dict(matmul_flops=matmul, seq_len=seq_len, batch_size=batch, rows=rows))

    dense_runs = ["fused dense" if kl == "none" else f"fused dense + KL {kl}" for kl in args.dense_kl]
    runs = [(stage, impl, keep) for stage in args.stages
            for impl in (args.sparse_impls if stage == "sparse" else dense_runs)
            for keep in ((False, True) if args.keep_attention and stage == "sparse" else (False,))]
    for stage, impl, keep in runs:
        label = impl + (", attention kept" if keep else "")
        dense_kl = impl.rsplit(" ", 1)[-1] if "+ KL" in impl else None
        sparse = ("cuda", SparseMLACudaConfig(forward="wgmma")) if impl == "cuda-wgmma" else \
            (impl, sparse_config if impl == "pallas_gpu" else None)
        kernels = ops.KernelChoice(sparse_mla=sparse if stage == "sparse" else "auto",
                                   dense_indexer_kl=dense_kl or "xla",
                                   interpret=args.smoke and (impl.startswith("pallas") or impl.endswith("pallas_gpu")))
        weights = LossWeights(indexer=1.0 if stage == "sparse" or dense_kl else 0.0, mtp=0.3)
        opt_state = tx.init(params)
        config = StepConfig(optimizer, forward=ForwardOptions(mode=stage, form="absorbed", kernels=kernels, remat=True,
                                                              keep_attention=keep), weights=weights)
        run = lambda p, o: train_step_program(graphdef, p, rest, o, Batch(inputs, targets), config=config)
        p = jax.tree.map(jnp.copy, params)
        try:
            p, opt_state, terms = run(p, opt_state)             # compile
            jax.block_until_ready(terms)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: report it, measure the next stage
            failed = failure(e)
            print(f"| {stage} | {label} | failed: {failed} "
                  "| | | | |", flush=True)
            rows.append(dict(stage=stage, attention=impl, keep_attention=keep, failed=failed))
            save()
            continue
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            p, opt_state, terms = run(p, opt_state)
            jax.block_until_ready(terms)
            times.append(time.perf_counter() - t)
        step_s = float(np.median(times))
        flops = costs.training_flops_per_token(cfg, seq_len, active, sparse=stage == "sparse") * seq_len * batch
        print(f"| {stage} | {label} | {step_s * 1e3:.0f} | {batch * seq_len / step_s:.0f} | {flops / step_s / 1e12:.0f} | "
              f"{flops / step_s / matmul:.1%} | {float(terms['loss']):.3f} |", flush=True)
        rows.append(dict(stage=stage, attention=impl, keep_attention=keep, step_s=step_s,
                         tokens_per_s=batch * seq_len / step_s, model_flops=flops,
                         loss=float(terms["loss"])))
        save()
        if args.profile:
            trace_dir = f"{args.profile}/{stage}-{impl.replace(' ', '_')}{'-kept' if keep else ''}"
            with jax.profiler.trace(trace_dir):       # *.xplane.pb: summarize reads it in seconds
                p, opt_state, terms = run(p, opt_state)
                jax.block_until_ready(terms)
            try:
                print(f"where the {stage} step's GPU time goes ({trace_dir}):\n{summarize(trace_dir)}",
                      flush=True)
            except ValueError as e:                      # e.g. a CPU trace: no device events
                print(f"trace of the {stage} step: {e}", flush=True)
        del p, opt_state
    dense = [r["tokens_per_s"] for r in rows if r["stage"] == "dense" and "failed" not in r]
    for r in rows:
        if r["stage"] == "sparse" and "failed" not in r and dense:
            kept = ", attention kept" if r["keep_attention"] else ""
            print(f"sparse ({r['attention']}{kept}) / dense tokens/s: {r['tokens_per_s'] / dense[0]:.2f}x")


if __name__ == "__main__":
    main()
