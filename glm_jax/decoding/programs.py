"""How the decoding programs are compiled: on a GPU, optionally as CUDA graphs.

XLA launches a program on a GPU kernel by kernel from the host, and steps its loops there (a
`while_loop` whose condition depends on the data copies the condition to the host every
iteration). With `CUDA_GRAPH_OPTIONS` the program runs as CUDA graphs (XLA command buffers),
loops and conditionals included, so one launch replays many kernels. `Program` is a jitted
function that can be had compiled with such options; the serving engine's programs take them
through `compiler_options` too.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

#: XLA options that turn a program into CUDA graphs, loops (the layer scans) and conditionals
#: included, however few kernels a graph holds.
CUDA_GRAPH_OPTIONS = (("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"),
                      ("xla_gpu_graph_min_graph_size", 1))

Options = tuple[tuple[str, object], ...]


def compiler_options(backend: str, cuda_graphs: bool) -> Options:
    """The decoding programs' XLA options on `backend` (CUDA_GRAPH_OPTIONS on a GPU if asked),
    as (name, value) pairs."""
    return CUDA_GRAPH_OPTIONS if cuda_graphs and backend == "gpu" else ()


class Program:
    """fn jitted with `jit_kwargs` (static and donated arguments); calling it calls that, and
    `with_options(options)` is the same program compiled with XLA options (`compiler_options`;
    () gives the plain one). One jitted function per set of options, kept for the process."""

    def __init__(self, fn: Callable, **jit_kwargs):
        self._fn, self._jit_kwargs = fn, jit_kwargs
        self._plain = jax.jit(fn, **jit_kwargs)
        self.lower = self._plain.lower
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self._plain(*args, **kwargs)

    @functools.lru_cache(maxsize=4)
    def with_options(self, options: Options):
        if not options:
            return self._plain
        return jit(self._fn, options, **self._jit_kwargs)


def jit(fn: Callable, options: Options = (), **jit_kwargs):
    """fn jitted with the XLA `options` ((name, value) pairs, `compiler_options`) and `jit_kwargs`:
    how every decoding program is built (`Program.with_options`, `engine_programs`)."""
    return jax.jit(fn, **(dict(compiler_options=dict(options)) if options else {}), **jit_kwargs)


def program(**jit_kwargs) -> Callable[[Callable], Program]:
    """A decorator: fn -> Program(fn, **jit_kwargs)."""
    return lambda fn: Program(fn, **jit_kwargs)
