"""Where a traced program's GPU time goes, by kernel and by model part (`benchmarks/_traces.py`).

    PYTHONPATH=. python3 benchmarks/trace_summary.py TRACE_DIR [--steps 2] [--top 40]

Run the traced program with XLA command buffers off (`XLA_FLAGS=--xla_gpu_enable_command_buffer=`)
or the device events carry the graph's name instead of each kernel's. `--steps` divides the
totals by the number of traced steps (ms per step).
"""

from __future__ import annotations

import argparse

from benchmarks._traces import summarize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    try:
        print(summarize(args.dir, args.steps, args.top))
    except ValueError as e:
        raise SystemExit(str(e))


if __name__ == "__main__":
    main()
