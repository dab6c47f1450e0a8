"""Several processes, one program: start jax.distributed, place host values as global arrays,
and bring results back to every host.

Every process runs the same command on the same inputs. After `initialize_distributed`,
`jax.devices()` lists the devices of all processes and a mesh spans them. A host value (the
same on every process) becomes a global array with `global_array`: each process builds only
its own addressable shards from its copy, so nothing is sent. `to_host` gathers a global
array into a numpy array on every process, so all of them see the same sampled tokens.
Training batches differ per process: each reads only the rows its devices hold
(`process_rows`) and `jax.make_array_from_process_local_data` joins them.

With one process these are plain `jax.device_put` and `np.asarray`.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


class DistributedSetupError(ValueError):
    """Distributed flags that do not describe a run (e.g. a process count without a coordinator)."""


@dataclass(frozen=True)
class DistributedSetup:
    """How this process joins a multi-process run.

    coordinator/num_processes/process_id given together: an explicit launch (e.g. 2 processes
    on one CPU host). All None with `auto`: jax.distributed.initialize() finds them itself
    (TPU pods, SLURM, Open MPI, or JAX_COORDINATOR_ADDRESS and friends in the environment)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False

    @property
    def enabled(self) -> bool:
        return self.auto or self.coordinator is not None

    def check(self) -> None:
        given = {"--coordinator": self.coordinator, "--num-processes": self.num_processes,
                 "--process-id": self.process_id}
        missing = [flag for flag, value in given.items() if value is None]
        if len(missing) not in (0, 3):
            present = ", ".join(flag for flag in given if flag not in missing)
            raise DistributedSetupError(
                f"{present} given without {', '.join(missing)}: give --coordinator HOST:PORT, --num-processes N and "
                "--process-id I together (or --distributed to let jax.distributed find them on a TPU pod or "
                "under SLURM)")
        if self.coordinator is None:
            return
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise DistributedSetupError(f"--coordinator {self.coordinator!r}: expected HOST:PORT, "
                                        "e.g. 10.0.0.1:1234 (process 0's address)")
        if self.num_processes < 1:
            raise DistributedSetupError(f"--num-processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise DistributedSetupError(f"--process-id must be in 0..{self.num_processes - 1} for "
                                        f"--num-processes {self.num_processes}, got {self.process_id}")


def initialize_distributed(setup: DistributedSetup) -> None:
    """Join the run described by `setup` (checked first). Call before anything else uses jax.

    CPU processes talk through gloo collectives; the setting only affects the CPU platform, so it
    is harmless on TPU and GPU hosts."""
    setup.check()
    if not setup.enabled:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(setup.coordinator, setup.num_processes, setup.process_id)


def is_main_process() -> bool:
    """Process 0 prints and writes files; the others compute the same thing silently."""
    return jax.process_index() == 0


@contextlib.contextmanager
def stdout_of_main_process_only():
    """Within: what the other processes print to stdout goes nowhere (stderr stays)."""
    if is_main_process():
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def barrier(name: str) -> None:
    """Wait until every process gets here (e.g. for a file process 0 writes); a no-op alone."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def allgather_json(value) -> list:
    """[value of process 0, value of process 1, ...] on every process, for JSON-serializable
    values that differ per process. Every process must call it."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))           # uint8 [processes, max size]
    return [json.loads(row[:size].tobytes()) for row, size in zip(rows, sizes)]


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on some process (e.g. a stop request only some of them received)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def process_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> range:
    """The rows (dim 0) of a global array of `shape` with `sharding` that this process's devices
    hold, e.g. range(0, 8) of a [16, L] batch split over the devices of 2 processes."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(shape[0])[:2]))
    if len(rows) != max(rows) + 1 - min(rows):
        raise ValueError(f"this process holds rows {sorted(rows)} of an array of shape {shape}, which are "
                         "not consecutive; order the mesh's devices by process")
    return range(min(rows), max(rows) + 1)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def global_array(x, sharding: NamedSharding) -> jax.Array:
    """A host value (numpy or a process-local jax array, the same on every process) as a global
    array with `sharding`: each process fills its addressable shards from its own copy."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(global_array(jax.random.key_data(x), sharding),
                                        impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(tree, shardings):
    """`global_array` over a pytree and a matching pytree of shardings."""
    return jax.tree.map(global_array, tree, shardings)


def to_host(x) -> np.ndarray:
    """The whole value of a (possibly global) array as numpy, on every process."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
