"""benchmarks/layer_split_decode.py --smoke on 2 simulated CPU devices: the LayerSplit decode
runs, holds half the cache on a device and gives the one-device tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import simulated_devices_env

ROOT = Path(__file__).resolve().parents[1]


def test_layer_split_decode_smoke_equals_one_device(tmp_path):
    env = simulated_devices_env(2, PYTHONPATH=str(ROOT))     # (with the test processes' XLA flags)
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_split_decode.py"), "--smoke",
                           "--new-tokens", "32", "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens_equal"] and row["split_ms"] > 0 and row["one_ms"] > 0
    assert row["split_cache_bytes"] < 0.51 * row["one_cache_bytes"]       # half the layers (+ small replicated state)
