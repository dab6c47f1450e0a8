"""Named fault points for fault-injection tests (failpoints, as storage engines test themselves).

    GLM_JAX_FAULT=POINT@N[:ACTION] python train.py ...

makes the process, the N-th time it reaches POINT (`reached(POINT, N)`), either kill itself
with SIGKILL (ACTION `kill`, the default: as `kill -9` or a lost machine would) or, with
`disk-full`, make every later write to a file fail as on a full disk (the file-size limit set to
0: writes fail with EFBIG, SIGXFSZ ignored). Without the variable `reached` does nothing.

The points train.py passes (`glm_jax.training.loop` and `.saving`): `step@N` (step N dispatched, the device
computing it), `save@N` (checkpoint N handed to the asynchronous writer, its files being
written), `export` (the final weights being written).
"""

from __future__ import annotations

import os
import signal
import sys

#: The environment variable that names the fault.
ENV = "GLM_JAX_FAULT"
ACTIONS = ("kill", "disk-full")


def parse(spec: str) -> tuple[str, int | None, str]:
    """'POINT[@N][:ACTION]' -> (point, N or None, action)."""
    where, _, action = spec.partition(":")
    point, _, at = where.partition("@")
    action = action or "kill"
    if not point or action not in ACTIONS or (at and not at.isdigit()):
        raise ValueError(f"{ENV}={spec!r}: expected POINT[@N][:ACTION] with ACTION one of {', '.join(ACTIONS)}")
    return point, int(at) if at else None, action


def reached(point: str, index: int | None = None) -> None:
    """Inject the fault that GLM_JAX_FAULT names if it names this point (and index)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want, at, action = parse(spec)
    if want != point or (at is not None and at != index):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
