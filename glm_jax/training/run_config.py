"""`TrainConfig`: every setting of a training run, in sections (model source, data, schedule,
losses, kernels, checkpointing, logging), each checked on construction (`glm_jax.settings`).

train.py builds one from its flags or a YAML file (`--run-config FILE`, the flags overriding
it); `glm_jax.training.run.setup` takes it. A run writes its settings into the run directory
(`run_config.yaml`) when it begins, and a resumed run compares them with its own
(`resume_changes`): every change is named, and those that would make the saved data position
or weights mean something else are refused.

What a resumed run may change: the schedule (steps, learning rate, warm-up, decay, dense
steps), the loss weights, the kernels and attention form, the mesh (the checkpoint is read onto
the new one; the data order depends on the data shards, not the mesh), logging, evaluation,
checkpointing and the held-out data. What it may not: the sequence length, the batch size, the
data shards, the training documents and the seed (they fix the order of the batches, which the
checkpoint's data position continues), the context extension (`--context-length`) and the model
config (`checkpoint.check_same_config`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from glm_jax.settings import (FrozenDict, Settings, SettingError, differences, from_dict, section, setting, shown,
                              to_dict)

#: The file in the run directory that holds the run's settings.
FILE_NAME = "run_config.yaml"

_DATA_ORDER = "it fixes the order of the batches, which the checkpoint's data position continues"


@dataclasses.dataclass(frozen=True)
class ModelSourceConfig(Settings):
    """The model: a config file, the weights a run starts from (if any: a Hugging Face checkpoint
    or a model directory, e.g. another run's), and the context length its position encoding is
    extended to (`glm_jax.config.extend_context`)."""

    SECTION = "model"
    config: str | None = setting(None)
    hf_checkpoint: str | None = setting(None)
    checkpoint: str | None = setting(None)
    context_length: int | None = setting(None, at_least=2, fixed="it sets the model's position encoding "
                                         "(config.yaml's rope_scaling), which the checkpoint's weights were "
                                         "trained with")


@dataclasses.dataclass(frozen=True)
class DataConfig(Settings):
    SECTION = "data"
    data: tuple[str, ...] | None = setting(None, fixed=_DATA_ORDER)
    heldout_data: tuple[str, ...] | None = setting(None)
    max_files: int | None = setting(None, at_least=1, fixed=_DATA_ORDER)
    seq_len: int = setting(256, at_least=1, fixed=_DATA_ORDER)
    batch_size: int = setting(16, at_least=1, fixed=_DATA_ORDER)
    data_shards: int | None = setting(None, at_least=1, fixed=_DATA_ORDER)
    prefetch_batches: int | None = setting(None, at_least=0)


@dataclasses.dataclass(frozen=True)
class ScheduleConfig(Settings):
    """The learning-rate schedule and the stages: `dense_steps` of dense attention, then sparse."""

    SECTION = "schedule"
    steps: int = setting(600, at_least=1)
    lr: float = setting(3e-3, at_least=0)
    warmup_steps: int = setting(50, at_least=0)
    decay_steps: int = setting(0, at_least=0)
    dense_steps: int = setting(100, at_least=0)


@dataclasses.dataclass(frozen=True)
class LossConfig(Settings):
    SECTION = "losses"
    indexer_weight: float = setting(1.0, at_least=0)
    mtp_weight: float = setting(0.3, at_least=0)
    mtp_depth: int = setting(1, at_least=1)
    tv_weight: float = setting(0.0, at_least=0)
    mtp_kv_share: bool = setting(True, flag="--no-mtp-kv-share")


@dataclasses.dataclass(frozen=True)
class KernelsConfig(Settings):
    """Kernel implementations (`glm_jax.ops.KernelChoice`), their configs (`kernel_config`:
    group -> field -> value, `glm_jax.kernel_configs`), the attention form and rematerialisation."""

    SECTION = "kernels"
    attention_form: str = setting("auto")
    attention_impl: str = setting("auto")
    indexer_impl: str = setting("auto")
    kernel_config: FrozenDict = setting(FrozenDict())
    remat: bool = setting(False)
    keep_attention: bool = setting(False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keep_attention and not self.remat:
            raise SettingError("--keep-attention keeps the sparse attention's outputs of a rematerialised layer: "
                               "give --remat with it")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Settings):
    SECTION = "checkpointing"
    save_every: int = setting(200, at_least=1)
    export_dtype: str | None = setting(None)


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Settings):
    """Progress lines, metrics.jsonl and the held-out evaluation."""

    SECTION = "logging"
    log_every: int = setting(10, at_least=1)
    metrics_file: str | None = setting(None)
    peak_tflops: float | None = setting(None, above=0)
    eval_every: int = setting(100, at_least=1)
    eval_batches: int = setting(8, at_least=1)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Settings):
    """Every setting of a training run. `out`, `resume` and `stop_after` belong to one
    invocation; the rest to the run (see the module's docstring for what --resume may change)."""

    out: str | None = setting(None, per_invocation=True)
    resume: bool = setting(False, per_invocation=True)
    stop_after: int | None = setting(None, at_least=1, per_invocation=True)
    seed: int = setting(0, fixed=_DATA_ORDER + ", and the initial weights")
    mesh: str | None = setting(None)
    model: ModelSourceConfig = section(ModelSourceConfig)
    data: DataConfig = section(DataConfig)
    schedule: ScheduleConfig = section(ScheduleConfig)
    losses: LossConfig = section(LossConfig)
    kernels: KernelsConfig = section(KernelsConfig)
    checkpointing: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)


# ---------------------------------------------------------------------- files
def load(path: str | Path) -> TrainConfig:
    """The settings of a YAML file (a run's run_config.yaml or one written by hand)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise SettingError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
    return from_dict(TrainConfig, data, where=str(path))


def save(settings: TrainConfig, directory: Path) -> None:
    """Write the run's settings (not those of this invocation: out, resume, stop_after) into the
    run directory `directory` (FILE_NAME)."""
    (directory / FILE_NAME).write_text(yaml.safe_dump(to_dict(settings, per_invocation=False), sort_keys=False))


def resume_changes(old: TrainConfig | None, new: TrainConfig) -> list[str]:
    """The lines a resumed run prints about its settings: `old` (the run directory's, None where
    it has none) against `new`. A change the run cannot make raises SettingError naming each."""
    if old is None:
        return [f"resume: the run directory has no {FILE_NAME} (written by an older train.py): its settings "
                "are unknown, so none is compared; this run's are written now"]
    changes = differences(old, new)
    refused = [c for c in changes if c.fixed]
    if refused:
        kept = " ".join(f"{c.flag} {shown(c.old)}" for c in refused if c.old is not None)
        raise SettingError("--resume cannot change " + "; ".join(f"{c}: {c.fixed}" for c in refused)
                           + f"; resume with {kept or 'those left at their defaults'}, or start a new --out")
    return [f"resume: {c}" for c in changes]

