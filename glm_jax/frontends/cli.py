"""What the front ends share: how a mistake in the flags is reported, the processes a run joins,
the platforms, the interpreter a hint names, --kernel-config items, and the argparse flags naming
the model and the kernels of the programs whose parsers are still written by hand (the IndexShare
pattern search, `python -m glm_jax.frontends.indexcache_search`, and benchmarks). train.py's and
decode.py's parsers are generated from their settings classes (`settings_cli`).

    ap = argparse.ArgumentParser()
    cli.add_model_flags(ap, checkpoint="checkpoints/default")  # --checkpoint | --hf-checkpoint, --config
    cli.add_kernel_flags(ap)                                    # --attention-impl, --indexer-impl, --kernel-config

    @cli.reports_user_errors                  # UserError -> "error: <message>" on stderr, exit code 2
    def main(argv=None) -> int:
        args = ap.parse_args(argv)
        cli.choose_platforms()                # before the first jax computation
        with cli.user_errors():               # ValueError, FileNotFoundError -> UserError
            model = load_model(cli.model_source(args), config=...)
        ... Generator(model, forward=ForwardOptions(kernels=cli.kernel_choice(args))) ...

Free of jax at import (the functions import what they need); the kernel flags read their choices
from the pallas_kernels registry, so building a parser imports jax (about a second).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from pathlib import Path

# ---------------------------------------------------------------------- errors
#: The errors a user causes, whose message names the fix: a bad config (ConfigError), a
#: checkpoint of another config (CheckpointMismatchError, CheckpointConversionError), a mesh
#: that does not fit (ShardingError), a prompt too long (ContextTooLongError), bad data
#: (DataError), distributed flags that describe no run (DistributedSetupError) - all of them
#: ValueErrors - and a file that is not there.
USER_ERRORS = (ValueError, FileNotFoundError)


class UserError(Exception):
    """A mistake in the flags or in the files they name; the message says what to change."""


@contextlib.contextmanager
def user_errors():
    """Within: a USER_ERRORS exception becomes a UserError with its message. Put it around the
    work that reads the flags and the files they name, not around the computation, where a
    ValueError is a bug and keeps its traceback."""
    try:
        yield
    except USER_ERRORS as e:
        raise UserError(str(e)) from e


def reports_user_errors(main):
    """Decorates a front end's `main(argv) -> exit code`: a UserError is printed as one line,
    `error: <message>`, on stderr and the exit code is 2."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return wrapped


def exit_with(code: int) -> None:
    """End a front end's process with exit code `code` (its `if __name__ == "__main__":`).

    After a failed checkpoint restore, orbax's reads still in flight may report their failure
    when the interpreter collects them at exit, after the one-line error
    (`glm_jax.checkpoint_damage`): a failing run that saw such reads ends here, its output
    flushed, without that final collection."""
    from glm_jax.checkpoint_damage import orbax_leftovers_seen

    if code and orbax_leftovers_seen():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


# ---------------------------------------------------------------------- the model
class _DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: stores the value under the new flag's name and prints a
    one-line note naming the new flag."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"note: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_model_flags(ap: argparse.ArgumentParser, *, checkpoint: bool | str = True, required: bool = False,
                    hf_help: str = "a Hugging Face checkpoint directory (config.json, *.safetensors; "
                                   "tokenizer.json for text)",
                    config_help: str | None = None) -> None:
    """The model's source: --hf-checkpoint DIR and, unless `checkpoint` is False, --checkpoint DIR
    (a model directory; `checkpoint` may be its default); one of them at most, exactly one if
    `required`. --init-from-hf is a deprecated spelling of --hf-checkpoint. `config_help`: add
    --config with this help."""
    source = ap.add_mutually_exclusive_group(required=required)
    if checkpoint is not False:
        source.add_argument("--checkpoint", default=None if checkpoint is True else str(checkpoint), metavar="DIR",
                            help="a model directory (config.yaml, params/, tokenizer.json; what train.py writes)")
    source.add_argument("--hf-checkpoint", default=None, metavar="DIR", help=hf_help)
    source.add_argument("--init-from-hf", dest="hf_checkpoint", metavar="DIR", action=_DeprecatedAlias,
                        new="--hf-checkpoint")
    if config_help is not None:
        ap.add_argument("--config", default=None, help=config_help)


def model_source(args):
    """-> the glm_jax.checkpoint.ModelSource of --hf-checkpoint or --checkpoint, or None."""
    from glm_jax.checkpoint import ModelSource

    return ModelSource.of(checkpoint=getattr(args, "checkpoint", None), hf_checkpoint=args.hf_checkpoint)


# ---------------------------------------------------------------------- mesh and kernels
def impl_choices(op: str) -> tuple[str, ...]:
    """The implementations a kernel flag offers for the pallas_kernels op `op` (its registry, through `ops`)."""
    from glm_jax.ops import impl_choices as registered

    return registered(op)


#: The --kernel-config example of the help: a field of the kernel "auto" runs on a CPU.
KERNEL_CONFIG_EXAMPLE = "attention.q_chunk=64"
#: --kernel-config's help, in every front end that has the flag.
KERNEL_CONFIG_HELP = (f"set a field of a kernel's config dataclass (repeatable), e.g. {KERNEL_CONFIG_EXAMPLE} (the xla "
                      "kernel's, which a CPU runs) or attention.block_k=64 (pallas_gpu, pallas_tpu); groups: the ops "
                      "(sparse_mla, indexer_topk, indexer_cross_entropy, causal_attention, dense_indexer_kl) or "
                      "attention, indexer, indexer_kl, dense_kl; the fields are those of the config of the "
                      "implementation the group runs (pallas_kernels registry)")


