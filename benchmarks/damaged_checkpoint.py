"""decode.py on a damaged model directory, N processes at once: how many print anything but the
one error line (tracebacks, late reports).

    PYTHONPATH=. python3 benchmarks/damaged_checkpoint.py [--runs 10] [--rounds 3]

A copy of checkpoints/default with its largest data file cut to half, once with its
params.files.json (the damage is found before any read) and once without it (the restore
fails while reads are in flight). Prints, per case, the runs whose output was more than the one
`error: ... is damaged: ...` line, and how many lines they printed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from glm_jax.checkpoint_damage import MANIFEST_NAME

ROOT = Path(__file__).resolve().parents[1]


def damaged_copy(where: Path, with_file_list: bool) -> Path:
    """A copy of checkpoints/default under `where` with its largest data file cut to half (and
    without its file list unless with_file_list)."""
    copy = where / ("with-file-list" if with_file_list else "without-file-list")
    shutil.copytree(ROOT / "checkpoints" / "default", copy)
    data = max((f for f in (copy / "params").rglob("*") if f.is_file() and f.parent.name == "d"),
               key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    if not with_file_list:
        (copy / MANIFEST_NAME).unlink()
    return copy


def concurrent_runs(model: Path, runs: int) -> list[tuple[int, list[str]]]:
    """`runs` decode.py processes on `model` at once -> each one's (exit code, output lines)."""
    procs = [subprocess.Popen([sys.executable, str(ROOT / "decode.py"), "--checkpoint", str(model), "--prompt", "x"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for _ in range(runs)]
    return [(p.returncode, out.strip().splitlines()) for p in procs for out in [p.communicate(timeout=600)[0]]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="processes at once")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for with_file_list in (True, False):
            model = damaged_copy(Path(tmp), with_file_list)
            bad, total, t = 0, 0, time.perf_counter()
            for _ in range(args.rounds):
                for code, lines in concurrent_runs(model, args.runs):
                    total += 1
                    clean = code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "damaged" in lines[0]
                    if not clean:
                        bad += 1
                        print(f"  run with exit code {code} printed {len(lines)} lines; first: {lines[:1]}")
            print(f"{model.name}: {total - bad} of {total} runs printed only the one error line "
                  f"({args.rounds} rounds of {args.runs} at once, {time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
