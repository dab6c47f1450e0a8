"""Sharded training on 8 simulated CPU devices: FSDP (the model dimension of the weights and
the optimizer state over `data`), heads / FFN / experts over `tensor` (and `layer`), batch over
`data`; or the sequence over `context` (context parallelism). train.py runs in a subprocess (the
device count is fixed before jax starts): a run on data=2,tensor=2,layer=2, stopped after its
dense step and resumed from its checkpoint onto data=2,context=4 for the sparse step, has the
losses and gradient norms of the one-device run at every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import micro_config, simulated_devices_env
from glm_jax.config import save_config

ROOT = Path(__file__).resolve().parents[1]


def _train(tmp_path, out: str, *extra: str) -> list[dict]:
    env = simulated_devices_env(8)
    cfg_path = tmp_path / "micro.yaml"
    save_config(micro_config(vocab_size=320, max_position_embeddings=128, n_routed_experts=4), cfg_path)
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(cfg_path), "--out", str(tmp_path / out),
           "--batch-size", "4", "--seq-len", "16", "--dense-steps", "1", "--warmup-steps", "1",
           "--max-files", "4", "--eval-every", "100", "--log-every", "1", "--eval-batches", "1",
           "--save-every", "100", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]


def test_sharded_training_equals_one_device_and_resumes_onto_another_mesh(tmp_path):
    one = _train(tmp_path, "one", "--steps", "2")
    # the dense step on data=2,tensor=2,layer=2, preempted after it; restored onto a
    # context-parallel mesh, which runs the sparse step (each sharded run compiles one stage)
    _train(tmp_path, "sharded", "--steps", "2", "--stop-after", "1", "--mesh", "data=2,tensor=2,layer=2")
    sharded = _train(tmp_path, "sharded", "--steps", "2", "--resume", "--mesh", "data=2,context=4")
    assert [r["step"] for r in sharded] == [1, 2]
    assert [r["stage"] for r in sharded] == ["dense", "sparse"]
    for a, b in zip(one, sharded, strict=True):
        for key in ("loss", "lm", "indexer_kl", "mtp", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (key, a, b)
