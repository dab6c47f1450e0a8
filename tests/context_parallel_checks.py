"""Context-parallel training checks on 8 simulated CPU devices; run as a script by
test_context_parallel.py (XLA_FLAGS fixes the device count before jax starts). Prints one JSON
object: per case, the loss terms and the largest relative gradient difference against one
device; the per-device attention-score shapes of the compiled program; the loss of a variant
whose kernels see only their own shard's keys; the errors of an indivisible sequence."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from conftest import micro_config  # noqa: E402
from glm_jax import ops, sharding  # noqa: E402
from glm_jax.forward_options import ForwardOptions  # noqa: E402
from glm_jax.model import GLMModel  # noqa: E402
from glm_jax.training.step import LossWeights, loss_terms  # noqa: E402

B, S = 2, 16
ALL_LOSSES = LossWeights(tv=0.1)
NO_INDEXER = LossWeights(indexer=0.0, tv=0.1)           # the absorbed dense stage has no indexer loss
# mesh, stage, form, packed rows; the reference: one device, the expanded form, every loss
CASES = (("context=8", "dense", "expanded", False), ("context=8", "sparse", "absorbed", True),
         ("data=2,context=4", "sparse", "expanded", True), ("data=2,context=4", "dense", "absorbed", False))


def make_batch(s: int = S):
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(1, 97, (B, s)), jnp.int32)
    targets = jnp.asarray(rng.integers(1, 97, (B, s)), jnp.int32)
    segments = jnp.asarray(np.repeat([[1] * 6 + [2] * 7 + [0] * (s - 13)], B, axis=0), jnp.int32)
    return inputs, targets, segments


def loss_and_grads(graphdef, stage: str, form: str, packed: bool, weights: LossWeights):
    """A jitted (params, rest, inputs, targets, segments) -> (loss terms, gradients)."""
    options = ForwardOptions(mode=stage, form=form)

    @jax.jit
    def run(params, rest, inputs, targets, segments):
        def f(p):
            return loss_terms(nnx.merge(graphdef, p, rest), inputs, targets, options=options, weights=weights,
                              segment_ids=segments if packed else None)
        (_, terms), grads = jax.value_and_grad(f, has_aux=True)(params)
        return terms, grads
    return run


def weights(stage: str, form: str) -> LossWeights:
    return NO_INDEXER if (stage, form) == ("dense", "absorbed") else ALL_LOSSES


def without_indexer(grads):
    """The gradients of every parameter outside the indexers (nnx.State -> flat dict)."""
    return {k: v for k, v in nnx.to_flat_state(grads) if "indexer" not in k}


def max_rel(a, b) -> float:
    """The largest of max |a - b| / (max |b| + 1e-6) over the leaves (in numpy: no eager program
    for each leaf's shape and sharding)."""
    a, b = jax.device_get((a, b))
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max() / (np.abs(y).max() + 1e-6)), a, b)))


def keys_not_gathered(fn, per_query: dict, whole: dict):
    """A wrong `split_queries`: the key rows [B, T, ...] are split like the queries."""
    split = {k: v for k, v in whole.items() if v is not None and v.ndim > 1}
    return REAL_SPLIT(fn, {**per_query, **split}, {k: v for k, v in whole.items() if k not in split})


REAL_SPLIT = sharding.split_queries


def on_mesh(mesh, params, rest, batch):
    return (sharding.shard_params(params, mesh, sharding.TRAINING_RULES),
            jax.device_put(rest, NamedSharding(mesh, PartitionSpec())),
            [jax.device_put(x, sharding.batch_sharding(mesh, x.shape)) for x in batch])


def indivisible_errors(graphdef, params, rest) -> list[str]:
    """The messages for S = 12 on context=8: placing the batch, and tracing the loss."""
    mesh, errors = sharding.make_mesh("context=8"), []
    batch = make_batch(12)
    try:
        sharding.batch_sharding(mesh, batch[0].shape)
    except sharding.ShardingError as e:
        errors.append(str(e))
    with jax.set_mesh(mesh):
        try:
            jax.eval_shape(loss_and_grads(graphdef, "sparse", "absorbed", False, ALL_LOSSES), params, rest, *batch)
        except sharding.ShardingError as e:
            errors.append(str(e))
    return errors


def main():
    model = GLMModel(micro_config(num_hidden_layers=2, index_topk_pattern="FS"), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = make_batch()
    refs = {(stage, packed): loss_and_grads(graphdef, stage, "expanded", packed, ALL_LOSSES)(params, rest, *batch)
            for stage, packed in {(c[1], c[3]) for c in CASES}}
    out = {"devices": len(jax.devices()), "cases": {}}
    for spec, stage, form, packed in CASES:
        mesh = sharding.make_mesh(spec)
        with jax.set_mesh(mesh):
            run = loss_and_grads(graphdef, stage, form, packed, weights(stage, form))
            args = on_mesh(mesh, params, rest, batch)
            # compiled once: the program that runs is the one whose text is read below
            compiled = run.lower(args[0], args[1], *args[2]).compile()
            terms, grads = compiled(args[0], args[1], *args[2])
            want_terms, want_grads = refs[(stage, packed)]
            if weights(stage, form) is NO_INDEXER:          # compare what the indexer loss does not touch
                want_terms = {k: v for k, v in want_terms.items() if "indexer" not in k and k != "loss"}
                grads, want_grads = without_indexer(grads), without_indexer(want_grads)
            case = {"terms": {k: [float(terms[k]), float(want_terms[k])] for k in want_terms},
                    "grads": max_rel(grads, want_grads)}
            if form == "expanded":
                hlo = compiled.as_text()
                case["scores_shape"] = {n: f"f32[{n}]" in hlo for n in ("2,2,2,16", "1,2,4,16", "2,2,16,16")}
            out["cases"][f"{spec} {stage} {form}{' packed' * packed}"] = case
    mesh = sharding.make_mesh("context=8")
    ops.split_queries = keys_not_gathered
    with jax.set_mesh(mesh):
        args = on_mesh(mesh, params, rest, batch)
        loss = jax.jit(lambda p, r, x, y, seg: loss_terms(
            nnx.merge(graphdef, p, r), x, y, options=ForwardOptions(mode="sparse", form="absorbed"),
            weights=ALL_LOSSES, segment_ids=seg)[0])(args[0], args[1], *args[2])
    ops.split_queries = REAL_SPLIT
    out["keys_not_gathered"] = [float(loss), float(refs[("sparse", True)][0]["loss"])]
    out["indivisible"] = indivisible_errors(graphdef, params, rest)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
