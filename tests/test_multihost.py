"""decode.py as several processes on one CPU host: 2 processes of 4 simulated devices each,
joined by jax.distributed (gloo collectives), print the same greedy text as 1 process with 8
devices on the same mesh and as 1 device without a mesh."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import jax
import pytest

from conftest import ROOT
from glm_jax.multihost import DistributedSetup, DistributedSetupError

# The gloo library writes its connection log to stdout from C++ (interleaved with Python's
# output, not always with its own newline); it is not part of the text.
GLOO_LOG = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                      r"Expected number of connected peer ranks is : \d+\n?")
PROMPTS = ["import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def push(self, x):"]


def _gloo_available() -> bool:
    """Whether this jax build can run CPU collectives across processes (jax_cpu_collectives_implementation)."""
    return hasattr(jax.config, "jax_cpu_collectives_implementation")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], devices: int) -> subprocess.Popen:
    """decode.py in a fresh interpreter that simulates `devices` CPU devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, str(ROOT / "decode.py"), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    out = GLOO_LOG.sub("", out)
    return "".join(line for line in out.splitlines(keepends=True) if "[Gloo]" not in line), err


def _decode_everywhere(tmp_path, common: list[str], mesh: str) -> dict:
    """The same decode as 1 device, as 1 process of 8 devices, and as 2 processes of 4 devices
    (run at once). -> {"1 device", "1 process", "process 0", "process 1"}: (stdout, stderr),
    plus "output": the --output rows of the 2-process run."""
    port, result = _free_port(), tmp_path / "out.jsonl"
    hosts = ["--mesh", mesh, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--output", str(result)]
    procs = {f"process {i}": _launch(common + hosts + ["--process-id", str(i)], 4) for i in range(2)}
    procs["1 process"] = _launch(common + ["--mesh", mesh], 8)
    procs["1 device"] = _launch(common, 1)
    runs = {name: _finish(p) for name, p in procs.items()}
    runs["output"] = [json.loads(line) for line in result.read_text().splitlines()]
    return runs


@pytest.mark.skipif(not _gloo_available(), reason="this jax build has no gloo CPU collectives, so CPU "
                                                   "processes cannot run collectives together")
def test_two_processes_print_the_single_process_text(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    runs = _decode_everywhere(tmp_path, ["--prompts-file", str(prompts), "--temperature", "0",
                                         "--max-new-tokens", "8", "--speculative", "0"], "data=2,layer=4")
    text = runs["process 0"][0]
    assert "===== prompt 1 =====" in text and text.count("\n") > 6
    assert text == runs["1 process"][0] == runs["1 device"][0]
    assert "mesh data=2,layer=4" in runs["process 0"][1] and "tokens/s" in runs["process 0"][1]
    assert runs["process 1"][0].strip() == "" and "tokens/s" not in runs["process 1"][1]
    assert [r["prompt"] for r in runs["output"]] == PROMPTS
    assert all(r["completion"] and r["completion"] in text for r in runs["output"])


@pytest.mark.slow
@pytest.mark.skipif(not _gloo_available(), reason="this jax build has no gloo CPU collectives")
def test_two_processes_speculative_layer_split_across_processes(tmp_path):
    """decode.py's default (MTP speculative) path, with the KV cache's layers split over the
    devices of both processes."""
    runs = _decode_everywhere(tmp_path, ["--temperature", "0", "--max-new-tokens", "8"], "data=1,layer=8")
    text = runs["process 0"][0]
    assert text.startswith(PROMPTS[0]) and len(text) > len(PROMPTS[0]) + 4
    assert text == runs["1 process"][0] == runs["1 device"][0]
    assert "speculative" in runs["process 0"][1]


def test_distributed_flags_must_come_together():
    DistributedSetup().check()
    DistributedSetup(coordinator="10.0.0.1:1234", num_processes=2, process_id=1).check()
    with pytest.raises(DistributedSetupError, match="--num-processes given without --coordinator, --process-id"):
        DistributedSetup(num_processes=2).check()
    with pytest.raises(DistributedSetupError, match="HOST:PORT"):
        DistributedSetup(coordinator="10.0.0.1", num_processes=2, process_id=0).check()
    with pytest.raises(DistributedSetupError, match="0..1"):
        DistributedSetup(coordinator="h:1", num_processes=2, process_id=2).check()


def test_decode_refuses_half_given_flags(capsys):
    import decode

    assert decode.main(["--num-processes", "2", "--process-id", "0"]) == 2
    assert "given without --coordinator" in capsys.readouterr().err
