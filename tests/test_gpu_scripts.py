"""scripts/gpu_benchmarks.sh, scripts/gpu_default_model.sh and scripts/gpu_midtraining.sh with a
stub interpreter (PYTHON): argument handling, a failing benchmark not stopping the others, time
limits, the archive, the weight parts of the default model coming back whole, and the retrieval
ablation's variants each run once. No benchmark or training runs here."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Logs its command line and JAX_PLATFORMS; sparse_mla.py fails, long_context.py hangs, every
# other benchmark writes '{}' to its --json / --out path.
BENCH_STUB = r"""#!/usr/bin/env bash
echo "JAX_PLATFORMS=${JAX_PLATFORMS:-} $*" >> "$STUB_LOG"
case "$*" in
    *sparse_mla.py*) echo "sparse_mla broke" >&2; exit 3 ;;
    *long_context.py*) exec sleep 30 ;;
esac
while [ $# -gt 0 ]; do
    case $1 in --json|--out) echo '{}' > "$2"; shift ;; esac
    shift
done
echo "| a table |"
"""

# The default model's steps: -c snippets succeed, the corpus script writes its files, train.py
# writes a run directory with 47 MiB of "weights" and reports that it reached --steps.
TRAIN_STUB = r"""#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
last_out() { local o=""; while [ $# -gt 0 ]; do [ "$1" = --out ] && o=$2; shift; done; echo "$o"; }
out=$(last_out "$@")
case $1 in
    -c) echo stub; exit 0 ;;
    scripts/build_python_corpus.py)
        mkdir -p "$out" && echo '{}' > "$out/manifest.json" && touch "$out/train.jsonl" "$out/heldout.jsonl" ;;
    train.py)
        mkdir -p "$out/params" && echo cfg > "$out/config.yaml" && echo tok > "$out/tokenizer.json"
        head -c 49283072 /dev/urandom > "$out/params/weights"
        echo '{"step": 4}' > "$out/metrics.jsonl"
        echo "done: 4 steps; model written to $out" ;;
    *) exit 1 ;;
