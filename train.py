"""Train a GLM-5.2-style model on the Python standard library's source (or resume a run).

    python train.py --config configs/tiny.yaml --out runs/tiny --steps 600
    python train.py --run-config my-run.yaml --lr 1e-3    # settings from a YAML file, flags overriding them
    python train.py --hf-checkpoint GLM-5.2/ --out runs/glm --steps 100   # fine-tune published weights
    python train.py --checkpoint checkpoints/default --context-length 32768 --seq-len 32768 --dense-steps 0 \
        --out runs/mid32k                       # long-context mid-training (docs/training.md)
    python train.py --mesh data=16 --out /shared/runs/tiny --coordinator 10.0.0.1:1234 --num-processes 2 \
        --process-id 0                          # one of several processes (hosts), each reading its data shard

The run directory receives tokenizer.json (a byte-level BPE trained on the training files),
config.yaml, run_config.yaml (every setting of the run; a --resume names what it changes and
refuses what it cannot change), checkpoints/ (orbax: params, optimizer state, data position)
every --save-every steps, params/ (the final weights, or those of a --stop-after stop: what
decode.py loads) and metrics.jsonl. Several processes share it: process 0 writes the files, all
of them write and read the checkpoints together. The run itself is glm_jax.training.run; its
settings are glm_jax.training.run_config.TrainConfig.
"""

from __future__ import annotations

import argparse
import sys

from glm_jax import multihost, settings as settings_lib
from glm_jax.frontends import cli
from glm_jax.training import run, run_config
from glm_jax.training.run_config import TrainConfig
from glm_jax.training.step import EXPANDED_MAX_LEN

#: Every setting's default by its flag's dest (the fields of TrainConfig and its sections).
DEFAULTS = settings_lib.flat(TrainConfig())
_NOT_GIVEN = object()


