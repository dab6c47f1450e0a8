"""train.py and decode.py end to end on a micro model, the flags they share (glm_jax.frontends.cli), and the
errors a user can cause."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

import decode
import hf_fixtures as hf
import train
from glm_jax import ops
from glm_jax.frontends import cli
from glm_jax.checkpoint import ModelSource, load_model
from glm_jax.config import load_config, save_config
from glm_jax.decoding import display, generate, policy
from glm_jax.sharding import ShardingError
from glm_jax.training import run
from conftest import ROOT, micro_config
from pallas_kernels import XlaConfig


#: The micro config of the runs here: 128 positions, two layers (one IndexShare group: a dense
#: MLP, then MoE) and the MTP layer.
MICRO = dict(vocab_size=320, max_position_embeddings=128, num_hidden_layers=2, index_topk_pattern="FS")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A micro model trained for a few steps on a handful of stdlib files."""
    out = tmp_path_factory.mktemp("run")
    cfg_path = out.parent / "micro.yaml"
    save_config(micro_config(**MICRO), cfg_path)
    code = train.main(["--config", str(cfg_path), "--out", str(out), "--steps", "12", "--batch-size", "4",
                       "--seq-len", "32", "--dense-steps", "6", "--warmup-steps", "2", "--lr", "1e-2",
                       "--max-files", "6", "--eval-every", "6", "--save-every", "6", "--eval-batches", "2"])
    assert code == 0
    return out, cfg_path


def test_training_lowers_the_loss_and_writes_checkpoints(trained_run):
    out, _ = trained_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lm = [r["lm"] for r in records if "lm" in r]
    assert lm[-1] < lm[0] - 0.5
    assert any("val_lm" in r for r in records)
    speeds = [(r["real_tokens_per_s"], r["tokens_per_s"]) for r in records if "tokens_per_s" in r]
    assert speeds and all(0 < real <= total for real, total in speeds)     # padding is not counted
    assert (out / "params").is_dir() and (out / "tokenizer.json").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["12", "6"]


@pytest.mark.parametrize("flags", [["--speculative", "0"], ["--speculative", "3"]], ids=["plain", "speculative"])
def test_decode_quiet_prints_only_the_generated_text(trained_run, capsys, flags):
    """Piped (capsys is no terminal) --quiet prints neither the prompt nor the marker line."""
    out, _ = trained_run
    assert decode.main(["--checkpoint", str(out), "--prompt", "def f(x):", "--max-new-tokens", "8", "--quiet",
                        *flags]) == 0
    captured = capsys.readouterr()
    assert "def f(x):" not in captured.out and display.COMPLETION_MARK not in captured.out
    assert captured.out.strip() and captured.err == ""


@pytest.mark.parametrize("flags", [["--speculative", "3"], []], ids=["speculative", "policy"])
def test_decode_prints_text_and_speed(trained_run, capsys, flags):
    out, _ = trained_run
    assert decode.main(["--checkpoint", str(out), "--prompt", "def f(x):", "--max-new-tokens", "20", *flags]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"def f(x):\n{display.COMPLETION_MARK}\n")    # piped: the marker line
    assert "compiling and running the prefill" in captured.err and "prefill done; decoding" in captured.err
    choice = policy.choose(jax.default_backend(), 1) if not flags else policy.Choice(3, "--speculative 3")
    assert choice.reason in captured.err
    steady = re.search(r"^steady state: (\d+\.\d) tokens/s .*", captured.err, re.MULTILINE)
    assert steady and float(steady.group(1)) > 0
    acceptance = re.search(r"acceptance length (\d+\.\d\d) over (\d+) verify steps", steady.group(0))
    assert (acceptance is not None) == (choice.num_draft > 0)
    if acceptance:
        assert 1.0 <= float(acceptance.group(1)) <= choice.num_draft + 1 and int(acceptance.group(2)) > 0


def test_prompt_longer_than_context_is_refused(trained_run, capsys):
    out, _ = trained_run
    code = decode.main(["--checkpoint", str(out), "--prompt", "x = 1\n" * 200, "--max-new-tokens", "8"])
    assert code == 2
    assert "exceeds the context of 128 tokens" in capsys.readouterr().err


