"""Launching a script as several processes on one CPU host (jax.distributed over gloo), each
with its own simulated CPU devices, as tests of several hosts do."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile

import jax

from conftest import ROOT, simulated_devices_env

# Runs a script with Python's sys.stdout on the process's stdout and file descriptor 1 on
# /dev/null: the gloo library writes its connection log to fd 1 from C++, from several threads,
# torn into pieces among Python's text, so it is kept out of the text where it starts.
_RUN_SCRIPT = r"""
import os, runpy, sys
text = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
sys.stdout = text
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


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
    proc = subprocess.Popen([sys.executable, "-c", _RUN_SCRIPT, str(ROOT / script), *args], cwd=ROOT, env=env,
                            text=True, stdout=out, stderr=err)
    proc.logs = out, err
    return proc


def launch_processes(script: str, args: list[str], processes: int, devices: int,
                     env: dict | None = None) -> list[subprocess.Popen]:
    """`processes` processes of one run, `devices` each, joined through a coordinator on this host."""
    hosts = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", str(processes)]
    return [launch(script, args + hosts + ["--process-id", str(i)], devices, env) for i in range(processes)]


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    """-> (stdout, stderr) of a process that must succeed."""
    proc.wait(timeout=timeout)
    out, err = (f.seek(0) or f.read() for f in proc.logs)
    assert proc.returncode == 0, err[-4000:]
    return out, err