esac
"""


def stub(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "python"
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def run_script(script: str, args: list[str], tmp_path: Path, python: Path | None = None, **extra_env: str):
    env = dict(os.environ, RUNS_DIR=str(tmp_path / "runs"), STUB_LOG=str(tmp_path / "calls.log"), **extra_env)
    env.pop("JAX_PLATFORMS", None)      # as on the GPU machine
    if python is not None:
        env["PYTHON"] = str(python)
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def archive_members(path: Path) -> dict[str, str]:
    with tarfile.open(path) as tar:
        return {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def test_benchmarks_usage_and_bad_arguments_run_nothing(tmp_path):
    python = stub(tmp_path, BENCH_STUB)
    usage = run_script("gpu_benchmarks.sh", [], tmp_path, python)
    assert usage.returncode == 2 and "training-parts" in usage.stdout and "serving-1m-full" in usage.stdout
    bad_group = run_script("gpu_benchmarks.sh", [str(tmp_path / "out"), "kernels", "bogus"], tmp_path, python)
    assert bad_group.returncode == 2 and "unknown group 'bogus'" in bad_group.stderr
    bad_budget = run_script("gpu_benchmarks.sh", ["--budget", "soon", str(tmp_path / "out"), "kernels"], tmp_path,
                            python)
    assert bad_budget.returncode == 2 and "--budget" in bad_budget.stderr
    assert calls(tmp_path) == []


def test_a_failing_benchmark_does_not_stop_the_next_and_fails_the_run(tmp_path):
    out = tmp_path / "out"
    result = run_script("gpu_benchmarks.sh", [str(out), "kernels"], tmp_path, stub(tmp_path, BENCH_STUB))
    assert result.returncode == 1 and "2 benchmark(s) failed" in result.stderr
    benchmarks = [c for c in calls(tmp_path) if "benchmarks/" in c]
    assert len(benchmarks) == 3 and all(c.startswith("JAX_PLATFORMS=cuda ") for c in benchmarks)
    assert [p.name for p in out.iterdir()] == ["gpu_benchmarks-kernels.tar.gz"]
    files = archive_members(out / "gpu_benchmarks-kernels.tar.gz")
    assert {"environment.txt", "summary.txt", "sparse_mla_paged.txt", "sparse_mla_prefill_mosaic.txt",
            "indexer_topk_paged.txt", "indexer_topk_paged.json"} <= set(files)
    assert "sparse_mla broke" in files["sparse_mla_paged.txt"]
    summary = [line.split()[:2] for line in files["summary.txt"].splitlines()]
    assert summary[0] == ["sparse_mla_paged", "failed"] and summary[1] == ["sparse_mla_prefill_mosaic", "failed"]
    assert summary[2] == ["indexer_topk_paged", "ok"]


def test_smoke_appends_each_benchmarks_small_flags_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    result = run_script("gpu_benchmarks.sh", ["--smoke", str(out), "serving"], tmp_path, stub(tmp_path, BENCH_STUB))
    assert result.returncode == 0, result.stderr
    engine, load = [c for c in calls(tmp_path) if "benchmarks/" in c]
    assert engine.startswith("JAX_PLATFORMS=cpu ") and engine.endswith("--config configs/tiny.yaml "
                                                                      "--max-context 256 --new-tokens 64 "
                                                                      "--check-cuda-graphs 8")
    assert "--contexts 32768" in load and load.endswith("--smoke --contexts 256")
    assert "serving_load_32k.json" in archive_members(out / "gpu_benchmarks-serving-smoke.tar.gz")


def test_fp8_groups_smoke_both_layouts_without_the_corpus(tmp_path):
    """fp8-serving: the load benchmark over both layouts at one memory fraction, its smoke flags
    last (explicit bytes: a CPU has no memory statistics); fp8-quality: bits per byte twice,
    then the agreement plain and K = 7 on the stdlib split (no corpus is built under --smoke)."""
    out = tmp_path / "out"
    result = run_script("gpu_benchmarks.sh", ["--smoke", str(out), "fp8-serving", "fp8-quality"], tmp_path,
                        stub(tmp_path, BENCH_STUB))
    assert result.returncode == 0, result.stderr
    load, bits_4k, bits_32k, plain, speculative = [c for c in calls(tmp_path) if "benchmarks/" in c]
    assert "--kv-cache-dtype auto fp8 --cache-memory-fraction 0.2" in load
    assert load.endswith("--smoke --contexts 256 --requests 4 --new-tokens 8 --min-prompt 16 --slots 4 "
                         "--kv-cache-memory-bytes 2000000")
    assert "--context 4096 --rows 16" in bits_4k and "--config configs/small-128k.yaml --context 32768" in bits_32k
    assert all(c.endswith("--smoke --context 128 --rows 2") for c in (bits_4k, bits_32k))
    assert "--speculative 0" in plain and "--speculative 7" in speculative
    assert all("--heldout" not in c and c.endswith("--prompts 2 --prompt-len 32 --new-tokens 8")
               for c in (plain, speculative))
    files = archive_members(out / "gpu_benchmarks-fp8-serving_fp8-quality-smoke.tar.gz")
    assert {"serving_load_128k_fp8.json", "fp8_bits_per_byte_32k.json", "fp8_agreement_k7.json"} <= set(files)


def test_the_budget_times_out_a_hanging_benchmark_and_skips_the_rest(tmp_path):
    out = tmp_path / "out"
    t = time.perf_counter()
    result = run_script("gpu_benchmarks.sh", ["--budget", "13", str(out), "prefill", "kernels"], tmp_path,
                        stub(tmp_path, BENCH_STUB))
    assert time.perf_counter() - t < 20
    assert result.returncode == 1 and "4 benchmark(s) failed" in result.stderr
    summary = archive_members(out / "gpu_benchmarks-prefill_kernels.tar.gz")["summary.txt"]
    assert "long_prefill_200k" in summary and "timed out" in summary
    assert summary.count("skipped (no time left)") == 3
    assert not any("sparse_mla.py" in c for c in calls(tmp_path))


def test_default_model_bad_arguments(tmp_path):
    python = stub(tmp_path, TRAIN_STUB)
    out = str(tmp_path / "out")
    assert run_script("gpu_default_model.sh", [], tmp_path, python).returncode == 2
    minutes = run_script("gpu_default_model.sh", [out, "soon"], tmp_path, python)
    assert minutes.returncode == 2 and "MINUTES must be a number" in minutes.stderr
    stray = run_script("gpu_default_model.sh", [out, "5", "--steps", "9"], tmp_path, python)
    assert stray.returncode == 2 and "after --" in stray.stderr
    parts = run_script("gpu_default_model.sh", ["--parts", "3", out], tmp_path, python)
    assert parts.returncode == 2 and "FIRST-LAST" in parts.stderr
    assert calls(tmp_path) == []


def test_default_model_weights_come_back_in_parts_over_two_calls(tmp_path):
    python = stub(tmp_path, TRAIN_STUB)
    first, second = tmp_path / "out1", tmp_path / "out2"
    result = run_script("gpu_default_model.sh", [str(first), "5", "--", "--steps", "9"], tmp_path, python)
    assert result.returncode == 0, result.stderr
    train = next(c for c in calls(tmp_path) if c.startswith("train.py"))
    assert "--resume" in train and train.endswith("--steps 9")
    assert sorted(p.name for p in first.iterdir()) == [
        "default_model.tar.gz", *(f"default_model_params.tar.part-0{i}" for i in range(3))]
    report = archive_members(first / "default_model.tar.gz")
    assert {"status.txt", "metrics.jsonl", "config.yaml", "tokenizer.json", "manifest.json"} <= set(report)
    assert "exported step: 4; finished (reached --steps): yes" in report["status.txt"]
    assert "--parts 3-3" in result.stdout
    assert run_script("gpu_default_model.sh", ["--parts", "3-3", str(second)], tmp_path, python).returncode == 0
    whole = b"".join((d / f"default_model_params.tar.part-0{i}").read_bytes()
                     for i, d in enumerate([first] * 3 + [second]))
    assert f"sha256: {hashlib.sha256(whole).hexdigest()}" in report["status.txt"]


def test_midtraining_usage_subcommands_and_data_first(tmp_path):
    python = stub(tmp_path, TRAIN_STUB)
    assert run_script("gpu_midtraining.sh", [], tmp_path, python).returncode == 2
    assert run_script("gpu_midtraining.sh", ["bogus"], tmp_path, python).returncode == 2
    early = run_script("gpu_midtraining.sh", ["stage32k"], tmp_path, python)
    assert early.returncode == 2 and "run the data subcommand first" in early.stderr
    for bad in (["speed", "long"], ["stage32k", "32768"]):      # only speed takes a length
        assert run_script("gpu_midtraining.sh", bad, tmp_path, python).returncode == 2
    one_length = run_script("gpu_midtraining.sh", ["speed", "32768"], tmp_path, python)
    assert one_length.returncode == 2 and "run the data subcommand first" in one_length.stderr
    assert calls(tmp_path) == []
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_midtraining.sh")]).returncode == 0


# The mid-training steps: -c snippets succeed, the documents script writes its two files (one line each),
# train.py exports its run, the evaluation prints a table.
MID_STUB = r"""#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
flag() { local want=$1; shift; while [ $# -gt 0 ]; do [ "$1" = "$want" ] && { echo "$2"; return; }; shift; done; }
case $1 in
    -c) echo /site ;;
    scripts/long_documents.py) mkdir -p "$(dirname "$(flag --out "$@")")"
                               echo '{"text": "x"}' | tee "$(flag --out "$@")" > "$(flag --heldout-out "$@")"
                               echo "training: 2 documents" ;;
    train.py) out=$(flag --out "$@"); mkdir -p "$out/params"; echo '{"step": 3}' > "$out/metrics.jsonl"
              echo "done: 3 steps; model written to $out" ;;
    benchmarks/long_context_eval.py) echo '{}' > "$(flag --json "$@")"; echo "| model | distance | gain |" ;;
    *) exit 1 ;;
