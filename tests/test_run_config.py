"""The settings of a run (glm_jax.settings, glm_jax.training.run_config): validation of every
number in one line, the YAML file with flags over it, and what a --resume may change."""

from __future__ import annotations

import dataclasses

import pytest

import train
from glm_jax import settings
from glm_jax.training import run_config
from glm_jax.training.run_config import TrainConfig


@pytest.mark.parametrize("program,flags,message", [
    ("train", ["--steps", "-5"], "--steps (schedule.steps) must be >= 1, got -5"),
    ("train", ["--batch-size", "0"], "--batch-size (data.batch_size) must be >= 1, got 0"),
    ("train", ["--lr", "-1"], "--lr (schedule.lr) must be >= 0, got -1.0"),
    ("train", ["--stop-after", "-1"], "--stop-after (stop_after) must be >= 1, got -1"),
    ("train", ["--seq-len", "0"], "--seq-len (data.seq_len) must be >= 1, got 0"),
    ("train", ["--mtp-weight", "-0.5"], "--mtp-weight (losses.mtp_weight) must be >= 0, got -0.5"),
    ("train", ["--eval-batches", "0"], "--eval-batches (logging.eval_batches) must be >= 1, got 0"),
    ("train", ["--peak-tflops", "0"], "--peak-tflops (logging.peak_tflops) must be > 0, got 0.0"),
    ("train", ["--prefetch-batches", "-1"], "--prefetch-batches (data.prefetch_batches) must be >= 0, got -1"),
    ("decode", ["--serve", "--port", "-1"], "--port (port) must be >= 0, got -1"),
    ("decode", ["--serve", "--port", "70000"], "--port (port) must be <= 65535, got 70000"),
    ("decode", ["--serve", "--page-size", "0"], "--page-size (page_size) must be >= 1, got 0"),
    ("decode", ["--max-new-tokens", "0"], "--max-new-tokens (max_new_tokens) must be > 0, got 0"),
    ("decode", ["--speculative", "-1"], "--speculative (speculative) must be >= 0, got -1"),
    ("decode", ["--max-batch", "0"], "--max-batch (max_batch) must be >= 1, got 0"),
    ("decode", ["--prefill-chunk", "0"], "--prefill-chunk (prefill_chunk) must be >= 1, got 0"),
])
def test_bad_numbers_are_one_line_and_exit_2_before_any_work(tmp_path, capsys, program, flags, message):
    """train.py creates no run directory; decode.py (--serve too) loads no model: it names none that exists."""
    import decode

    where = {"train": ["--out", str(tmp_path / "run")], "decode": ["--checkpoint", str(tmp_path / "no-model")]}
    assert {"train": train, "decode": decode}[program].main(where[program] + flags) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {message}"]
    assert not (tmp_path / "run").exists()


def test_out_is_required(capsys):
    assert train.main(["--steps", "5"]) == 2
    assert capsys.readouterr().err.startswith("error: --out: give the run directory")


def test_run_config_file_with_flags_over_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("out: runs/a\nschedule:\n  lr: 1e-3\n  steps: 40\ndata:\n  data: [a.txt, b.jsonl]\n")
    got = train.train_config(train.parse_args(["--run-config", str(path), "--steps", "50"]))
    assert (got.out, got.schedule.lr, got.schedule.steps, got.data.data) == ("runs/a", 1e-3, 50, ("a.txt", "b.jsonl"))
    assert got.schedule.warmup_steps == TrainConfig().schedule.warmup_steps


