"""Sharded training on 8 simulated CPU devices: FSDP (the model dimension of the weights and
the optimizer state over `data`), heads / FFN / experts over `tensor` (and `layer`), batch over
`data`; or the sequence over `context` (context parallelism). train.py runs in a subprocess (the
device count is fixed before jax starts): a run on data=2,tensor=2,layer=2, stopped after its
dense step and resumed from its checkpoint onto data=2,context=4 for two sparse steps, has the
losses and gradient norms of the one-device run at every step, and its step compiles once per
stage on the mesh too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import train
from conftest import micro_config, simulated_devices_env
from glm_jax.config import save_config

ROOT = Path(__file__).resolve().parents[1]


def _flags(tmp_path, out: str) -> list[str]:
    cfg_path = tmp_path / "micro.yaml"
    save_config(micro_config(vocab_size=320, max_position_embeddings=128, n_routed_experts=4), cfg_path)
    return ["--config", str(cfg_path), "--out", str(tmp_path / out), "--batch-size", "2", "--seq-len", "16",
            "--dense-steps", "1", "--warmup-steps", "1", "--max-files", "4", "--eval-every", "100",
            "--log-every", "1", "--eval-batches", "1", "--save-every", "100"]


def _metrics(tmp_path, out: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]


def _train(tmp_path, out: str, *extra: str) -> list[dict]:
    """train.py on 8 simulated devices, in a subprocess."""
    cmd = [sys.executable, str(ROOT / "train.py"), *_flags(tmp_path, out), *extra]
    proc = subprocess.run(cmd, env=simulated_devices_env(8), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _metrics(tmp_path, out)


def _train_one_device(tmp_path, out: str) -> list[dict]:
    """Steps 1-3 of the one-device run, in this process (one device, no subprocess to start).
    Its flags are those of test_faults.py's runs (and of test_cli.py's expanded-form resume run),
    --steps 5 included, so its step programs are theirs and come from the shared persistent
    compilation cache when those ran first."""
    assert train.main([*_flags(tmp_path, out), "--steps", "5", "--stop-after", "3"]) == 0
    return _metrics(tmp_path, out)


def test_sharded_training_equals_one_device_and_resumes_onto_another_mesh(tmp_path):
    one = _train_one_device(tmp_path, "one")
    # the dense step on data=2,tensor=2,layer=2, preempted after it; restored onto a
    # context-parallel mesh, which runs two sparse steps (each sharded run trains one stage)
    _train(tmp_path, "sharded", "--steps", "5", "--stop-after", "1", "--mesh", "data=2,tensor=2,layer=2")
    sharded = _train(tmp_path, "sharded", "--steps", "5", "--stop-after", "2", "--resume", "--mesh",
                     "data=2,context=4")
    assert [r["step"] for r in sharded] == [1, 2, 3]
    assert [r["stage"] for r in sharded] == ["dense", "sparse", "sparse"]
    # the step compiles at each run's first step only (a program loaded from the persistent
    # compilation cache counts too): the second sparse step gets the params and optimizer state
    # in the layouts the first one did (training.step.train_step_keeping)
    assert [r["step"] for r in sharded if r.get("compiled")] == [1, 2]
    for a, b in zip(one, sharded, strict=True):
        for key in ("loss", "lm", "indexer_kl", "mtp", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (key, a, b)
