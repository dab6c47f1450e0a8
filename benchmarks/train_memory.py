"""How much accelerator memory one training step needs, from the compiler, without running it.

    PYTHONPATH=. python3 benchmarks/train_memory.py --seq-len 65536 131072          # this device
    PYTHONPATH=. python3 benchmarks/train_memory.py --seq-len 8192 --packed         # CPU: XLA's plan
    PYTHONPATH=. python3 benchmarks/train_memory.py --topology v5p:2x2x1 --seq-len 131072 --stages sparse

Compiles `training.step.train_step` for `--config` at each --seq-len with abstract parameters
(nothing is allocated or run) and prints XLA's memory analysis: the temporary buffers, the
arguments (parameters and optimizer state) and the device's memory, so a sequence length can be
checked before a long job. The settings are those of `benchmarks/train_long.py` (absorbed form,
remat; the sparse attention kernel of --attention-impl, as `train.py` picks it); --packed adds
segment ids as `train.py` passes them.
On a CPU the numbers are XLA-CPU's plan, not a GPU's or TPU's.

--topology compiles for one chip of a TPU slice described ahead of time (libtpu, no TPU needed;
the Pallas TPU kernels for attention and indexer): the TPU compiler's own plan, and a plan over
the chip's memory is reported as not fitting with the memory it asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx

from glm_jax import ops
from glm_jax.config import load_config
from glm_jax.forward_options import ForwardOptions
from glm_jax.model import abstract_model
from glm_jax.training.step import Batch, LossWeights, OptimizerConfig, StepConfig, train_step_program

GIB = 2 ** 30


class DoesNotFit(Exception):
    """The TPU compiler's plan exceeds the chip's memory; needed and available as the compiler
    prints them (e.g. "95.49G")."""

    def __init__(self, needed: str, available: str):
        super().__init__(f"temporaries {needed} > the chip's {available}")
        self.needed, self.available = needed, available


def _hbm_oom(error: Exception) -> DoesNotFit | None:
    """The TPU compiler's out-of-memory refusal as DoesNotFit, or None for any other error."""
    found = re.search(r"HLO temporaries \(([\d.]+[KMGT])\) exceeds available HBM \(([\d.]+[KMGT])\)", str(error))
    return None if found is None else DoesNotFit(found[1], found[2])


def compiled_memory(cfg, seq_len: int, stage: str, *, batch: int = 1, packed: bool = False, mtp: float = 0.3,
                    max_segments: int | None = None, attention: str = "auto", tpu_chip=None):
    """-> (temp bytes, argument bytes, compile seconds) of one train step at seq_len tokens;
    tpu_chip: a device of a described TPU topology (`aot.topology_devices`) to compile for, with
    the Pallas TPU kernels (raises DoesNotFit when the plan exceeds its memory)."""
    model = abstract_model(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = OptimizerConfig(3e-4, 1000, 10)
    tx = optimizer.tx
    opt_state = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    weights = LossWeights(indexer=1.0 if stage == "sparse" else 0.0, mtp=mtp)
    kernels = ops.KernelChoice(sparse_mla=attention)
    placed = contextlib.nullcontext()
    if tpu_chip is not None:
        on_chip = jax.sharding.SingleDeviceSharding(tpu_chip)
        params, rest, opt_state, tokens = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_chip), (params, rest, opt_state, tokens))
        tpu_impl = lambda impl: "pallas_tpu" if impl == "auto" else impl
        kernels = ops.KernelChoice(sparse_mla=tpu_impl(attention), indexer_topk="pallas_tpu")
        # Mosaic reads the chip generation from the ambient mesh when no TPU is attached
        placed = jax.sharding.use_abstract_mesh(jax.sharding.Mesh(np.array([tpu_chip]), ("chip",)).abstract_mesh)
    t = time.perf_counter()
    with placed:
        config = StepConfig(optimizer, forward=ForwardOptions(mode=stage, form="absorbed", kernels=kernels, remat=True,
                                                              max_segments=max_segments), weights=weights)
        lowered = train_step_program.trace(graphdef, params, rest, opt_state,
                                           Batch(tokens, tokens, tokens if packed else None), config=config).lower()
    try:
        compiled = lowered.compile()
    except Exception as e:
        oom = _hbm_oom(e)
        if oom is None:
            raise
        raise oom from None
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
    ap.add_argument("--topology", default=None,
                    help="compile for one chip of this TPU slice (e.g. v5p:2x2x1; needs libtpu, not a TPU)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.topology:
        from glm_jax.aot import topology_devices
        device = topology_devices(args.topology)[0]
        capacity, where = None, f"{args.topology} (one chip, compiled ahead of time)"
    else:
        device = jax.devices()[0]
        capacity = (device.memory_stats() or {}).get("bytes_limit") if hasattr(device, "memory_stats") else None
        where = f"{device.device_kind}; memory {'unknown' if capacity is None else f'{capacity / GIB:.1f} GiB'}"
    print(f"device {where}; {cfg.name}, batch {args.batch_size}{', packed' if args.packed else ''}")
    print("| tokens | stage | temporaries GiB | arguments GiB | total GiB | fits | compile s |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in args.seq_len:
        run_cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, seq_len))
        for stage in args.stages:
            t = time.perf_counter()
            try:
                temp, arg, secs = compiled_memory(run_cfg, seq_len, stage, batch=args.batch_size, packed=args.packed,
                                                  max_segments=args.max_segments if args.packed else None,
                                                  attention=args.attention_impl,
                                                  tpu_chip=device if args.topology else None)
            except DoesNotFit as e:
                print(f"| {seq_len} | {stage} | {e.needed} (compiler) | - | - | no: {e} | "
                      f"{time.perf_counter() - t:.0f} |", flush=True)
                continue
            if args.topology:
                fits = "yes"           # the TPU compiler refuses a plan over the chip's memory
            else:
                fits = "?" if capacity is None else ("yes" if temp + arg <= capacity else "no")
            print(f"| {seq_len} | {stage} | {temp / GIB:.1f} | {arg / GIB:.1f} | {(temp + arg) / GIB:.1f} | "
                  f"{fits} | {secs:.0f} |", flush=True)


if __name__ == "__main__":
    main()
