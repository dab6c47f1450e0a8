"""train.py as 2 processes on one CPU host (2 simulated devices each, gloo collectives), each
reading its own data shard: the losses of 1 process with 4 devices reading the same 2 shards,
also across a stop and --resume of the 2 processes; a resume with another shard count is refused."""

from __future__ import annotations

import json

import pytest

import train
from conftest import micro_config
from glm_jax.config import save_config
from multiprocess import finish, gloo_available, launch, launch_processes

MESH = "data=4"      # (over gloo, tensor > 1 makes each CPU step tens of seconds slower)
KEYS = ("loss", "lm", "indexer_kl", "mtp", "grad_norm")


def _common(tmp_path) -> list[str]:
    cfg_path = tmp_path / "micro.yaml"
    save_config(micro_config(vocab_size=320, max_position_embeddings=128, num_hidden_layers=2,
                             index_topk_pattern="FS"), cfg_path)
    return ["--config", str(cfg_path), "--steps", "4", "--batch-size", "8", "--seq-len", "32",
            "--dense-steps", "0", "--warmup-steps", "1", "--max-files", "6", "--eval-every", "100",
            "--log-every", "1", "--eval-batches", "1", "--save-every", "100", "--mesh", MESH]


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not gloo_available(), reason="this jax build has no gloo CPU collectives, so CPU "
                                                  "processes cannot run collectives together")
def test_two_processes_train_like_one_and_resume(tmp_path, capsys):
    common, one, two = _common(tmp_path), tmp_path / "one", tmp_path / "two"
    # (the resumed run compiles nothing: the tests share one compilation cache, conftest.py)
    procs = launch_processes("train.py", common + ["--out", str(two), "--stop-after", "2"], processes=2,
                             devices=2)
    single = launch("train.py", common + ["--out", str(one), "--data-shards", "2"], devices=4)
    first = [finish(p) for p in procs]
    assert "stopped: saved step 2" in first[0][0] and "data in 2 shard(s), this process reading 1" in first[0][0]
    assert first[1][0].strip() == ""                                   # only process 0 prints
    resumed = [finish(p) for p in launch_processes("train.py", common + ["--out", str(two), "--resume"],
                                                    processes=2, devices=2)]
    assert "resume: continuing from step 2" in resumed[0][0] and "done: 4 steps" in resumed[0][0]
    finish(single)

    expected, got = _metrics(one), _metrics(two)
    assert [r["step"] for r in got] == [1, 2, 3, 4]                     # written once, by process 0
    for a, b in zip(expected, got, strict=True):
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (key, a, b)
    assert (two / "params").is_dir() and (two / "tokenizer.json").exists()

    assert train.main(common[:-2] + ["--out", str(two), "--resume", "--steps", "5"]) == 2   # 1 process, 1 shard
    assert "resume with --data-shards 2" in capsys.readouterr().err


def test_train_refuses_half_given_distributed_flags(tmp_path, capsys):
    assert train.main(["--out", str(tmp_path / "run"), "--num-processes", "2", "--process-id", "0"]) == 2
    assert "given without --coordinator" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
