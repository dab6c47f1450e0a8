"""The first 20 losses of a micro run (dense then sparse stage, MTP with a TV weight, the step's
static settings all used) are those of the code before `train_step` took one step config
(`training.step.StepConfig`), to within `RTOL`: tests/data/first_losses.json holds the losses
that code wrote (CPU, this test's XLA flags, the jax version named in the file; another version
may round differently, and the test is then skipped)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

import train
from conftest import micro_config
from glm_jax.config import save_config

GOLDEN = Path(__file__).parent / "data" / "first_losses.json"
TERMS = ("loss", "lm", "indexer_kl", "mtp", "mtp_tv", "grad_norm")
#: Relative tolerance of every recorded figure. Another CPU's vector width (e.g. AVX2 against
#: AVX-512) rounds the float32 sums differently: the loss of step 1 was 8.440427780151367 there
#: against the recorded 8.44042682647705 (1.1e-7), and with the rounding changed here (XNNPACK
#: fusions off, or LLVM code for an older instruction set) no figure of the 20 steps moved by
#: more than 1.1e-6 (grad_norm; indexer_kl 6.3e-7, mtp_tv 4.0e-7, the cross-entropies 1.6e-7).
#: 1e-5 is ten times that and below what a changed computation moves them by: a loss weight or
#: the logits' scale changed by 0.1% moves some of them by 3.5e-5 (the TV weight) to 7e-3.
RTOL = 1e-5


def _first_losses(tmp_path) -> dict:
    cfg_path = tmp_path / "micro.yaml"
    save_config(micro_config(vocab_size=320, max_position_embeddings=128), cfg_path)
    out = tmp_path / "run"
    assert train.main(["--config", str(cfg_path), "--out", str(out), "--steps", "20", "--batch-size", "2",
                       "--seq-len", "32", "--dense-steps", "10", "--warmup-steps", "2", "--lr", "1e-2",
                       "--tv-weight", "0.1", "--mtp-depth", "2", "--max-files", "4", "--log-every", "1",
                       "--eval-every", "100", "--save-every", "100", "--eval-batches", "1"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {term: [r[term] for r in records if "loss" in r] for term in TERMS}


def test_first_losses_are_those_of_the_code_before(tmp_path):
    got = _first_losses(tmp_path)
    if os.environ.get("GLM_WRITE_FIRST_LOSSES"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(), **got}, indent=1))
    want = json.loads(GOLDEN.read_text())
    if (want["jax"], want["backend"]) != (jax.__version__, jax.default_backend()):
        pytest.skip(f"losses recorded with jax {want['jax']} on {want['backend']}")
    assert len(got["loss"]) == 20
    for term in TERMS:
        np.testing.assert_allclose(got[term], want[term], rtol=RTOL, atol=0, err_msg=term)


def test_the_step_config_is_one_hashable_value_built_from_the_settings():
    import dataclasses

    from glm_jax.training.run_config import LossConfig, TrainConfig
    from glm_jax.training.step import LossWeights, OptimizerConfig, StepConfig

    settings = TrainConfig(out="r")
    a = StepConfig.of(settings, stage="dense")
    b = StepConfig.of(TrainConfig(out="elsewhere"), stage="dense")
    assert a == b and hash(a) == hash(b) and a.tx is b.tx          # one compiled step for both
    assert a.weights == LossWeights() == LossWeights.of(LossConfig())  # the defaults are LossConfig's
    assert a.optimizer == OptimizerConfig(3e-3, 600, 50)
    other = dataclasses.replace(settings, losses=dataclasses.replace(settings.losses, mtp_weight=0.5))
    assert StepConfig.of(other, stage="dense").weights.mtp == 0.5
