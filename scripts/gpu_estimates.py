"""Prompt-prefill work of the GPU serving benchmarks, for sizing their commands (an estimate).

    PYTHONPATH=. python3 scripts/gpu_estimates.py [--matmul-tflops 780] [--efficiency 0.25]

For each max context of benchmarks/serving_load.py (its default workload: 64 requests, 128 new
tokens, prompt lengths drawn as it draws them) and each layer pattern, the forward FLOPs of
prefilling every prompt once (`glm_jax.costs.prefill_flops`), and of the 200K-token prompt of
`benchmarks/long_context.py --prefill 200000`; then the seconds they take at --efficiency of a
bf16 matmul rate of --matmul-tflops (default: the H200's rate measured by the benchmarks,
about 780). Compiling and the decode steps come on top; each server of a run prefills once.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.long_context import PATTERNS, model_config
from benchmarks.serving_load import workload
from glm_jax import costs
from glm_jax.model import abstract_model, params_by_part

CONTEXTS = (32768, 131072, 1048576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matmul-tflops", type=float, default=780.0)
    ap.add_argument("--efficiency", type=float, default=0.25, help="fraction of the matmul rate the prefill reaches")
    args = ap.parse_args()
    rate = args.matmul_tflops * 1e12
    active = {name: costs.active_params(model_config(pattern, False),
                                        params_by_part(abstract_model(model_config(pattern, False))))
              for name, pattern in PATTERNS.items()}
    print(f"| workload | pattern | prompt tokens | longest | forward PFLOP | s at {args.matmul_tflops:.0f} TFLOP/s "
          f"| s at {args.efficiency:.0%} of it |")
    print("|---|---|---|---|---|---|---|")
    for context in CONTEXTS:
        arrivals = workload(np.random.default_rng([0, context]), requests=64, rate=4.0, context=context,
                            new_tokens=128, vocab=model_config(PATTERNS["IndexShare"], False).vocab_size)
        lengths = [len(a.prompt) for a in arrivals]
        for name, pattern in PATTERNS.items():
            flops = sum(costs.prefill_flops(model_config(pattern, False), n, active[name]) for n in lengths)
            print(f"| serving_load {context} | {name} | {sum(lengths):,} | {max(lengths):,} | {flops / 1e15:.1f} | "
                  f"{flops / rate:.0f} | {flops / rate / args.efficiency:.0f} |")
    for name, pattern in PATTERNS.items():
        flops = costs.prefill_flops(model_config(pattern, False), 200_000, active[name])
        print(f"| long_context --prefill 200000 | {name} | 200,000 | 200,000 | {flops / 1e15:.1f} | "
              f"{flops / rate:.0f} | {flops / rate / args.efficiency:.0f} |")


if __name__ == "__main__":
    main()
