"""The model of docs/using-the-layers.md (the library's layers, an embedding and head of its
own) trained a few steps on one device and on 4 simulated CPU devices: the library's mesh,
`jax.make_mesh` with its default (Explicit) axes, and meshes whose axes are named batch / model
(Explicit and Auto) with rules of their own. Prints one JSON line {case: losses}; run by
tests/test_logical_axes.py in a subprocess (the device count is fixed before jax starts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from glm_jax import load_config  # noqa: E402
from glm_jax.layers import Embed, ForwardOptions, IndexShareGroup, LayerKind, Linear, RMSNorm  # noqa: E402
from glm_jax.sharding import batch_sharding, make_mesh, make_rules, shard_params, use_rules  # noqa: E402

CFG = load_config("tiny-attention")
USER_RULES = make_rules(batch="batch", heads="model", index_heads="model", mlp="model", vocab="model")


class TinyLM(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        kinds = (LayerKind(is_full=True, is_moe=False), LayerKind(is_full=False, is_moe=False))
        self.group = IndexShareGroup(cfg, kinds, rngs=rngs)
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, axes=("embed", "vocab"))

    def __call__(self, tokens):
        out = self.group(self.embed_tokens(tokens), options=ForwardOptions(mode="sparse"))
        return self.lm_head(self.norm(out.x))


def losses(mesh=None, rules=None, steps: int = 4) -> list[float]:
    model = TinyLM(CFG, rngs=nnx.Rngs(0))
    rows = ((jnp.arange(8)[:, None] * 7 + jnp.arange(17)[None, :]) % 50).astype(jnp.int32)
    with jax.set_mesh(mesh) if mesh is not None else _nothing(), use_rules(rules):
        if mesh is not None:
            nnx.update(model, shard_params(nnx.state(model), mesh))
            rows = jax.device_put(rows, batch_sharding(mesh, rows.shape))
        optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, tokens):
            def loss_fn(model):
                logits = model(tokens[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        split = sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        return [float(step(model, optimizer, rows)) for _ in range(steps)] + [split]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def model_logit_diffs() -> dict:
    """GLMModel("tiny" cut to one IndexShare group of 2 layers: a dense MLP, then MoE; MTP) logits
    on meshes of each kind against one device: {mesh: max |diff|}."""
    from glm_jax.model import GLMModel

    cfg = load_config("tiny").replace(num_hidden_layers=2, index_topk_pattern="FS")
    model = GLMModel(cfg, rngs=nnx.Rngs(0))
    tokens = (jnp.arange(4)[:, None] * 5 + jnp.arange(16)[None, :]) % cfg.vocab_size
    options = ForwardOptions(form="expanded", indexer_loss=True)
    logits = nnx.jit(lambda model, tokens: model(tokens, options=options).logits)
    want = logits(model, tokens)
    out = {}
    for name, mesh, rules in (("library mesh", make_mesh("data=2,tensor=2"), None),
                              ("jax.make_mesh explicit", jax.make_mesh((2, 2), ("data", "tensor")), None),
                              ("batch/model explicit", jax.make_mesh((2, 2), ("batch", "model")),
                               {**USER_RULES, "experts": "model"})):
        with jax.set_mesh(mesh), use_rules(rules):
            sharded = nnx.merge(*nnx.split(model))
            nnx.update(sharded, shard_params(nnx.state(sharded), mesh))
            rows = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.P(mesh.axis_names[0])))
            out[name] = float(jnp.max(jnp.abs(logits(sharded, rows) - want)))
    return out


def main():
    auto = (jax.sharding.AxisType.Auto,) * 2
    cases = {
        "single": lambda: losses(),
        "library mesh": lambda: losses(make_mesh("data=2,tensor=2")),
        "jax.make_mesh explicit": lambda: losses(jax.make_mesh((2, 2), ("data", "tensor"))),
        "batch/model explicit": lambda: losses(jax.make_mesh((2, 2), ("batch", "model")), USER_RULES),
        "batch/model auto": lambda: losses(jax.make_mesh((2, 2), ("batch", "model"), axis_types=auto), USER_RULES),
    }
    out = {}
    for name, run in cases.items():
        try:
            out[name] = run()
        except Exception as e:        # reported, so that one case's failure shows the others'
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    print(json.dumps({"devices": len(jax.devices()), "cases": out, "model": model_logit_diffs()}))


if __name__ == "__main__":
    main()
