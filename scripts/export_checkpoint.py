"""Write a training run's newest checkpoint as the model directory decode.py loads.

    .venv/bin/python scripts/export_checkpoint.py runs/default-py --dtype bfloat16

train.py writes params/ when it reaches --steps or stops at --stop-after; a run stopped by a
signal (a SIGTERM from a time limit) leaves checkpoints/<step>/ (params, optimizer state, data
position) only. This restores the newest one that reads back and writes RUN/params/ (cast to
--dtype), beside the run's config.yaml and tokenizer.json, as train.py's own export does; the
checkpoints stay, so `train.py --resume` still continues the run. Prints the step exported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
from flax import nnx

from glm_jax.checkpoint import save_model_dir
from glm_jax.config import load_config
from glm_jax.model import GLMModel
from glm_jax.training import checkpointing, run_config
from glm_jax.training.step import OptimizerConfig, make_optimizer


def export_latest(run_dir: Path, dtype: str | None, seed: int = 0) -> int:
    """run_dir: a train.py --out directory -> the step whose params were written to run_dir/params."""
    if not (run_dir / "config.yaml").exists():
        raise SystemExit(f"{run_dir}/config.yaml not found: not a train.py run directory")
    model = GLMModel(load_config(run_dir / "config.yaml"), rngs=nnx.Rngs(seed))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    # the optimizer state's structure only: the run's optimizer (an --indexer-lr-scale adds a part)
    settings_file = run_dir / run_config.FILE_NAME
    tx = (OptimizerConfig.of(run_config.load(settings_file).schedule).tx if settings_file.exists()
          else make_optimizer(1.0, 2, 1)[0])
    found = checkpointing.restore_latest(checkpointing.manager(run_dir),
                                         {"params": params, "opt_state": jax.eval_shape(tx.init, params)})
    if found is None:
        raise SystemExit(f"{run_dir}/checkpoints/ holds no checkpoint that restores")
    step, state, _ = found
    nnx.update(model, state["params"], rest)
    save_model_dir(run_dir, model, dtype=dtype, tokenizer_file=run_dir / "tokenizer.json")
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the train.py --out directory")
    ap.add_argument("--dtype", default=None, help="cast the floating-point params (e.g. bfloat16)")
    ap.add_argument("--seed", type=int, default=0, help="the run's --seed (the non-trained state is rebuilt)")
    args = ap.parse_args(argv)
    step = export_latest(args.run.absolute(), args.dtype, args.seed)
    print(f"exported step {step} to {args.run / 'params'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