def test_checkpoint_of_another_config_is_refused(trained_run, capsys):
    out, _ = trained_run
    code = decode.main(["--checkpoint", str(out), "--config", str(ROOT / "configs/tiny.yaml")])
    assert code == 2
    err = capsys.readouterr().err
    assert "hidden_size: 32 != 256" in err and "Drop --config" in err


def test_resume_refuses_another_config(trained_run, capsys):
    out, _ = trained_run
    code = train.main(["--config", str(ROOT / "configs/tiny.yaml"), "--out", str(out), "--resume"])
    assert code == 2
    assert "hidden_size" in capsys.readouterr().err


def test_unknown_config_key_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs/tiny.yaml").read_text() + "hiden_size: 3\n")
    assert train.main(["--config", str(bad), "--out", str(tmp_path / "run")]) == 2
    assert "hiden_size" in capsys.readouterr().err


def test_info_prints_counts(capsys):
    from glm_jax.frontends.info import main
    assert main([str(ROOT / "configs/glm-5.2.yaml")]) == 0
    text = capsys.readouterr().out
    assert "753,329,921,024" in text
    assert "Full layers       21 of 78: 0, 1, 2, 6, 10" in text
    assert "2.73x" in text


@pytest.mark.parametrize("form,dense_steps,data_files", [("expanded", "2", True), ("absorbed", "2", False)])
def test_resume_continues_bit_exactly(tmp_path, form, dense_steps, data_files):
    """Losses after --resume equal those of an uninterrupted run, bit for bit: through the dense
    warm-up into the sparse stage reading --data files (plain text and JSON lines: packed batches
    and the grain iterator's position resume exactly), and in the absorbed form (the dense
    stage's blockwise indexer KL, then the sparse stage's selected-set KL) on the built-in corpus."""
    source = ["--max-files", "4"]
    if data_files:
        data = tmp_path / "data"
        data.mkdir()
        for i in range(3):
            (data / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * (i + 2))
        (data / "more.jsonl").write_text("".join(json.dumps({"text": f"import os\nclass A{i}:\n    pass\n" * (i % 3 + 1)})
                                                 + "\n" for i in range(12)))
        source = ["--data", str(data)]
    _assert_resume_is_exact(tmp_path, ["--dense-steps", dense_steps, "--attention-form", form, *source])


def _assert_resume_is_exact(tmp_path, extra: list[str]) -> None:
    """Runs 5 steps uninterrupted, then 3 + --resume 2, and compares the logged losses bit for bit."""
    cfg_path = tmp_path / "micro.yaml"
    save_config(micro_config(**MICRO), cfg_path)
    common = ["--config", str(cfg_path), "--batch-size", "2", "--seq-len", "16", "--warmup-steps", "1",
              "--eval-every", "100", "--log-every", "1", "--eval-batches", "1", *extra]

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert train.main(common + ["--out", str(tmp_path / "a"), "--steps", "5", "--save-every", "100"]) == 0
    assert train.main(common + ["--out", str(tmp_path / "b"), "--steps", "5", "--save-every", "100",
                                "--stop-after", "3"]) == 0
    assert (tmp_path / "b" / "params").is_dir()                 # a --stop-after stop decodes as it stands
    assert train.main(common + ["--out", str(tmp_path / "b"), "--steps", "5", "--save-every", "100",
                                "--resume"]) == 0
    assert losses(tmp_path / "b") == losses(tmp_path / "a")


_TRAINED_FLAGS = ["--steps", "12", "--batch-size", "4", "--seq-len", "32", "--dense-steps", "6", "--warmup-steps", "2",
                  "--lr", "1e-2", "--max-files", "6", "--eval-every", "6", "--save-every", "6", "--eval-batches", "2"]


def _copy_of(trained_run, tmp_path):
    import shutil

    out, cfg_path = trained_run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    return copy, ["--config", str(cfg_path), "--out", str(copy), *_TRAINED_FLAGS, "--resume"]


