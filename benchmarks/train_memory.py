"""How much accelerator memory one training step needs, from the compiler, without running it.

    PYTHONPATH=. python3 benchmarks/train_memory.py --seq-len 65536 131072          # this device
    PYTHONPATH=. python3 benchmarks/train_memory.py --seq-len 8192 --packed         # CPU: XLA's plan

Compiles `training.step.train_step` for `--config` at each --seq-len with abstract parameters
(nothing is allocated or run) and prints XLA's memory analysis: the temporary buffers, the
arguments (parameters and optimizer state) and the device's memory, so a sequence length can be
checked before a long job. The settings are those of `benchmarks/train_long.py` (absorbed form,
remat; the sparse attention kernel of --attention-impl, as `train.py` picks it); --packed adds
segment ids as `train.py` passes them.
On a CPU the numbers are XLA-CPU's plan, not a GPU's or TPU's.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax import ops
from glm_jax.config import load_config
from glm_jax.model import GLMModel
from glm_jax.training.step import LossWeights, make_optimizer, train_step

GIB = 2 ** 30


def compiled_memory(cfg, seq_len: int, stage: str, *, batch: int = 1, packed: bool = False, mtp: float = 0.3,
                    max_segments: int | None = None, attention: str = "auto"):
    """-> (temp bytes, argument bytes, compile seconds) of one train step at seq_len tokens."""
    model = nnx.eval_shape(lambda: GLMModel(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx, _ = make_optimizer(3e-4, 1000, 10)
    opt_state = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    weights = LossWeights(indexer=1.0 if stage == "sparse" else 0.0, mtp=mtp)
    t = time.perf_counter()
    compiled = train_step.trace(graphdef, params, rest, opt_state, tokens, tokens, tokens if packed else None,
                                tx=tx, stage=stage, weights=weights, kernels=ops.KernelChoice(attention=attention),
                                remat=True, form="absorbed", max_segments=max_segments).lower().compile()
    stats = compiled.memory_analysis()
    return stats.temp_size_in_bytes, stats.argument_size_in_bytes, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/small-128k.yaml")
    ap.add_argument("--seq-len", type=int, nargs="+", default=[131072])
    ap.add_argument("--stages", nargs="+", default=["sparse", "dense"], choices=["dense", "sparse"])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--packed", action="store_true", help="with segment ids (packed documents)")
    ap.add_argument("--attention-impl", default="auto", choices=ops.impl_choices("sparse_mla"),
                    help="sparse attention kernel (auto: the backend's Pallas kernel; xla on a CPU)")
    ap.add_argument("--max-segments", type=int, default=None,
                    help="packed: the segment bound train.py passes (dense stage: cuDNN's packed kernel)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    device = jax.devices()[0]
    capacity = (device.memory_stats() or {}).get("bytes_limit") if hasattr(device, "memory_stats") else None
    print(f"device {device.device_kind}; memory {'unknown' if capacity is None else f'{capacity / GIB:.1f} GiB'}; "
          f"{cfg.name}, batch {args.batch_size}{', packed' if args.packed else ''}")
    print("| tokens | stage | temporaries GiB | arguments GiB | total GiB | fits | compile s |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in args.seq_len:
        run_cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, seq_len))
        for stage in args.stages:
            temp, arg, secs = compiled_memory(run_cfg, seq_len, stage, batch=args.batch_size, packed=args.packed,
                                              max_segments=args.max_segments if args.packed else None,
                                              attention=args.attention_impl)
            fits = "?" if capacity is None else ("yes" if temp + arg <= capacity else "no")
            print(f"| {seq_len} | {stage} | {temp / GIB:.1f} | {arg / GIB:.1f} | {(temp + arg) / GIB:.1f} | "
                  f"{fits} | {secs:.0f} |", flush=True)


if __name__ == "__main__":
    main()
