"""How the decoding programs are compiled: on a GPU, optionally as CUDA graphs.

XLA launches a program on a GPU kernel by kernel from the host, and steps its loops there (a
`while_loop` whose condition depends on the data copies the condition to the host every
iteration). With `CUDA_GRAPH_OPTIONS` the program runs as CUDA graphs (XLA command buffers),
loops and conditionals included, so one launch replays many kernels. `Program` is a jitted
function that can be had compiled with such options; the serving engine's programs take them
through `compiler_options` too.

The programs take the model's parameters as one flat tuple of arrays and a static `ParamLayout`
(the graph definition and where the leaves go) rather than an nnx State: what a call costs the
host grows with the arrays passed and the static arguments hashed, and a layout hashes once.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from flax import nnx

#: XLA options that turn a program into CUDA graphs, loops (the layer scans) and conditionals
#: included, however few kernels a graph holds.
CUDA_GRAPH_OPTIONS = (("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"),
                      ("xla_gpu_graph_min_graph_size", 1))

Options = tuple[tuple[str, object], ...]


def compiler_options(backend: str, cuda_graphs: bool) -> Options:
    """The decoding programs' XLA options on `backend` (CUDA_GRAPH_OPTIONS on a GPU if asked),
    as (name, value) pairs."""
    return CUDA_GRAPH_OPTIONS if cuda_graphs and backend == "gpu" else ()


class ParamLayout:
    """How a program rebuilds the model from its flat parameters (hashable, its hash computed
    once): the graph definition, the nnx State's treedef and the leaves not passed, as
    shape-only placeholders (the MTP layer's, for the programs that never read it)."""

    def __init__(self, graphdef, treedef: jax.tree_util.PyTreeDef, skipped: tuple):
        # skipped: ((leaf index, jax.ShapeDtypeStruct), ...)
        self.graphdef, self.treedef, self.skipped = graphdef, treedef, skipped
        self._key = (graphdef, treedef, skipped)
        self._hash = hash(self._key)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, ParamLayout) and self._key == other._key)

    def model(self, params: tuple):
        """The model from the passed leaves, placeholders at the skipped ones."""
        passed = iter(params)
        skipped = dict(self.skipped)
        leaves = [skipped[i] if i in skipped else next(passed) for i in range(self.treedef.num_leaves)]
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


def flat_params(graphdef, state, *, mtp: bool) -> tuple[tuple, ParamLayout]:
    """The model state's arrays a program reads, as a flat tuple (without the MTP layer's
    unless `mtp`), and their layout."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    unused = set() if mtp else {i for i, (path, _) in enumerate(flat) if path[0] == jax.tree_util.DictKey("mtp")}
    params = tuple(x for i, (_, x) in enumerate(flat) if i not in unused)
    skipped = tuple((i, jax.ShapeDtypeStruct(flat[i][1].shape, flat[i][1].dtype)) for i in sorted(unused))
    return params, ParamLayout(graphdef, treedef, skipped)


class Program:
    """fn jitted with `jit_kwargs` (static and donated arguments); calling it calls that, and
    `with_options(options)` is the same program compiled with XLA options (`compiler_options`;
    () gives the plain one). One jitted function per set of options, kept for the process;
    `placed` makes one more with pinned output shardings (the engine's on a mesh)."""

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
        return self.placed(options)

    def placed(self, options: Options, **out):
        """A new jit of the same function with XLA `options` and what `out` pins (out_shardings:
        the engine's outputs on a mesh); the caller keeps it."""
        return jit(self._fn, options, **self._jit_kwargs, **out)


def jit(fn: Callable, options: Options = (), **jit_kwargs):
    """fn jitted with the XLA `options` ((name, value) pairs, `compiler_options`) and `jit_kwargs`:
    how every decoding program is built (`Program.with_options`, `engine_programs`)."""
    return jax.jit(fn, **(dict(compiler_options=dict(options)) if options else {}), **jit_kwargs)


def program(**jit_kwargs) -> Callable[[Callable], Program]:
    """A decorator: fn -> Program(fn, **jit_kwargs)."""
    return lambda fn: Program(fn, **jit_kwargs)
