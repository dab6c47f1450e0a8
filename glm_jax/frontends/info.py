"""Print the size and cost of a configuration: `python -m glm_jax.frontends.info configs/glm-5.2.yaml`.

Parameter counts come from abstract initialisation of the real module tree (no memory used);
cost figures (KV bytes, FLOPs) come from `glm_jax.costs`.
"""

from __future__ import annotations

import argparse
import sys

from glm_jax import costs
from glm_jax.frontends import cli
from glm_jax.cache import cache_bytes_per_token
from glm_jax.config import ConfigError, load_config
from glm_jax.model import abstract_model, params_by_part


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="configs/*.yaml, a config.json, or a checkpoint directory")
    args = ap.parse_args(argv)
    cli.choose_platforms()
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parts = params_by_part(abstract_model(cfg))
    active = costs.active_params(cfg, parts)
    print(f"config            {cfg.name} ({cfg.model_type}), {cfg.num_hidden_layers} layers"
          f" + {cfg.num_nextn_predict_layers} MTP")
    print(f"parameters        {parts['total']:,} (without the router correction biases)")
    print(f"  MTP layer       {parts['mtp']:,} of them")
    print(f"active per token  {active:,} (decoder layers + lm_head; embedding lookup and MTP excluded)")
    full = cfg.full_layers
    print(f"Full layers       {len(full)} of {cfg.num_hidden_layers}: {', '.join(map(str, full))}")
    print(f"pattern           {cfg.pattern}")
    print("KV cache bytes per token (all decoder layers):")
    for layout in ("bf16", "fp8"):
        with_share = cache_bytes_per_token(cfg, layout=layout, index_share=True)
        without = cache_bytes_per_token(cfg, layout=layout, index_share=False)
        print(f"  {layout:4s}  with IndexShare {with_share:>8,}   every layer Full {without:>8,}")
    print("forward FLOPs per token (matmuls + indexer + sparse attention):")
    ratios = {}
    for context in (131072, 1048576):
        shared = costs.flops_per_token(cfg, context, active, index_share=True)
        dense = costs.flops_per_token(cfg, context, active, index_share=False)
        ratios[context] = dense / shared
        print(f"  context {context:>9,}: with IndexShare {shared / 1e9:8.1f} GFLOP   every layer Full "
              f"{dense / 1e9:8.1f} GFLOP   ratio {dense / shared:.2f}x")
    print(f"IndexShare saves {ratios[1048576]:.2f}x of per-token FLOPs at 1M context "
          f"(published for GLM-5.2: 2.9x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
