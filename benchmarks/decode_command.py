"""decode.py's default command against the same command with the decoding forced: wall time and
steady-state tokens/s of whole runs, as a user sees them.

    PYTHONPATH=. python3 benchmarks/decode_command.py --repeat 3 --json docs/data/decode_command_cpu.json

Runs `decode.py ARGS` once per variant (default: as it is, --speculative 0, --speculative 3) in
each of --repeat rounds, the variants one after the other in every round so that load from other
work hits them alike; prints the median wall time (with start-up and compilation) and the median
steady-state tokens/s decode.py reports, and which decoding the default chose.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks._report import Table, write_json

DECODE = Path(__file__).resolve().parents[1] / "decode.py"
STEADY = re.compile(r"^steady state: (\d+\.\d+) tokens/s", re.MULTILINE)


def run_once(args: list[str]) -> tuple[float, float, str]:
    """-> (wall seconds, steady-state tokens/s, the decoding line decode.py printed)."""
    t = time.perf_counter()
    done = subprocess.run([sys.executable, str(DECODE), *args], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    steady = STEADY.search(done.stderr)
    if steady is None:
        raise RuntimeError(f"decode.py {shlex.join(args)} printed no steady-state line:\n{done.stderr}")
    choice = next(line for line in done.stderr.splitlines()
                  if line.startswith(("plain decoding", "speculative decoding")))
    return wall, float(steady.group(1)), choice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--args", default="", help="decode.py's command line (default: none, the README's first command)")
    ap.add_argument("--variants", nargs="+", default=["", "--speculative 0", "--speculative 3"],
                    help="flags added to --args, one run of each per round")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    runs = {v: [] for v in args.variants}
    for _ in range(args.repeat):
        for v in args.variants:
            runs[v].append(run_once(shlex.split(args.args) + shlex.split(v)))
    print(f"decode.py {args.args}: median of {args.repeat} round(s)")
    table = Table("flags", "decoding chosen", "wall time (s)", "steady-state tokens/s")
    rows = []
    for v, results in runs.items():
        wall = float(np.median([r[0] for r in results]))
        rate = float(np.median([r[1] for r in results]))
        table.row(v or "(none)", results[0][2], f"{wall:.1f}", f"{rate:.1f}")
        rows.append(dict(flags=v, decoding=results[0][2], wall_s=wall, tokens_per_s=rate,
                         rounds=[dict(wall_s=r[0], tokens_per_s=r[1]) for r in results]))
    write_json(args.json, dict(args=args.args, repeat=args.repeat, rows=rows))


if __name__ == "__main__":
    main()
