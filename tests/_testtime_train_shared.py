"""The one-device reference run of test_faults.py and test_train_sharding.py, on a micro model
of two layers: a pytest plugin both modules name in `pytest_plugins`, so the session runs it
once for both (whichever collects it first)."""

from __future__ import annotations

import pytest

from conftest import micro_config, one_device_flags, train_process
from glm_jax.config import save_config

#: conftest's micro config with 320 tokens and 128 positions, cut to one IndexShare group of two
#: layers (Full: a dense MLP; Shared: MoE) and the MTP layer: the kills, resumes and meshes of
#: the tests that use the run do not depend on the depth, and each train.py process traces and
#: compiles half the layers.
TWO_LAYER_MICRO = dict(vocab_size=320, max_position_embeddings=128, num_hidden_layers=2, index_topk_pattern="FS")


@pytest.fixture(scope="session")
def two_layer_run(tmp_path_factory):
    """train.py on one device in a fresh process, uninterrupted, with `one_device_flags` (5 steps,
    the first dense, a checkpoint after every step) on `TWO_LAYER_MICRO`: the losses the killed
    and resumed runs of test_faults.py reproduce bit for bit and the sharded runs of
    test_train_sharding.py equal. -> (the config's path, the run directory, the finished
    subprocess.CompletedProcess)"""
    root = tmp_path_factory.mktemp("two-layer")
    cfg_path = root / "micro.yaml"
    save_config(micro_config(**TWO_LAYER_MICRO), cfg_path)
    finished = train_process(one_device_flags(cfg_path, root / "run"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    return cfg_path, root / "run", finished