def add_kernel_flags(ap: argparse.ArgumentParser, *, attention_help: str = "") -> None:
    """--attention-impl and --indexer-impl (see `kernel_choice`); `attention_help`: more help for
    --attention-impl (e.g. what the front end makes of auto)."""
    kernels = ap.add_argument_group("kernels", "implementations of the ops in pallas_kernels; auto: the "
                                    "backend's Pallas kernel on a TPU or GPU, else xla")
    kernels.add_argument("--attention-impl", default="auto", choices=impl_choices("sparse_mla"),
                         help="the sparse attention (sparse MLA) kernel" + (f"; {attention_help}" if attention_help
                                                                           else ""))
    kernels.add_argument("--indexer-impl", default="auto", choices=impl_choices("indexer_topk"),
                         help="the lightning indexer's kernels (scores and top-k)")
    kernels.add_argument("--kernel-config", dest="kernel_config_items", action="append", default=None,
                         metavar="GROUP.FIELD=VALUE", help=KERNEL_CONFIG_HELP)


def kernel_config(items: list[str] | None, base: dict | None = None) -> dict[str, dict]:
    """--kernel-config GROUP.FIELD=VALUE items (VALUE read as YAML: 64, true, none) over `base`
    -> {group: {field: value}}."""
    import yaml

    configs = {group: dict(fields) for group, fields in (base or {}).items()}
    for item in items or ():
        name, eq, value = item.partition("=")
        group, dot, field = name.partition(".")
        if not (eq and dot and group and field):
            raise UserError(f"--kernel-config {item!r}: expected GROUP.FIELD=VALUE, e.g. attention.block_k=64")
        configs.setdefault(group, {})[field] = yaml.safe_load(value)
    return configs


def kernel_choice(args, *, attention: str | None = None):
    """-> glm_jax.ops.KernelChoice of --indexer-impl and --attention-impl (or `attention`, e.g.
    what auto resolves to for the run), with the --kernel-config fields set."""
    from glm_jax import ops
    from glm_jax.kernel_configs import configured

    with user_errors():
        return configured(ops.KernelChoice(indexer_topk=args.indexer_impl, sparse_mla=attention or args.attention_impl),
                          kernel_config(args.kernel_config_items))


# ---------------------------------------------------------------------- several processes
def join_processes(args, mesh: str | None) -> None:
    """Join the run that the process flags (`args`: coordinator, num_processes, process_id,
    distributed; `settings_cli.Processes`) or the environment describe, after choosing the
    platforms (`choose_platforms`) and letting the CPU platform simulate this process's share of
    the devices of `mesh` (the --mesh spec, if any). Call before anything else uses jax; flags
    that describe no run (or a bad mesh) raise UserError."""
    from glm_jax.multihost import DistributedSetup, initialize_distributed
    from glm_jax.sharding import simulate_cpu_devices

    choose_platforms()
    with user_errors():
        setup = DistributedSetup(coordinator=args.coordinator, num_processes=args.num_processes,
                                 process_id=args.process_id,
                                 auto=args.distributed or bool(os.environ.get("JAX_COORDINATOR_ADDRESS")))
        setup.check()
        if mesh:
            simulate_cpu_devices(mesh, setup.num_processes or 1)
        initialize_distributed(setup)


# ---------------------------------------------------------------------- hints
def shown_path(path: str | Path) -> str:
    """`path` as a hint shows it: relative to the working directory where it is inside it."""
    path = Path(path).absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def python_command() -> str:
    """The interpreter running this program, as a command that runs from the working directory
    (e.g. .venv/bin/python): a hint that names it runs as printed."""
    return shown_path(sys.executable) if sys.executable else "python"


# ---------------------------------------------------------------------- platforms
#: PCI vendor id of Google's TPU chips (as the host lists them under /sys/bus/pci/devices).
_TPU_PCI_VENDOR = "0x1ae0"


def has_tpu_chips(pci_devices: Path = Path("/sys/bus/pci/devices")) -> bool:
    """Whether this host has a TPU chip attached."""
    try:
        return any((d / "vendor").read_text().strip() == _TPU_PCI_VENDOR for d in pci_devices.iterdir())
    except OSError:
        return False


def choose_platforms(environ=os.environ, *, tpu_chips: bool | None = None) -> str | None:
    """Keeps jax from starting the TPU runtime on a host without TPU chips.

    With libtpu installed (the dev setup installs it for ahead-of-time TPU compilation), jax
    starts the TPU runtime on every host, and on one without TPU chips that prints lines of
    'TPU worker hostnames' errors. Unless JAX_PLATFORMS is set already, this sets it to the
    platforms the host has (a GPU where jax's CUDA plugin and an NVIDIA device are present, and
    the CPU) -> the value set, or None where nothing was changed. Ahead-of-time TPU compilation
    (--compile-only --topology) still works: it loads libtpu by itself. Call before jax starts
    a backend."""
    import importlib.util

    if environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return None
    if has_tpu_chips() if tpu_chips is None else tpu_chips:
        return None
    cuda = (any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))
            and Path("/dev/nvidiactl").exists())
    environ["JAX_PLATFORMS"] = "cuda,cpu" if cuda else "cpu"
    if "jax" in sys.modules:                   # imported already: its flag was read from the environment
        sys.modules["jax"].config.update("jax_platforms", environ["JAX_PLATFORMS"])
    return environ["JAX_PLATFORMS"]
