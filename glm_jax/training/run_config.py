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

from glm_jax.settings import (FrozenDict, Settings, SettingError, differences, from_dict, impl_choices, section,
                              setting, shown, to_dict)

#: The file in the run directory that holds the run's settings.
FILE_NAME = "run_config.yaml"

_DATA_ORDER = "it fixes the order of the batches, which the checkpoint's data position continues"

#: Longest sequence "auto" trains in the expanded form ([S, S] matrices) on a CPU (`step.attention_form`).
EXPANDED_MAX_LEN = 4096


@dataclasses.dataclass(frozen=True)
class ModelSourceConfig(Settings):
    """The model: a config file, the weights a run starts from (if any: a Hugging Face checkpoint
    or a model directory, e.g. another run's), the context length its position encoding is
    extended to (`glm_jax.config.extend_context`) and the indexer's top-k."""

    SECTION = "model"
    config: str | None = setting(None, help="configs/*.yaml or a config.json (default: configs/tiny.yaml, or the "
                                            "--hf-checkpoint or --checkpoint config)")
    hf_checkpoint: str | None = setting(None, metavar="DIR", deprecated=("--init-from-hf",),
                                        help="start from the weights (and tokenizer.json, if any) of a Hugging "
                                             "Face checkpoint")
    checkpoint: str | None = setting(None, metavar="DIR", help="a model directory (config.yaml, params/, "
                                                               "tokenizer.json; what train.py writes)")
    context_length: int | None = setting(None, at_least=2, metavar="N", fixed="it sets the model's position encoding "
                                         "(config.yaml's rope_scaling), which the checkpoint's weights were "
                                         "trained with",
                                         help="extend the model's positions to N (a multiple of its original "
                                              "length) by YaRN: rope_scaling factor N / original, written into the "
                                              "run's config.yaml; for long-context mid-training from --checkpoint "
                                              "or --hf-checkpoint weights")
    index_topk: int | None = setting(None, at_least=1, metavar="K", fixed="the sparse attention reads the indexer's "
                                     "top-K keys, which the checkpoint's steps were trained on",
                                     help="keys the indexer selects for each query (the config's index_topk; it "
                                          "changes no weight), written into the run's config.yaml: e.g. a larger "
                                          "top-k for long-context stages (default: the model's)")


@dataclasses.dataclass(frozen=True)
class DataConfig(Settings):
    SECTION = "data"
    data: tuple[str, ...] | None = setting(None, fixed=_DATA_ORDER, metavar="PATH",
                                           help="training text: .txt (a file is a document), .jsonl ({\"text\": "
                                                "...} per line), .array_record files or directories of them "
                                                "(default: the Python standard library)")
    heldout_data: tuple[str, ...] | None = setting(None, metavar="PATH",
                                                   help="validation text, same formats as --data (default: 5% "
                                                        "of the --data documents)")
    max_files: int | None = setting(None, at_least=1, fixed=_DATA_ORDER, help="use only the first N training "
                                                                              "documents", metavar="N")
    seq_len: int = setting(256, at_least=1, fixed=_DATA_ORDER, help="tokens per row")
    batch_size: int = setting(16, at_least=1, fixed=_DATA_ORDER, help="rows per step (over all processes)")
    data_shards: int | None = setting(None, at_least=1, fixed=_DATA_ORDER, metavar="N",
                                      help="build each batch from N data shards (shard i packs documents i, i+N, "
                                           "...), each process reading those of its rows (default: one per "
                                           "process); a run with the same N sees the same batches whatever its "
                                           "number of processes")
    prefetch_batches: int | None = setting(None, at_least=0, metavar="N",
                                           help="pack up to N batches ahead on a thread while the device runs the "
                                                "step (default: 2 on a GPU or TPU, 0 on a CPU, where the packing "
                                                "and the step share the same cores)")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig(Settings):
    """The learning-rate schedule and the stages: `dense_steps` of dense attention, then sparse."""

    SECTION = "schedule"
    steps: int = setting(600, at_least=1, help="optimizer steps of the run")
    lr: float = setting(3e-3, at_least=0, help="peak learning rate")
    warmup_steps: int = setting(50, at_least=0, help="steps of linear warm-up from 0 to --lr")
    decay_steps: int = setting(0, at_least=0, help="hold --lr after the warm-up and decay it linearly to lr/10 over "
                                                   "the last N steps (0: cosine to lr/10 at --steps)")
    dense_steps: int = setting(100, at_least=0, help="steps of dense attention (indexer warm-up) before sparse "
                                                     "attention")
    indexer_lr_scale: float = setting(1.0, above=0, metavar="X",
                                      fixed="the optimizer state holds the indexer's scaled updates only when it "
                                            "is not 1",
                                      help="the indexers' learning rate as a multiple of the schedule's (their "
                                           "whole AdamW update scaled; they learn from their KL alone)")


