"""Packed batches on a data=8 mesh of simulated CPU devices (FSDP + batch rows over data): the
loss and every gradient equal the one-device ones. Runs in a subprocess: the device count is
fixed before jax starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import simulated_devices_env

HERE = Path(__file__).resolve().parent

SCRIPT = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from conftest import micro_config
from glm_jax import sharding
from glm_jax.forward_options import ForwardOptions
from glm_jax.model import GLMModel
from glm_jax.training.step import LossWeights, loss_terms

model = GLMModel(micro_config(num_hidden_layers=2, index_topk_pattern="FS"), rngs=nnx.Rngs(0))
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
rng = np.random.default_rng(0)
inputs = jnp.asarray(rng.integers(1, 97, (8, 12)), jnp.int32)
targets = jnp.asarray(rng.integers(1, 97, (8, 12)), jnp.int32)
segments = jnp.asarray(np.repeat([[1] * 5 + [2] * 4 + [0] * 3], 8, axis=0), jnp.int32)

@jax.jit
def loss_and_grads(params, rest, inputs, targets, segments):
    f = lambda p: loss_terms(nnx.merge(graphdef, p, rest), inputs, targets,
                             options=ForwardOptions(mode="sparse", form="expanded"), weights=LossWeights(),
                             segment_ids=segments)[0]
    return jax.value_and_grad(f)(params)

ref_loss, ref_grads = loss_and_grads(params, rest, inputs, targets, segments)
mesh = sharding.make_mesh("data=8")
place = lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.shape))
replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
sharded_params = sharding.shard_params(params, mesh, sharding.TRAINING_RULES)
loss, grads = loss_and_grads(sharded_params, jax.device_put(rest, replicated), place(inputs), place(targets),
                             place(segments))
diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max() / (np.abs(b).max() + 1e-6)),
                                     grads, jax.device_get(ref_grads)))
split = sum(1 for x in jax.tree.leaves(sharded_params) if len(x.sharding.device_set) == 8
            and not x.sharding.is_fully_replicated)
print(json.dumps({"devices": len(jax.devices()), "loss": float(loss), "ref_loss": float(ref_loss),
                  "max_rel_grad_diff": max(diffs), "split_params": split}))
"""


def test_sharded_packed_loss_and_gradients_equal_one_device():
    env = simulated_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(HERE), str(HERE.parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["devices"] == 8 and r["split_params"] > 0
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * max(1.0, abs(r["ref_loss"])), r
    assert r["max_rel_grad_diff"] < 1e-4, r
