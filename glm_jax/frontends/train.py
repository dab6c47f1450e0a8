"""train.py's command line: `TrainCommand`, its settings a `TrainConfig` whose flags are
generated from the settings classes (`settings_cli`), over the `--run-config` file; then
`glm_jax.training.run` (setup, train)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated

from glm_jax import multihost
from glm_jax.extras import require
from glm_jax.frontends import cli, settings_cli
from glm_jax.frontends.settings_cli import Processes, optional_value
from glm_jax.training import run, run_config
from glm_jax.training.run_config import TrainConfig

tyro = require("tyro")     # the cli extra: an ImportError naming it where it is missing


@dataclasses.dataclass(frozen=True)
class TrainCommand:
    """train.py's command line: the run's settings, the --run-config file they start from, the
    --kernel-config items and the processes."""

    settings: TrainConfig = TrainConfig()
    run_config: Annotated[str | None, optional_value("FILE")] = None
    """the run's settings as YAML (FILE), sections as in a run directory's run_config.yaml; flags given
    override them"""
    kernel_config: Annotated[tuple[str, ...], tyro.conf.UseAppendAction,
                             tyro.conf.arg(metavar="GROUP.FIELD=VALUE", help=cli.KERNEL_CONFIG_HELP)] = ()
    processes: Processes = Processes()

    # what cli.join_processes reads
    coordinator = property(lambda self: self.processes.coordinator)
    num_processes = property(lambda self: self.processes.num_processes)
    process_id = property(lambda self: self.processes.process_id)
    distributed = property(lambda self: self.processes.distributed)


def parse_args(argv=None, description: str = "Train a GLM-5.2-style model") -> TrainCommand:
    return settings_cli.parse(TrainCommand, argv, description=description, load_file=run_config.load)


def train_config(command: TrainCommand) -> TrainConfig:
    """The settings of --run-config (or the defaults), with the flags given in their place."""
    settings = command.settings
    if command.kernel_config:    # each item sets one field, over the file's
        configs = cli.kernel_config(list(command.kernel_config), settings.kernels.kernel_config)
        settings = dataclasses.replace(settings, kernels=dataclasses.replace(settings.kernels, kernel_config=configs))
    if settings.out is None:
        raise ValueError("--out: give the run directory (or `out:` in the --run-config file)")
    return settings


@cli.reports_user_errors
def main(argv=None, description: str = "Train a GLM-5.2-style model") -> int:
    command = parse_args(argv, description)
    with cli.user_errors():
        settings = train_config(command)
    cli.join_processes(command, settings.mesh)    # before the first jax computation
    with multihost.stdout_of_main_process_only():
        with cli.user_errors():
            training_run = run.setup(settings)
        try:
            finished = run.train(training_run)
        except run.SaveFailedError as e:      # the disk, not the flags: exit code 1
            print(f"error: {e}", file=sys.stderr)
            return 1
        if finished.exported:
            print(f"decode with: {cli.python_command()} decode.py --checkpoint {cli.shown_path(training_run.out)}")
        return finished.code
