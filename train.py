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
of them write and read the checkpoints together. The flags are generated from the settings,
glm_jax.training.run_config.TrainConfig (glm_jax.frontends.train); the run is glm_jax.training.run.
"""

from __future__ import annotations

from glm_jax.frontends import cli
from glm_jax.frontends.train import TrainCommand, parse_args, train_config  # noqa: F401 - the command line
from glm_jax.frontends.train import main as _main


def main(argv=None) -> int:
    return _main(argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    cli.exit_with(main())
