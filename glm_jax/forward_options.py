"""`ForwardOptions`: the static choices of one forward call of the model, in one hashable value.

    out = model(tokens, options=ForwardOptions(mode="dense", form="absorbed"))
    group(x, positions, kv_len, ForwardOptions())                  # a layer group of your own
    StepConfig(optimizer, forward=ForwardOptions(mode="sparse", remat=True), weights=...)

It is the one owner of these choices: the model's full-sequence calls (`GLMModel.__call__`,
`GLMModel.mtp_forward`), the layer groups (`layers.IndexShareGroup`, `layers.MTPLayer`) and
the train step (`training.step.StepConfig.forward`, `loss_terms`) take it whole. The cached
calls (`GLMModel.forward_cached`, `mtp_forward_cached`, `mtp_draft_step`) read only its
`kernels`: they always attend the top-k in the absorbed form, with no loss and no backward pass.

This module imports only `glm_jax.ops`, so the layers and the training code both import it.
"""

from __future__ import annotations

import dataclasses

from glm_jax import ops

MODES = ("sparse", "dense")
FORMS = ("absorbed", "expanded")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardOptions:
    """The static choices of a forward call (hashable: a jit's static argument); a value outside
    them is a ValueError or TypeError naming the field. Build it with keywords; `replace(**changes)`
    gives a copy with some changed.

    mode            "sparse": attend the indexer's top-k keys (inference, the sparse training
                    stage); "dense": attend every causal key (the indexer's dense warm-up stage).
                    A train step's stage is this mode.
    form            "absorbed": attention in the latent space (`ops.sparse_mla`, the fused
                    causal kernel in dense mode), no [S, S] matrices; "expanded": per-head K and V
                    with [B, H, S, S] attention matrices (small sequences, CPU).
    kernels         the `ops.KernelChoice`: which implementation each op runs.
    remat           recompute each layer's activations in the backward pass (keeping only its
                    input and the Full layer's top-k indices).
    keep_attention  with remat: keep the sparse attention kernels' outputs (absorbed form)
                    instead of running them again in the backward pass (more memory, one
                    forward kernel call a layer instead of two).
    max_segments    packed rows: at least the segments of any row (`segments.count_segments`),
                    or None; with it dense mode runs cuDNN's packed kernel instead of building
                    an [S, S] mask (`MLAProjection.attend_causal`).
    indexer_loss    compute the IndexCache indexer KL (returned as `indexer_kl`). `loss_terms`
                    sets it from its loss weights (weights.indexer > 0)."""

    mode: str = "sparse"
    form: str = "absorbed"
    kernels: ops.KernelChoice = ops.KernelChoice()
    remat: bool = False
    keep_attention: bool = False
    max_segments: int | None = None
    indexer_loss: bool = False

    def __post_init__(self):
        for name, allowed in (("mode", MODES), ("form", FORMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ForwardOptions.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("indexer_loss", "remat", "keep_attention"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ForwardOptions.{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_segments is not None and (not isinstance(self.max_segments, int) or self.max_segments < 1):
            raise ValueError(f"ForwardOptions.max_segments must be a positive int or None, got {self.max_segments!r}")
        if not isinstance(self.kernels, ops.KernelChoice):
            raise TypeError(f"ForwardOptions.kernels must be an ops.KernelChoice, got {type(self.kernels).__name__}")

    def replace(self, **changes) -> "ForwardOptions":
        """A copy with the named fields changed (checked as a new value is)."""
        return dataclasses.replace(self, **changes)


def check_options(owner: str, options, name: str = "options") -> ForwardOptions:
    """options if it is a ForwardOptions, else a TypeError naming `owner` and the argument `name`."""
    if not isinstance(options, ForwardOptions):
        raise TypeError(f"{owner}: {name} must be a ForwardOptions (e.g. ForwardOptions(mode=\"sparse\")), "
                        f"got {type(options).__name__} {options!r}")
    return options


def check_cached(owner: str, options) -> ForwardOptions:
    """options of a cached call, which reads only its kernels; a ValueError naming `owner` if any
    other field is set (the cached calls attend sparse, in the absorbed form, with no loss and no
    backward pass)."""
    check_options(owner, options)
    others = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
              if f.name != "kernels" and getattr(options, f.name) != f.default}
    if others:
        raise ValueError(f"{owner}: a cached call reads only options.kernels (it attends sparse, in the absorbed "
                         f"form); got {', '.join(f'{k}={v!r}' for k, v in others.items())}")
    return options
