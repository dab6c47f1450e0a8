"""Shared fixtures: a micro GLM config (float32, a few IndexShare groups, MoE, MTP)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the run, shared by both test workers and by the train.py
# and decode.py processes the tests start (they inherit the environment): a resumed or
# re-sharded run compiles the programs of the run it is compared with, and recompiling them took
# most of the suite's time. Entries are keyed by the program and the jax version, so a stale
# cache is never wrong, only unused. Only programs that took a second or more to compile are
# written: those are what the repeated processes share, and serialising every small program
# made thousands of writes (once, XLA aborted inside one: `executable.serialize()`).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax-compilation"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
#: XLA flags of every test process: the CPU backend generates code at LLVM -O0. The tests spend
#: their time compiling small programs, not running them, and every comparison is made within
#: one setting.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
# Ahead-of-time TPU compilation (libtpu, no TPU) from several test workers at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import pytest  # noqa: E402

# The test workers themselves neither read nor write the cache (the processes they start do, by
# the environment above): in three of five fresh-clone runs a worker crashed inside XLA's
# `executable.serialize()` writing an entry, always late in its run.
jax.config.update("jax_enable_compilation_cache", False)

from glm_jax.config import GLMConfig, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def in_own_process(nodeid: str) -> bool:
    """True inside the process `nodeid` was started in by this function; else runs that one test
    in a fresh pytest process (asserting it passed) and returns False, for the caller to return.
    For tests whose compile crashed XLA late in a long-lived test worker but never alone."""
    if os.environ.get("GLM_TEST_OWN_PROCESS") == nodeid:
        return True
    out = run_pytest(nodeid, GLM_TEST_OWN_PROCESS=nodeid)
    assert "1 passed" in out, out[-3000:]
    return False


def run_pytest(target: str, **env) -> str:
    """Runs pytest on `target` (a file or a test id) in a fresh process with `env` added; asserts
    it passed and returns its output."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and " failed" not in proc.stdout, out[-3000:]
    return out


def micro_config(**changes) -> GLMConfig:
    base = load_config(ROOT / "configs" / "tiny.yaml").replace(
        name="micro", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=16,
        index_topk=4, index_topk_pattern="FSSFS", max_position_embeddings=64, dtype="float32")
    return base.replace(**changes)


def jaxpr_equations(jaxpr):
    """The equations of a jaxpr and of the jaxprs nested in them (loop bodies, custom rules)."""
    import jax

    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from jaxpr_equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from jaxpr_equations(sub)


@contextlib.contextmanager
def counting_compiles():
    """Yields a Counter of compilations per jitted function name ('jit(name)') made inside the
    block; a program taken from the persistent compilation cache counts too
    (`glm_jax.training.compiles.CompileWatch`)."""
    from glm_jax.training.compiles import CompileWatch

    with CompileWatch() as watch:
        yield watch.counts


@pytest.fixture
def micro_cfg() -> GLMConfig:
    return micro_config()


def simulated_devices_env(devices: int, **extra: str) -> dict[str, str]:
    """The environment of a test subprocess with `devices` simulated CPU devices (the count is
    fixed before jax starts)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}", **extra}


def tpu_compile_mesh(topology: str):
    """A one-device mesh of an ahead-of-time TPU topology (libtpu, no TPU); skips without it."""
    pytest.importorskip("libtpu")
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # libtpu present but unable to describe TPUs here
        pytest.skip(f"no TPU topology: {e}")
    return Mesh(np.array(topo.devices)[:1], ("x",))


def one_device_flags(cfg_path, out, *extra: str) -> list[str]:
    """train.py's flags of the one-device reference run (`one_device_run`) into `out`; `extra`
    adds flags or overrides them (the last of a flag given twice counts)."""
    return ["--config", str(cfg_path), "--out", str(out), "--steps", "5", "--batch-size", "2", "--seq-len", "16",
            "--dense-steps", "1", "--warmup-steps", "1", "--max-files", "4", "--eval-every", "100",
            "--log-every", "1", "--eval-batches", "1", "--save-every", "1", *extra]


def train_process(args: list[str], env: dict | None = None, timeout: float = 600):
    """train.py with `args` in a fresh process (on one device unless `env` says otherwise) ->
    the finished subprocess.CompletedProcess."""
    import subprocess

    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


#: conftest's micro config with 320 tokens and 128 positions, cut to one IndexShare group of two
#: layers (Full: a dense MLP; Shared: MoE) and the MTP layer: the kills, resumes and meshes of
#: the tests that use the one-device run do not depend on the depth, and each train.py process
#: traces and compiles half the layers.
TWO_LAYER_MICRO = dict(vocab_size=320, max_position_embeddings=128, num_hidden_layers=2, index_topk_pattern="FS")


@pytest.fixture(scope="session")
def one_device_run(tmp_path_factory):
    """train.py on one device in a fresh process, uninterrupted, with `one_device_flags` (5 steps,
    the first dense, a checkpoint after every step) on `TWO_LAYER_MICRO`: the losses the killed
    and resumed runs of test_faults.py reproduce bit for bit and the sharded runs of
    test_train_sharding.py equal; one run for both (their modules are collected first, so one
    test worker starts on both). -> (the config's path, the run directory, the finished
    subprocess.CompletedProcess)"""
    root = tmp_path_factory.mktemp("one-device")
    cfg_path = root / "micro.yaml"
    from glm_jax.config import save_config

    save_config(micro_config(**TWO_LAYER_MICRO), cfg_path)
    finished = train_process(one_device_flags(cfg_path, root / "run"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    return cfg_path, root / "run", finished


#: The modules whose tests start train.py processes or compile the most (several minutes of the
#: suite between them): collected first, so the two workers start on them and the many short
#: tests fill in around them, instead of one long test running alone at the end.
LONGEST_FIRST = ("test_train_multihost.py", "test_cli.py", "test_context_parallel.py", "test_faults.py",
                 "test_train_sharding.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: the rest keep their order


#: Tests whose worker died under them once in this run (`pytest_handlecrashitem`).
CRASHED: set[str] = set()


@pytest.hookimpl(optionalhook=True)      # a pytest-xdist hook (the dev extra)
def pytest_handlecrashitem(crashitem, report, sched):
    """A test worker died in a test (XLA's CPU compiler has segfaulted in long-lived workers,
    never in the test alone): the test runs once more on the fresh worker xdist starts, and the
    crash is reported as a rerun ("R", counted in the summary); a second crash is the failure.
    (pytest-xdist's load scheduling re-queues it; its scope scheduling would hang instead.)"""
    if crashitem not in CRASHED:
        CRASHED.add(crashitem)
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", "RERUN"