class _HelpWithDefaults(argparse.HelpFormatter):
    """Help lines end with the setting's default (TrainConfig's: a flag not given leaves the
    --run-config file's value)."""

    def _get_help_string(self, action):
        default = DEFAULTS.get(action.dest)
        if action.help and default not in (None, False, (), {}) and "default" not in action.help:
            return f"{action.help} (default: {default})"
        return action.help


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_HelpWithDefaults)
    ap.add_argument("--run-config", default=None, metavar="FILE",
                    help="the run's settings as YAML, sections as in a run directory's run_config.yaml; flags "
                         "given override them")
    cli.add_model_flags(ap, checkpoint=True,
                        hf_help="start from the weights (and tokenizer.json, if any) of a Hugging Face checkpoint",
                        config_help="configs/*.yaml or a config.json (default: configs/tiny.yaml, or the "
                                    "--hf-checkpoint or --checkpoint config)")
    ap.add_argument("--context-length", type=int, default=None, metavar="N",
                    help="extend the model's positions to N (a multiple of its original length) by YaRN: "
                         "rope_scaling factor N / original, written into the run's config.yaml; for long-context "
                         "mid-training from --checkpoint or --hf-checkpoint weights")
    ap.add_argument("--out", help="run directory (created; reused with --resume)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--decay-steps", type=int, default=0,
                    help="hold --lr after the warm-up and decay it linearly to lr/10 over the last N steps "
                         "(default 0: cosine to lr/10 at --steps)")
    ap.add_argument("--dense-steps", type=int, default=100,
                    help="steps of dense attention (indexer warm-up) before sparse attention")
    ap.add_argument("--indexer-weight", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--mtp-depth", type=int, default=1, help="MTP applications per position (shared weights)")
    ap.add_argument("--tv-weight", type=float, default=0.0, help="end-to-end total-variation loss weight")
    ap.add_argument("--no-mtp-kv-share", dest="mtp_kv_share", action="store_false",
                    help="MTP depths >= 2 compute their own KV and indices instead of reusing depth 1's")
    ap.add_argument("--log-every", type=int, default=10, help="print and record metrics every N steps")
    ap.add_argument("--metrics-file", default=None, help="JSON lines, one per logged step (default OUT/metrics.jsonl)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's peak bf16 TFLOP/s, for MFU (default: known accelerators, else none)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--data", nargs="+", default=None, metavar="PATH",
                    help="training text: .txt (a file is a document), .jsonl ({\"text\": ...} per line), "
                         ".array_record files or directories of them (default: the Python standard library)")
    ap.add_argument("--heldout-data", nargs="+", default=None, metavar="PATH",
                    help="validation text, same formats as --data (default: 5%% of the --data documents)")
    ap.add_argument("--max-files", type=int, default=None, help="use only the first N training documents")
    ap.add_argument("--prefetch-batches", type=int, default=None, metavar="N",
                    help="pack up to N batches ahead on a thread while the device runs the step (default: 2 "
                         "on a GPU or TPU, 0 on a CPU, where the packing and the step share the same cores)")
    ap.add_argument("--data-shards", type=int, default=None, metavar="N",
                    help="build each batch from N data shards (shard i packs documents i, i+N, ...), each "
                         "process reading those of its rows (default: one per process); a run with the same "
                         "N sees the same batches whatever its number of processes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export-dtype", default=None, help="cast the exported params/ (e.g. bfloat16)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    ap.add_argument("--stop-after", type=int, default=None, metavar="N",
                    help="run at most N steps in this invocation, save and exit (for time-limited jobs)")
    ap.add_argument("--remat", action="store_true", help="recompute activations in the backward pass")
    ap.add_argument("--keep-attention", action="store_true",
                    help="with --remat: keep the sparse attention kernels' outputs (per token and layer heads x "
                         "kv_lora_rank activations and top-k + heads float32 values) instead of running the "
                         "forward kernel again")
    cli.add_mesh_flag(ap, "e.g. data=8 or data=2,tensor=2,layer=2: batch and (FSDP) the model dimension of the "
                          "weights over data, the sequence over context (context parallelism, e.g. "
                          "data=2,context=4), heads / FFN / experts over tensor (and layer)")
    ap.add_argument("--attention-form", default="auto", choices=["auto", "expanded", "absorbed"],
                    help="expanded: [S, S] attention matrices (short sequences); absorbed: none, fused "
                         "kernels (the dense stage's indexer loss computed blockwise); both train every "
                         f"loss. auto: absorbed on a GPU or TPU; on a CPU expanded up to {EXPANDED_MAX_LEN} tokens")
    cli.add_kernel_flags(ap, attention_help="auto: the backend's Pallas kernel, except on a TPU the chunked "
                                            "xla one for absorbed-form training of sequences over 8192 tokens "
                                            "(the TPU kernel's backward keeps one 576-wide row per query and "
                                            "selected key)")
    cli.add_distributed_flags(ap, "the run directory's files (the checkpoints are written together)")
    # A setting's flag not given stays _NOT_GIVEN: argparse sets no default where the namespace has a value.
    return ap.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(DEFAULTS, _NOT_GIVEN)))


def train_config(args) -> TrainConfig:
    """The settings of --run-config (or the defaults), with the flags given in their place."""
    base = run_config.load(args.run_config) if args.run_config else TrainConfig()
    given = {k: v for k, v in vars(args).items() if k in DEFAULTS and v is not _NOT_GIVEN}
    if args.kernel_config_items:    # each item sets one field, over the file's
        given["kernel_config"] = cli.kernel_config(args.kernel_config_items, base.kernels.kernel_config)
    settings = settings_lib.with_values(base, given)
    if settings.out is None:
        raise ValueError("--out: give the run directory (or `out:` in the --run-config file)")
    return settings


@cli.reports_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    with cli.user_errors():
        settings = train_config(args)
    cli.join_processes(args, settings.mesh)    # before the first jax computation
    with multihost.stdout_of_main_process_only():
        with cli.user_errors():
            state = run.setup(settings)
        try:
            code = run.train(state)
        except run.SaveFailedError as e:      # the disk, not the flags: exit code 1
            print(f"error: {e}", file=sys.stderr)
            return 1
        if state.exported is not None:
            print(f"decode with: {cli.python_command()} decode.py --checkpoint {cli.shown_path(state.out)}")
        return code


if __name__ == "__main__":
    cli.exit_with(main())