@dataclasses.dataclass(frozen=True)
class LossConfig(Settings):
    SECTION = "losses"
    indexer_weight: float = setting(1.0, at_least=0, help="weight of the indexer's KL loss")
    mtp_weight: float = setting(0.3, at_least=0, help="weight of the MTP cross-entropy (mean over depths)")
    mtp_depth: int = setting(1, at_least=1, help="MTP applications per position (shared weights)")
    tv_weight: float = setting(0.0, at_least=0, help="end-to-end total-variation loss weight")
    mtp_kv_share: bool = setting(True, flag="--no-mtp-kv-share",
                                 help="MTP depths >= 2 reuse depth 1's KV and indices (--no-mtp-kv-share: each "
                                      "computes its own)")


@dataclasses.dataclass(frozen=True)
class KernelsConfig(Settings):
    """Kernel implementations (`glm_jax.ops.KernelChoice`), their configs (`kernel_config`:
    group -> field -> value, `glm_jax.kernel_configs`), the attention form and rematerialisation."""

    SECTION = "kernels"
    attention_form: str = setting("auto", choices=("auto", "expanded", "absorbed"),
                                  help="expanded: [S, S] attention matrices (short sequences); absorbed: none, fused "
                                       "kernels (the dense stage's indexer loss computed blockwise); both train "
                                       "every loss. auto: absorbed on a GPU or TPU; on a CPU expanded up to "
                                       f"{EXPANDED_MAX_LEN} tokens")
    attention_impl: str = setting("auto", choices=impl_choices("sparse_mla"),
                                  help="the sparse attention (sparse MLA) kernel; auto: the backend's Pallas kernel, "
                                       "except on a TPU the chunked xla one for absorbed-form training of sequences "
                                       "over 8192 tokens (the TPU kernel's backward keeps one 576-wide row per "
                                       "query and selected key)")
    indexer_impl: str = setting("auto", choices=impl_choices("indexer_topk"),
                                help="the lightning indexer's kernels (scores and top-k)")
    kernel_config: FrozenDict = setting(FrozenDict(), help="group -> field -> value (the command line's "
                                                           "--kernel-config GROUP.FIELD=VALUE items)")
    remat: bool = setting(False, help="recompute activations in the backward pass")
    keep_attention: bool = setting(False, help="with --remat: keep the sparse attention kernels' outputs (per token "
                                               "and layer heads x kv_lora_rank activations and top-k + heads "
                                               "float32 values) instead of running the forward kernel again")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keep_attention and not self.remat:
            raise SettingError("--keep-attention keeps the sparse attention's outputs of a rematerialised layer: "
                               "give --remat with it")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Settings):
    SECTION = "checkpointing"
    save_every: int = setting(200, at_least=1, help="write a checkpoint every N steps")
    export_dtype: str | None = setting(None, help="cast the exported params/ (e.g. bfloat16)")


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Settings):
    """Progress lines, metrics.jsonl and the held-out evaluation."""

    SECTION = "logging"
    log_every: int = setting(10, at_least=1, help="print and record metrics every N steps")
    metrics_file: str | None = setting(None, help="JSON lines, one per logged step (default OUT/metrics.jsonl)")
    peak_tflops: float | None = setting(None, above=0, help="the device's peak bf16 TFLOP/s, for MFU (default: "
                                                            "known accelerators, else none)")
    eval_every: int = setting(100, at_least=1, help="held-out evaluation every N steps")
    eval_batches: int = setting(8, at_least=1, help="held-out batches per evaluation")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Settings):
    """Every setting of a training run. `out`, `resume` and `stop_after` belong to one
    invocation; the rest to the run (see the module's docstring for what --resume may change)."""

    out: str | None = setting(None, per_invocation=True, help="run directory (created; reused with --resume)")
    resume: bool = setting(False, per_invocation=True, help="continue from the newest checkpoint in --out")
    stop_after: int | None = setting(None, at_least=1, per_invocation=True, metavar="N",
                                     help="run at most N steps in this invocation, save and exit (for time-limited "
                                          "jobs)")
    seed: int = setting(0, fixed=_DATA_ORDER + ", and the initial weights", help="data order and initial weights")
    mesh: str | None = setting(None, metavar="SPEC",
                               help="a device mesh 'axis=size,...' over data, context, tensor, layer: e.g. data=8 "
                                    "or data=2,tensor=2,layer=2: batch and (FSDP) the model dimension of the weights "
                                    "over data, the sequence over context (context parallelism, e.g. "
                                    "data=2,context=4), heads / FFN / experts over tensor (and layer); on a CPU the "
                                    "devices are simulated")
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

