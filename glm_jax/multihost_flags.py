"""The command-line flags by which one process of several joins a run (see glm_jax.multihost);
free of jax, so that --help answers at once."""

from __future__ import annotations

import argparse


def add_distributed_flags(ap: argparse.ArgumentParser, writes: str) -> None:
    """--coordinator, --num-processes, --process-id and --distributed; `writes`: what only
    process 0 writes, for the help text."""
    hosts = ap.add_argument_group("several processes (hosts)", "every process runs the same command; "
                                  f"the mesh spans all their devices; only process 0 prints and writes {writes}")
    hosts.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="process 0's address, which every process gives (with --num-processes, --process-id)")
    hosts.add_argument("--num-processes", type=int, default=None, metavar="N")
    hosts.add_argument("--process-id", type=int, default=None, metavar="I", help="0..N-1")
    hosts.add_argument("--distributed", action="store_true",
                       help="join a multi-process run that jax.distributed detects by itself (TPU pod, SLURM, "
                            "Open MPI, or JAX_COORDINATOR_ADDRESS in the environment, which also turns this on)")