def test_run_settings_are_written_and_a_resume_names_a_changed_one(trained_run, tmp_path, capsys):
    from glm_jax.training import run_config

    written = run_config.load(trained_run[0] / run_config.FILE_NAME)
    assert (written.schedule.lr, written.data.seq_len, written.data.data_shards) == (1e-2, 32, 1)
    copy, flags = _copy_of(trained_run, tmp_path)
    assert train.main(flags + ["--lr", "5e-3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("resume: ") and "->" in line] == \
        ["resume: schedule.lr (--lr) 0.01 -> 0.005"]
    assert out[-1] == f"decode with: {cli.python_command()} decode.py --checkpoint {cli.shown_path(copy)}"
    assert run_config.load(copy / run_config.FILE_NAME).schedule.lr == 5e-3


def test_resume_refuses_a_new_sequence_length_in_one_line(trained_run, tmp_path, capsys):
    _, flags = _copy_of(trained_run, tmp_path)
    assert train.main(flags + ["--seq-len", "64"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --resume cannot change data.seq_len (--seq-len) 32 -> 64: ")


def test_resume_of_a_run_without_settings_file_says_so(trained_run, tmp_path, capsys):
    from glm_jax.training import run_config

    copy, flags = _copy_of(trained_run, tmp_path)
    (copy / run_config.FILE_NAME).unlink()
    assert train.main(flags) == 0
    assert sum("no run_config.yaml" in line for line in capsys.readouterr().out.splitlines()) == 1
    assert (copy / run_config.FILE_NAME).exists()


def test_missing_data_file_is_refused(tmp_path, capsys):
    assert train.main(["--out", str(tmp_path / "run"), "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl does not exist" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_decode_a_batch_of_prompts_from_a_file(trained_run, tmp_path):
    out, _ = trained_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"def f(x):"\n{"prompt": "import os\\nclass A:"}\n')
    result = tmp_path / "out.jsonl"
    for k in ("0", "2"):
        assert decode.main(["--checkpoint", str(out), "--prompts-file", str(prompts), "--max-new-tokens", "6",
                            "--speculative", k, "--output", str(result)]) == 0
        rows = [json.loads(line) for line in result.read_text().splitlines()]
        assert [r["prompt"] for r in rows] == ["def f(x):", "import os\nclass A:"]


def test_bad_prompts_file_is_refused(trained_run, tmp_path, capsys):
    out, _ = trained_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "x"}\n')
    assert decode.main(["--checkpoint", str(out), "--prompts-file", str(prompts)]) == 2
    assert "prompts.jsonl:1" in capsys.readouterr().err


def test_decode_mesh_that_does_not_fit_is_refused(trained_run, capsys, monkeypatch):
    out, _ = trained_run
    monkeypatch.setenv("XLA_FLAGS", "")
    assert decode.main(["--checkpoint", str(out), "--mesh", "tensor=3", "--max-new-tokens", "4"]) == 2
    assert "error:" in capsys.readouterr().err
    assert decode.main(["--checkpoint", str(out), "--mesh", "layers=2"]) == 2
    assert "unknown axis 'layers'" in capsys.readouterr().err


def test_compile_only_needs_config_and_topology(capsys):
    assert decode.main(["--compile-only"]) == 2
    assert "--topology" in capsys.readouterr().err


def test_decode_threads_the_kernel_flags_into_the_generator(trained_run, monkeypatch):
    out, _ = trained_run
    seen = []
    init = generate.Generator.__init__
    monkeypatch.setattr(generate.Generator, "__init__",
                        lambda self, *a, **k: seen.append(k["forward"].kernels) or init(self, *a, **k))
    assert decode.main(["--checkpoint", str(out), "--max-new-tokens", "2", "--speculative", "0", "--quiet",
                        "--attention-impl", "xla", "--indexer-impl", "xla", "--kernel-config", "attention.q_chunk=8"]) == 0
    assert seen == [ops.KernelChoice(indexer_topk="xla", sparse_mla=("xla", XlaConfig(q_chunk=8)))]


def test_train_from_a_hugging_face_checkpoint(tmp_path, monkeypatch, capsys):
    """--hf-checkpoint: the run starts from the checkpoint's weights and config (one step at
    learning rate 0 exports them unchanged), with the kernels of the flags."""
    hf_dir, out = tmp_path / "hf", tmp_path / "run"
    hf.write_checkpoint(hf_dir, dict(hf.GLM, vocab_size=320, num_hidden_layers=3))    # Full, Full, Shared
    seen = []
    step = run.train_step
    monkeypatch.setattr(run, "train_step", lambda state, batch, config: seen.append(config.forward.kernels)
                        or step(state, batch, config))
    assert train.main(["--hf-checkpoint", str(hf_dir), "--out", str(out), "--steps", "1", "--lr", "0",
                       "--batch-size", "2", "--seq-len", "16", "--max-files", "2", "--eval-batches", "1",
                       "--indexer-impl", "xla"]) == 0
    assert seen == [ops.KernelChoice(indexer_topk="xla", sparse_mla="auto")]
    assert "deprecated" not in capsys.readouterr().err
    assert load_config(out / "config.yaml") == load_config(hf_dir / "config.json")
    flat = lambda model: jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))
    for a, b in zip(flat(load_model(ModelSource(out))), flat(load_model(ModelSource(hf_dir, hf=True))),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_init_from_hf_is_a_deprecated_spelling_of_hf_checkpoint(capsys):
    assert train.parse_args(["--init-from-hf", "ckpt/", "--out", "run"]).settings.model.hf_checkpoint == "ckpt/"
    assert capsys.readouterr().err == "note: --init-from-hf is deprecated; use --hf-checkpoint\n"
    assert train.parse_args(["--hf-checkpoint", "ckpt/", "--out", "run"]).settings.model.hf_checkpoint == "ckpt/"
    assert capsys.readouterr().err == ""


def test_user_errors_print_one_line_and_exit_with_code_2(capsys):
    """Within cli.user_errors a ValueError or a missing file is the user's: one line, exit code 2;
    outside it a ValueError is a bug and keeps its traceback."""
    @cli.reports_user_errors
    def main(where):
        with cli.user_errors():
            if where == "mesh":
                raise ShardingError("mesh data=3 needs 3 devices; shrink the mesh")
            if where == "file":
                open("/nonexistent/prompts.jsonl")
        raise ValueError("a bug")

    assert main("mesh") == 2
    assert capsys.readouterr().err == "error: mesh data=3 needs 3 devices; shrink the mesh\n"
    assert main("file") == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: [Errno 2] No such file or directory: '/nonexistent/prompts.jsonl'"]
    with pytest.raises(ValueError, match="a bug"):
        main("bug")


def test_damaged_model_directory_is_one_line_and_exit_2(trained_run, tmp_path, capsys):
    import shutil

    out, _ = trained_run
    copy = tmp_path / "model"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("checkpoints"))
    data = max((f for f in (copy / "params").rglob("*") if f.is_file() and f.parent.name == "d"),
               key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[:100])               # truncated
    # the file list written with params/ names the file before any read ...
    assert decode.main(["--checkpoint", str(copy), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {copy}/params is damaged: 1 of its ")
    assert f"{data.relative_to(copy / 'params')} is truncated: 100 bytes" in err[0]
    assert "copy the model directory again" in err[0]
    # ... and without it the failed restore names the array
    (copy / "params.files.json").unlink()
    assert decode.main(["--checkpoint", str(copy), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {copy}/params is damaged: array '")
    assert "truncated" in err[0] and "copy the model directory again" in err[0]


def test_ctrl_c_saves_and_exits_a_second_quits(trained_run, tmp_path, monkeypatch, capsys):
    import signal

    _, cfg_path = trained_run
    real_step, calls = run.train_step, []

    def step_then_interrupt(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)        # Ctrl-C during step 2
        return real_step(*a, **kw)

    monkeypatch.setattr(run, "train_step", step_then_interrupt)
    before = signal.getsignal(signal.SIGINT)      # the default, or ignored in a background job
    out = tmp_path / "run"
    assert train.main(["--config", str(cfg_path), "--out", str(out), "--steps", "12", "--batch-size", "4",
                       "--seq-len", "32", "--dense-steps", "6", "--warmup-steps", "2", "--lr", "1e-2",
                       "--max-files", "6", "--eval-every", "6", "--save-every", "6", "--eval-batches", "2"]) == 0
    captured = capsys.readouterr()
    assert "interrupted: saving a checkpoint" in captured.err and "stopped: saved step 2" in captured.out
    step_1 = next(line for line in captured.out.splitlines() if line.startswith("step     1/12"))
    assert re.search(r"\| \d+\.\d\d s/step, \d:\d\d:\d\d left, \d+\.\d\d GiB"
                     r"( \| compiled \d+ program\(s\) in \d+\.\d s)?$", step_1), step_1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records and all(r["memory_gib"] > 0 for r in records if "loss" in r)
    assert len(calls) == 2 and (out / "checkpoints" / "2").is_dir()
    assert signal.getsignal(signal.SIGINT) is before                         # handlers restored

    with run.StopSignals() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_cpu_runs_do_not_start_the_tpu_runtime():
    """With libtpu installed and no TPU chip, jax would start the TPU runtime and print 'TPU worker
    hostnames' errors; the front ends choose the platforms first."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: jax would not start the TPU runtime anyway")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "from glm_jax.frontends import cli; print(cli.choose_platforms()); import jax; print(jax.default_backend())"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["cpu", "cpu"]
    assert "TPU" not in done.stderr and "E0000" not in done.stderr, done.stderr
    # a host with TPU chips, or JAX_PLATFORMS already set: left as it is
    assert cli.choose_platforms({}, tpu_chips=True) is None
    assert cli.choose_platforms({"JAX_PLATFORMS": "tpu"}, tpu_chips=False) is None


def test_long_context_eval_on_a_cpu_does_not_start_the_tpu_runtime():
    """benchmarks/long_context_eval.py (after the --dev setup, which installs libtpu) chooses the
    platforms before its first jax call, as the front ends do: no libtpu errors on a CPU host."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("libtpu") is None or cli.has_tpu_chips():
        pytest.skip("needs libtpu installed on a host without TPU chips")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "benchmarks/long_context_eval.py", "--smoke", "--model", "/nonexistent"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "/nonexistent: failed" in done.stdout, done.stdout + done.stderr
    assert "device: cpu" in done.stderr and "TPU" not in done.stderr and "E0000" not in done.stderr, done.stderr


def test_mesh_too_large_to_simulate_is_refused_at_once(capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    assert decode.main(["--mesh", "data=100000", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: mesh data=100000,") and "simulated" in err


def test_copies_of_the_model_beyond_host_memory_are_refused(monkeypatch):
    from types import SimpleNamespace

    from glm_jax import sharding

    mesh = SimpleNamespace(shape={"data": 8, "context": 1, "tensor": 1, "layer": 1},
                           devices=np.array([SimpleNamespace(platform="cpu")]))
    monkeypatch.setattr(sharding, "_available_host_bytes", lambda: 4 * 2**30)
    sharding.check_host_memory(mesh, 100 * 2**20)                      # 9 copies of 100 MiB fit in 4 GiB
    with pytest.raises(ShardingError, match=r"holds 8 copies .* 4.0 GiB available"):
        sharding.check_host_memory(mesh, 2**30)
    mesh.devices = np.array([SimpleNamespace(platform="gpu")])
    sharding.check_host_memory(mesh, 2**30)                            # device memory: not this check


@pytest.mark.parametrize("content, expected", [
    (b'"first prompt"\n{"prompt": "x", }\n', "prompts.jsonl:2: not JSON ("),      # the message varies by Python
    ('"caf\u00e9"\n'.encode("latin-1"), "prompts.jsonl:1: not UTF-8 text (byte 0xe9 at offset 4)"),
])
def test_prompts_file_errors_name_the_file_and_line(trained_run, tmp_path, capsys, content, expected):
    out, _ = trained_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(content)
    assert decode.main(["--checkpoint", str(out), "--prompts-file", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {prompts}:") and expected in err



def test_compile_summary_names_the_step_however_fast():
    """train.py's `compiled:` line names the step and its builds even when each took under the
    line's 1 s (a step loaded from the persistent compilation cache); other fast programs are
    counted together."""
    from glm_jax.training.compiles import CompileWatch

    def train_step(x):
        return x * 2 + 1

    step = jax.jit(train_step)
    with CompileWatch() as watch:
        step(np.ones(3, np.float32))
        step(np.ones(4, np.float32))
    assert re.fullmatch(r"jit\(train_step\) 2x \d+\.\d s", watch.summary(always=("jit(train_step)",)))
    assert re.fullmatch(r"2 smaller program\(s\) \d+\.\d s", watch.summary())
