"""Sharded training on 8 simulated CPU devices: FSDP (the model dimension of the weights and
the optimizer state over `data`), heads / FFN / experts over `tensor` (and `layer`), batch over
`data`; or the sequence over `context` (context parallelism). train.py runs in a subprocess (the
device count is fixed before jax starts): a run on data=2,tensor=2,layer=2, stopped after its
dense step and resumed from its checkpoint onto data=2,context=4 for two sparse steps, has the
losses and gradient norms of the one-device run at every step, and its step compiles once per
stage on the mesh too."""

from __future__ import annotations

import json

from conftest import one_device_flags, simulated_devices_env, train_process



def _train(tmp_path, cfg_path, out: str, *extra: str) -> list[dict]:
    """train.py on 8 simulated devices, in a subprocess, with the flags of the one-device run
    (a checkpoint only where it stops)."""
    proc = train_process(one_device_flags(cfg_path, tmp_path / out, "--save-every", "100", *extra),
                         env=simulated_devices_env(8))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _metrics(tmp_path / out)


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sharded_training_equals_one_device_and_resumes_onto_another_mesh(one_device_run, tmp_path):
    cfg_path, one_device, _ = one_device_run          # the uninterrupted one-device run (conftest.py)
    one = _metrics(one_device)[:3]
    # the dense step on data=2,tensor=2,layer=2, preempted after it; restored onto a
    # context-parallel mesh, which runs two sparse steps (each sharded run trains one stage)
    _train(tmp_path, cfg_path, "sharded", "--stop-after", "1", "--mesh", "data=2,tensor=2,layer=2")
    sharded = _train(tmp_path, cfg_path, "sharded", "--stop-after", "2", "--resume", "--mesh", "data=2,context=4")
    assert [r["step"] for r in sharded] == [1, 2, 3]
    assert [r["stage"] for r in sharded] == ["dense", "sparse", "sparse"]
    # the step compiles at each run's first step only (a program loaded from the persistent
    # compilation cache counts too): the second sparse step gets the params and optimizer state
    # in the layouts the first one did (training.step.train_step_keeping)
    assert [r["step"] for r in sharded if r.get("compiled")] == [1, 2]
    for a, b in zip(one, sharded, strict=True):
        for key in ("loss", "lm", "indexer_kl", "mtp", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (key, a, b)