esac
"""


def test_midtraining_retrieval_runs_each_variant_once(tmp_path):
    python = stub(tmp_path, MID_STUB)
    env = {"RETRIEVAL_VARIANTS": "plain=2000:1 fast=3000:10", "STEPS_32K": "3"}
    bad = run_script("gpu_midtraining.sh", ["retrieval"], tmp_path, python, RETRIEVAL_VARIANTS="x=many:1")
    assert bad.returncode == 2 and "NAME=RECALL_EVERY:INDEXER_LR_SCALE" in bad.stderr
    first = run_script("gpu_midtraining.sh", ["retrieval"], tmp_path, python, **env)
    assert first.returncode == 0, first.stderr
    log = calls(tmp_path)
    documents = [c for c in log if c.startswith("scripts/long_documents.py")]
    assert [d.split("--recall-every ")[1] for d in documents] == ["2000", "3000"]
    assert "/retrieval/plain/long/train.jsonl" in documents[0] and "/retrieval/fast/long/" in documents[1]
    stages = [c for c in log if c.startswith("train.py")]
    assert len(stages) == 2 and all("--index-topk 2048" in c and "--dense-steps 100" in c for c in stages)
    assert "--indexer-lr-scale" not in stages[0] and "--indexer-lr-scale 10" in stages[1]
    probes = [c for c in log if c.startswith("benchmarks/long_context_eval.py")]
    assert [p.split("--model ")[1].split()[0].split("/retrieval/")[1] for p in probes] == ["plain/mid32k", "fast/mid32k"]
    assert first.stdout.count("| model | distance | gain |") == 2
    again = run_script("gpu_midtraining.sh", ["retrieval"], tmp_path, python, **env)
    assert again.returncode == 0 and "== plain: done" in again.stdout and "== fast: done" in again.stdout
    assert calls(tmp_path) == log                                    # nothing ran again