@pytest.mark.parametrize("text,message", [
    ("schedule:\n  step: 5\n", "unknown setting 'schedule.step'"),
    ("schedule:\n  steps: many\n", "--steps (schedule.steps) must be an integer, got 'many'"),
    ("data: 5\n", "expected a mapping of settings, got int"),
])
def test_bad_run_config_file_is_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert train.main(["--run-config", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message in err[0]


def test_settings_file_written_and_read_back(tmp_path):
    written = settings.with_values(TrainConfig(), {"out": "x", "lr": 5e-4, "data": ("a.txt",), "mtp_kv_share": False,
                                                   "peak_tflops": 989})
    run_config.save(written, tmp_path)
    assert run_config.load(tmp_path / run_config.FILE_NAME) == dataclasses.replace(written, out=None)   # the run's only


def test_resume_names_each_change_and_refuses_the_data_order():
    old = TrainConfig(out="a")
    new = settings.with_values(old, {"out": "b", "resume": True, "lr": 1e-3, "steps": 900})
    assert run_config.resume_changes(old, new) == ["resume: schedule.steps (--steps) 600 -> 900",
                                                   "resume: schedule.lr (--lr) 0.003 -> 0.001"]
    with pytest.raises(settings.SettingError, match=r"--resume cannot change data.seq_len \(--seq-len\) 256 -> 128: "
                                                    r"it fixes the order of the batches.*; resume with --seq-len 256, "):
        run_config.resume_changes(old, settings.with_values(new, {"seq_len": 128}))
    assert "no run_config.yaml" in run_config.resume_changes(None, new)[0]


def test_hints_name_the_interpreter_as_run_from_the_working_directory(tmp_path, monkeypatch):
    from glm_jax.frontends import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert cli.python_command() == ".venv/bin/python"
    monkeypatch.setattr("sys.executable", "/usr/bin/python3")
    assert cli.python_command() == "/usr/bin/python3"


def test_every_settings_class_is_frozen_and_hashable(tmp_path):
    """Settings may be static arguments of jitted functions: equal settings hash equal, a
    kernel_config (a FrozenDict) included, and one read back from run_config.yaml too."""
    from glm_jax.decoding.decode_config import DecodeConfig
    from glm_jax.serving.serve_config import ServeConfig

    classes = [TrainConfig, DecodeConfig, ServeConfig] + [f.default_factory for f in dataclasses.fields(TrainConfig)
                                                          if settings._is_section(f)]
    every = lambda cls: {c for sub in cls.__subclasses__() for c in {sub} | every(sub)}
    assert set(classes) == every(settings.Settings)       # none left out
    for cls in classes:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        assert hash(cls()) == hash(cls()), cls
    configs = {"attention": {"block_k": 64}, "indexer": {"q_chunk": 16}}
    a = settings.with_values(TrainConfig(out="r"), {"kernel_config": configs})
    b = settings.with_values(TrainConfig(out="r"), {"kernel_config": dict(reversed(configs.items()))})
    assert a == b and hash(a) == hash(b) and a.kernels.kernel_config == configs
    assert hash(DecodeConfig(kernel_config=configs)) == hash(DecodeConfig(kernel_config=configs))
    with pytest.raises(AttributeError):
        a.kernels.kernel_config.pairs = ()
    run_config.save(a, tmp_path)
    assert "block_k: 64" in (tmp_path / run_config.FILE_NAME).read_text()
    back = run_config.load(tmp_path / run_config.FILE_NAME)
    assert hash(back) == hash(dataclasses.replace(a, out=None)) and back.kernels.kernel_config == configs


def test_every_parser_default_is_its_settings_default():
    """A default is written once, in its settings class: train.py's flags are generated from
    TrainConfig, decode.py's from DecodeConfig and ServeConfig; no flag given, the settings are
    the classes' defaults."""
    import decode
    from glm_jax.decoding.decode_config import DecodeConfig
    from glm_jax.serving.serve_config import ServeConfig

    assert train.parse_args(["--out", "r"]).settings == TrainConfig(out="r")
    command = decode.parse_args([])
    assert command.settings == DecodeConfig() and command.serving == ServeConfig()
    assert decode.decode_config(command) == DecodeConfig()


def test_decode_settings_file_with_flags_over_it(tmp_path):
    """decode.py --decode-config FILE: the same mechanism as train.py's --run-config."""
    import decode

    path = tmp_path / "decode.yaml"
    path.write_text("temperature: 0.7\ntop_k: 0\nkernel_config:\n  attention: {q_chunk: 32}\n")
    command = decode.parse_args(["--decode-config", str(path), "--top-k", "5", "--kernel-config",
                                 "indexer.q_chunk=16"])
    settings = decode.decode_config(command)
    assert (settings.temperature, settings.top_k) == (0.7, 5)
    assert settings.kernel_config == {"attention": {"q_chunk": 32}, "indexer": {"q_chunk": 16}}


def test_the_flags_of_before_keep_their_spellings():
    """Every flag train.py and decode.py took before their parsers were generated is accepted
    as it was spelled (--init-from-hf: a deprecated spelling of --hf-checkpoint)."""
    import decode

    got = train.parse_args(
        "--out r --steps 7 --batch-size 3 --seq-len 64 --lr 1e-3 --warmup-steps 2 --decay-steps 4 --dense-steps 1 "
        "--indexer-weight 0.5 --mtp-weight 0.2 --mtp-depth 2 --tv-weight 0.1 --no-mtp-kv-share --log-every 2 "
        "--metrics-file m.jsonl --peak-tflops 900 --eval-every 5 --eval-batches 2 --save-every 3 --data a b "
        "--heldout-data c --max-files 9 --prefetch-batches 0 --data-shards 2 --seed 1 --export-dtype bfloat16 "
        "--resume --stop-after 2 --remat --keep-attention --mesh data=2 --attention-form absorbed "
        "--attention-impl xla --indexer-impl xla --kernel-config attention.q_chunk=8 --coordinator h:1 "
        "--num-processes 2 --process-id 1 --distributed --init-from-hf hf/ --config c.yaml "
        "--context-length 512".split())
    s = train.train_config(got)
    assert (s.out, s.schedule.steps, s.data.data, s.losses.mtp_kv_share, s.kernels.keep_attention) == \
        ("r", 7, ("a", "b"), False, True)
    assert (s.model.hf_checkpoint, s.model.context_length, s.kernels.kernel_config) == \
        ("hf/", 512, {"attention": {"q_chunk": 8}})
    assert (got.coordinator, got.num_processes, got.process_id, got.distributed) == ("h:1", 2, 1, True)
    assert train.parse_args(["--checkpoint", "d", "--out", "r"]).settings.model.checkpoint == "d"
    got = decode.parse_args(
        "--checkpoint d --config c --prompt p --prompt-file f --prompt-ids 1,2 --prompts-file g --output o "
        "--max-new-tokens 5 --max-len 64 --temperature 0.5 --top-p 0.9 --top-k 3 --min-p 0.1 --seed 2 "
        "--speculative 2 --no-kv-share --prefill-chunk 8 --batch-invariant --max-batch 2 --decode-steps 2 --quiet "
        "--mesh data=1 --collective psum --compile-only --topology v5p:2x2x1 --max-context 128 --batch 2 "
        "--attention-impl xla --indexer-impl xla --kernel-config attention.q_chunk=8 --coordinator h:1 "
        "--num-processes 2 --process-id 0 --distributed --serve --host 0.0.0.0 --port 9 --page-size 8 "
        "--step-token-budget 64".split())
    s = decode.decode_config(got)
    assert (s.top_k, s.kv_share, s.batch_invariant, s.collective, s.kernel_config) == \
        (3, False, True, "psum", {"attention": {"q_chunk": 8}})
    assert (got.prompt_ids, got.quiet, got.serve, got.compile_only, got.batch, got.serving.port) == \
        ("1,2", True, True, True, 2, 9)
    assert decode.parse_args(["--init-from-hf", "hf/"]).hf_checkpoint == "hf/"
