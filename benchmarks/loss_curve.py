"""Print a training run's loss curve from its metrics.jsonl as a markdown table.

    python benchmarks/loss_curve.py runs/tiny/metrics.jsonl --every 50
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics")
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args()
    rows: dict[int, dict] = {}
    for line in open(args.metrics):
        r = json.loads(line)
        rows.setdefault(r["step"], {}).update(r)
    print("| step | stage | train LM loss | indexer KL | MTP loss | held-out LM loss | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for step in sorted(rows):
        r = rows[step]
        if step % args.every and step != max(rows) and step != 1:
            continue
        if "lm" not in r:
            continue
        val = f"{r['val_lm']:.3f}" if "val_lm" in r else ""
        print(f"| {step} | {r['stage']} | {r['lm']:.3f} | {r['indexer_kl']:.3f} | {r.get('mtp', 0):.3f} | "
              f"{val} | {r['tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
