"""Launching a script as several processes on one CPU host (jax.distributed over gloo), each
with its own simulated CPU devices, as tests of several hosts do."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile

import jax

from conftest import ROOT, simulated_devices_env

# The gloo library writes its connection log to stdout from C++, one line per rank from several
# threads: the lines can come torn into pieces, interleaved with each other and with Python's
# output. Every piece is removed; none is part of the text.
GLOO_PREFIX = re.compile(r"\[Gloo\] Rank ")
GLOO_LOG = re.compile(r"\d*\s*is connected to \d+ peer ranks\. Expected number of connected peer ranks is : \d+\n?")


def gloo_available() -> bool:
    """Whether this jax build can run CPU collectives across processes (jax_cpu_collectives_implementation)."""
    return hasattr(jax.config, "jax_cpu_collectives_implementation")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, args: list[str], devices: int, env: dict | None = None) -> subprocess.Popen:
    """ROOT/script in a fresh interpreter that simulates `devices` CPU devices (`env`: more
    environment variables)."""
    env = simulated_devices_env(devices, **(env or {}))
    # Files, not pipes: a process blocked on a full pipe would stall the collectives of the others.
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=env, text=True,
                            stdout=out, stderr=err)
    proc.logs = out, err
    return proc


def launch_processes(script: str, args: list[str], processes: int, devices: int,
                     env: dict | None = None) -> list[subprocess.Popen]:
    """`processes` processes of one run, `devices` each, joined through a coordinator on this host."""
    hosts = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", str(processes)]
    return [launch(script, args + hosts + ["--process-id", str(i)], devices, env) for i in range(processes)]


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    """-> (stdout without gloo's log, stderr) of a process that must succeed."""
    proc.wait(timeout=timeout)
    out, err = (f.seek(0) or f.read() for f in proc.logs)
    assert proc.returncode == 0, err[-4000:]
    out = GLOO_LOG.sub("", GLOO_PREFIX.sub("", out))
    return "".join(line for line in out.splitlines(keepends=True) if "[Gloo]" not in line), err
