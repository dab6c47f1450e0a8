"""Fault injection (`glm_jax.faults`), as storage engines test themselves.

* train.py's uninterrupted run reports its compilation apart and compiles the step once per stage.
* train.py killed with SIGKILL during a step, during an asynchronous save and during the export,
  resumed each time (with batches packed ahead on a thread): it continues from its last complete checkpoint and ends with the losses of
  an uninterrupted run, bit for bit, and a model directory that passes its file check.
* A disk that fills during a save (every write fails, as on a full disk): one clear error line,
  exit code 1, the previous complete checkpoint kept, and --resume continues from it exactly.
* decode.py on a damaged model directory, several processes at once on a busy machine: in every
  one the one-line error and nothing else, with the directory's file list and without it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from benchmarks import damaged_checkpoint
from conftest import one_device_flags, train_process
from glm_jax import faults
from glm_jax.checkpoint_damage import check_file_manifest


STEPS = 5              # the --steps of one_device_flags
TIMEOUT = 300


def _train(out, cfg_path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """train.py with the flags of the uninterrupted run (`one_device_run`: 5 steps, a checkpoint
    after every step) into `out`, with `fault` injected."""
    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    if fault:
        env[faults.ENV] = fault
    return train_process(one_device_flags(cfg_path, out, *extra), env=env, timeout=TIMEOUT)


def _losses(out) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), steps                     # each step logged once
    return {r["step"]: r["loss"] for r in records}


def _resumed_from(proc: subprocess.CompletedProcess) -> int:
    found = re.search(r"resume: continuing from step (\d+)", proc.stdout)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    return int(found.group(1))


@pytest.fixture(scope="module")
def run_config(one_device_run):
    """(the micro config's path, the losses of an uninterrupted run)."""
    cfg_path, uninterrupted, done = one_device_run
    # compilation is reported apart from the speed, and the step compiles once per stage (a
    # program loaded from the persistent compilation cache counts too)
    summary = next(line for line in done.stdout.splitlines() if line.startswith("compiled: "))
    assert re.search(r"jit\(train_step\) 2x \d+\.\d s", summary), summary
    assert re.search(r"steady [\d,]+ tokens/s \(median of \d logged intervals without compilation\)", summary)
    records = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("compiled")][:2] == [1, 2]     # each stage's first step
    return cfg_path, _losses(uninterrupted)


def test_killed_during_a_step_a_save_and_the_export_resumes_bit_exactly(run_config, tmp_path):
    """One run killed three times (each resume killed at the next fault), then resumed to the end,
    with two batches packed ahead on a thread (--prefetch-batches 2; the reference packs none):
    the checkpoints record the batches the loop consumed, not those built ahead."""
    cfg_path, reference = run_config
    out = tmp_path / "run"
    # (fault, the steps the resume after it may continue from: the save handed over just before
    # a kill may or may not have finished)
    chain = (("step@3", {1, 2}), ("saving@4", {3, 4}), ("export", {STEPS}))
    previous = None
    for fault, allowed in chain + ((None, None),):
        proc = _train(out, cfg_path, "--prefetch-batches", "2", *(["--resume"] if previous else []), fault=fault)
        assert "Traceback" not in proc.stderr, (fault, proc.stderr[-3000:])
        if previous:
            assert _resumed_from(proc) in previous, (fault, proc.stdout)
        if fault is None:
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            assert proc.returncode == -signal.SIGKILL, (fault, proc.returncode, proc.stderr[-3000:])
        previous = allowed
    assert _losses(out) == reference
    assert check_file_manifest(out / "params")


def test_full_disk_during_a_save_is_one_error_and_keeps_the_last_checkpoint(run_config, tmp_path):
    cfg_path, reference = run_config
    out = tmp_path / "run"
    failed = _train(out, cfg_path, fault="save@3:disk-full")
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr + failed.stdout, failed.stderr[-3000:]
    last = failed.stderr.strip().splitlines()[-1]
    kept = re.search(r"the complete checkpoint of step (\d+) is kept", last)
    assert last.startswith("error: saving checkpoint 3 to ") and "File too large" in last and kept, last
    assert (out / "checkpoints" / kept.group(1)).is_dir()
    resumed = _train(out, cfg_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _resumed_from(resumed) == int(kept.group(1))
    assert _losses(out) == reference


@pytest.mark.parametrize("with_file_list", [True, False])
def test_damaged_model_directory_is_one_line_in_every_concurrent_run(tmp_path, with_file_list):
    """A truncated data file in a copy of the shipped model, 6 decode.py processes at once on 2
    cores: each prints the one error line and exits 2. Without params.files.json the restore
    itself fails while reads are in flight, whose late reports must not reach the terminal."""
    copy = damaged_checkpoint.damaged_copy(tmp_path, with_file_list)
    for code, lines in damaged_checkpoint.concurrent_runs(copy, 6):
        assert code == 2 and len(lines) == 1, lines[-40:]
        assert lines[0].startswith(f"error: {copy}/params is damaged: ") and "truncated" in lines[0], lines[0]


def test_restoring_holds_stderr_back_and_drops_it_when_the_restore_fails(monkeypatch):
    """`checkpoint_damage.restoring()`: text written to stderr during a restore (by any thread)
    reaches stderr after a restore that succeeds, in order; after one that fails it never does,
    and other threads stay silenced afterwards (their late tracebacks)."""
    import io
    import threading

    from glm_jax import checkpoint_damage

    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    monkeypatch.setitem(checkpoint_damage._orphaned, "seen", False)

    def from_a_thread(text):
        t = threading.Thread(target=lambda: sys.stderr.write(text))
        t.start()
        t.join()

    with checkpoint_damage.restoring():
        sys.stderr.write("main 1\n")
        from_a_thread("thread 1\n")
        assert terminal.getvalue() == ""
    assert terminal.getvalue() == "main 1\nthread 1\n" and sys.stderr is terminal
    with pytest.raises(RuntimeError):
        with checkpoint_damage.restoring():
            from_a_thread("Traceback (most recent call last): ... Event loop is closed\n")
            raise RuntimeError("the restore failed")
    from_a_thread("a late traceback\n")
    sys.stderr.write("error: one line\n")
    assert terminal.getvalue() == "main 1\nthread 1\nerror: one line\n"
    assert checkpoint_damage.orbax_leftovers_seen()


def test_a_resume_from_step_0_drops_the_metrics_of_the_run_it_replaces(tmp_path):
    """A run killed before its first checkpoint completed (an asynchronous save outrun by fast
    steps) is resumed from step 0: its logged steps are dropped, so each step is logged once."""
    from glm_jax.config import load_config
    from glm_jax.training.metrics import MetricsLog
    from glm_jax.training.run_config import TrainConfig

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    log = MetricsLog(TrainConfig(), load_config("tiny"), tmp_path, start=0)
    log.file.close()
    log.bar.close()
    assert path.read_text() == ""
