"""Model configuration: one frozen dataclass holding every key of a `glm_moe_dsa` checkpoint.

Load a preset by name with `load_config("glm-5.2")` (the presets ship with the package:
`preset_names()`), a YAML file with `load_config("path/to/config.yaml")`, or a Hugging Face
checkpoint's config with `load_config("path/config.json")`. Field names are the checkpoint's own,
so a `config.json` maps one to one. Validation happens on construction: a bad config raises
`ConfigError` naming the key and the fix.

IndexShare: `layer_is_full` says which layers run their own lightning indexer ("Full", F);
the others ("Shared", S) reuse the indices of the nearest preceding Full layer. It comes from
`index_topk_pattern` (a string of F/S, one per layer) when given, else from GLM-5.2's rule:
layer i is Full iff `max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration that cannot describe a valid model."""


# Keys a Hugging Face config.json carries that say nothing about the model's math.
_HF_METADATA_KEYS = frozenset({
    "architectures", "auto_map", "transformers_version", "torch_dtype", "quantization_config",
    "pretraining_tp", "use_cache", "_name_or_path", "output_attentions", "output_hidden_states",
    "return_dict", "tie_encoder_decoder", "is_encoder_decoder", "ep_size", "num_experts",
    "moe_layer_freq", "partial_rotary_factor", "rope_parameters", "output_router_logits",
})
#: Per-layer lists and derived values that Hugging Face transformers (5.x) writes into a
#: config.json; `_fold_hf_layer_keys` checks them against the keys they derive from.
_HF_DERIVED_KEYS = ("indexer_types", "layer_types", "mlp_layer_types", "mlp_bias", "qk_head_dim")
#: Keys that together give the IndexShare schedule (`GLMConfig.pattern`).
_SCHEDULE_KEYS = ("index_topk_freq", "index_skip_topk_offset", "index_topk_pattern")
#: Keys `GLMConfig.differences` does not compare.
_UNCOMPARED_KEYS = frozenset({"name", "head_dim"})


@dataclasses.dataclass(frozen=True)
class GLMConfig:
    """Every key of the `glm_moe_dsa` / `deepseek_v32` checkpoint config, plus `name` and `dtype`.

    Attention is MLA: queries go through a rank-`q_lora_rank` bottleneck, keys and values
    through a shared latent of `kv_lora_rank` plus one `qk_rope_head_dim` RoPE key.
    """

    name: str = "unnamed"
    model_type: str = "glm_moe_dsa"
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    head_dim: int = 192  # checkpoint key; the qk head dim is qk_nope + qk_rope (see qk_head_dim)
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    rope_theta: float = 8_000_000.0
    rope_scaling: tuple | None = None  # given as a mapping; stored as sorted (key, value) pairs
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    attention_bias: bool = False
    attention_dropout: float = 0.0
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 0
    index_topk_pattern: str | None = None
    index_share_for_mtp_iteration: bool = False
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str = "bfloat16"

    def __post_init__(self):
        # Stored hashable so the config can sit in a module's static graph and in jit keys.
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        _validate(self)

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    # ----------------------------------------------------------------- derived quantities
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the expanded form: nope + rope (256 for GLM-5.2)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent row: c_kv + k_rope (576 for GLM-5.2)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def layer_is_full(self) -> tuple[bool, ...]:
        """One bool per decoder layer: True where the layer runs its own indexer."""
        return layer_schedule(self.num_hidden_layers, self.index_topk_freq, self.index_skip_topk_offset,
                              self.index_topk_pattern)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, full in enumerate(self.layer_is_full) if full)

    @property
    def layer_is_moe(self) -> tuple[bool, ...]:
        return tuple(i >= self.first_k_dense_replace for i in range(self.num_hidden_layers))

    @property
    def pattern(self) -> str:
        """The IndexShare pattern as an F/S string, whichever way it was configured."""
        return "".join("F" if f else "S" for f in self.layer_is_full)

    # ----------------------------------------------------------------- loading and saving
    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> "GLMConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {unknown}. Valid keys are the checkpoint's own "
                f"(e.g. {sorted(known)[:6]}...); fix the spelling or remove the key.")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "GLMConfig":
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist; give a path, or a preset name: "
                              f"{', '.join(preset_names())}")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
        values.setdefault("name", path.stem)
        return cls.from_dict(values, source=str(path))

    @classmethod
    def from_hf_json(cls, path: str | Path, *, name: str | None = None) -> "GLMConfig":
        """Read a Hugging Face `config.json` (a file or the checkpoint directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        raw = json.loads(path.read_text())
        values = {k: v for k, v in raw.items() if k not in _HF_METADATA_KEYS}
        rope_parameters = raw.get("rope_parameters")
        if rope_parameters and "rope_theta" not in values:
            values["rope_theta"] = rope_parameters["rope_theta"]
            if rope_parameters.get("rope_type", "default") != "default":
                values["rope_scaling"] = rope_parameters
        if values.get("model_type") == "deepseek_v32":
            values.setdefault("indexer_rope_interleave", False)
        if "dtype" in values and values["dtype"] not in ("bfloat16", "float32", "float16"):
            values.pop("dtype")
        values["name"] = name or path.parent.name
        _fold_hf_layer_keys(values, raw, source=str(path))
        return cls.from_dict(values, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["rope_scaling"] = self.rope_scaling_dict
        if isinstance(self.eos_token_id, tuple):
            values["eos_token_id"] = list(self.eos_token_id)
        return values

    def replace(self, **changes) -> "GLMConfig":
        return dataclasses.replace(self, **changes)

    def differences(self, other: "GLMConfig") -> list[str]:
        """Keys whose values change the model, as 'key: self != other'.

        The IndexShare schedule is compared as the per-layer pattern (freq/offset and an explicit
        pattern that give the same layers are the same model); `name` and the informational
        `head_dim` (Hugging Face transformers rewrites it to qk_rope_head_dim) are not compared."""
        da, db = self.to_dict(), other.to_dict()
        for d, c in ((da, self), (db, other)):
            for key in _SCHEDULE_KEYS:
                d.pop(key)
            d["pattern"] = c.pattern
        return [f"{k}: {da[k]!r} != {db[k]!r}" for k in da if k not in _UNCOMPARED_KEYS and da[k] != db[k]]


def layer_schedule(num_layers: int, freq: int, offset: int, pattern: str | None = None) -> tuple[bool, ...]:
    """One bool per decoder layer, True where it runs its own indexer: `pattern` (F/S) when
    given, else GLM-5.2's rule, Full iff max(i - offset + 1, 0) % freq == 0."""
    if pattern is not None:
        return tuple(c == "F" for c in pattern)
    return tuple(max(i - offset + 1, 0) % max(freq, 1) == 0 for i in range(num_layers))


def _validate(c: GLMConfig) -> None:
    def fail(key: str, problem: str, fix: str):
        raise ConfigError(f"config key `{key}`: {problem}; {fix}")

    positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "index_head_dim", "index_n_heads", "max_position_embeddings",
                "index_topk_freq"]
    for key in positive:
        if getattr(c, key) <= 0:
            fail(key, f"must be > 0, got {getattr(c, key)}", "set a positive integer")
    if c.index_topk <= 0:
        fail("index_topk", f"must be > 0, got {c.index_topk}",
             "set the number of tokens each query attends to (GLM-5.2: 2048)")
    if c.qk_rope_head_dim % 2 or c.index_head_dim % 2:
        fail("qk_rope_head_dim", "RoPE dims must be even", "use an even qk_rope_head_dim")
    if c.index_head_dim < c.qk_rope_head_dim:
        fail("index_head_dim", f"{c.index_head_dim} < qk_rope_head_dim {c.qk_rope_head_dim}",
             "the indexer applies RoPE to its first qk_rope_head_dim dims; raise index_head_dim")
    if c.num_key_value_heads != c.num_attention_heads:
        fail("num_key_value_heads", f"{c.num_key_value_heads} != num_attention_heads "
             f"{c.num_attention_heads}", "MLA expands one latent to every head; set them equal")
    if c.n_routed_experts > 0:
        if not 0 < c.num_experts_per_tok <= c.n_routed_experts:
            fail("num_experts_per_tok", f"{c.num_experts_per_tok} with {c.n_routed_experts} experts",
                 "choose 1 <= num_experts_per_tok <= n_routed_experts")
        if c.n_routed_experts % c.n_group:
            fail("n_group", f"{c.n_group} groups do not divide {c.n_routed_experts} experts",
                 "choose n_group dividing n_routed_experts")
        if not 0 < c.topk_group <= c.n_group:
            fail("topk_group", f"{c.topk_group} with n_group {c.n_group}",
                 "choose 1 <= topk_group <= n_group")
        if c.n_group > 1 and c.num_experts_per_tok > c.topk_group * (c.n_routed_experts // c.n_group):
            fail("num_experts_per_tok", "more experts per token than the selected groups hold",
                 "raise topk_group or lower num_experts_per_tok")
    if c.scoring_func != "sigmoid":
        fail("scoring_func", f"{c.scoring_func!r} is not supported", "use 'sigmoid'")
    if c.hidden_act != "silu":
        fail("hidden_act", f"{c.hidden_act!r} is not supported", "use 'silu' (SwiGLU)")
    if not 0 <= c.first_k_dense_replace <= c.num_hidden_layers:
        fail("first_k_dense_replace", f"{c.first_k_dense_replace} outside [0, layers]",
             "set the number of leading dense layers")
    if c.num_nextn_predict_layers not in (0, 1):
        fail("num_nextn_predict_layers", f"{c.num_nextn_predict_layers}",
             "GLM/DeepSeek checkpoints carry 0 or 1 MTP layer (applied recursively)")
    scaling = c.rope_scaling_dict
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("yarn", "default"):
        fail("rope_scaling", f"type {c.rope_scaling!r} is not supported", "use yarn or null")
    if c.dtype not in ("bfloat16", "float32", "float16"):
        fail("dtype", f"{c.dtype!r}", "use bfloat16, float16 or float32")
    if c.index_topk_pattern is not None:
        p = c.index_topk_pattern
        if len(p) != c.num_hidden_layers or set(p) - {"F", "S"}:
            fail("index_topk_pattern", f"{p!r} is not {c.num_hidden_layers} characters of F/S",
                 "give one F (own indexer) or S (shared) per decoder layer")
        if p[0] != "F":
            fail("index_topk_pattern", "the first layer is S, but a Shared layer needs a Full "
                 "layer before it", "start the pattern with F")
    elif not c.layer_is_full[0]:
        fail("index_skip_topk_offset", f"with freq {c.index_topk_freq} and offset "
             f"{c.index_skip_topk_offset} layer 0 would be Shared", "use an offset >= 1")


#: The preset configs shipped with the package (in a clone, `glm_jax/configs` links to the
#: top-level `configs/`, so `configs/tiny.yaml` and `load_config("tiny")` read the same file).
PRESETS_DIR = Path(__file__).parent / "configs"


def preset_names() -> tuple[str, ...]:
    """The names `load_config` takes for the shipped presets ("tiny", "glm-5.2", ...)."""
    return tuple(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))


def load_config(spec: str | Path) -> GLMConfig:
    """Load a config from a preset name (`preset_names()`), a YAML file, a config.json, or a
    directory holding one of them. A name is a string without "/" or a .yaml / .json suffix
    that is not an existing path."""
    path = Path(spec)
    if isinstance(spec, str) and "/" not in spec and not spec.endswith((".yaml", ".yml", ".json")) \
            and not path.exists():
        if spec not in preset_names():
            raise ConfigError(f"no preset named {spec!r}; the presets are {', '.join(preset_names())}, "
                              "or give the path of a YAML file, a config.json or a directory")
        path = PRESETS_DIR / f"{spec}.yaml"
    if path.is_dir():
        for candidate in ("config.yaml", "config.json"):
            if (path / candidate).exists():
                return load_config(path / candidate)
        raise ConfigError(f"{path} holds neither config.yaml nor config.json")
    if path.suffix == ".json":
        return GLMConfig.from_hf_json(path)
    return GLMConfig.from_yaml(path)


def save_config(config: GLMConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


#: The YaRN settings `extend_context` writes beside the factor (DeepSeek-V3's values: ramp
#: between 32 and 1 rotations over the original length; mscale equal to mscale_all_dim, so the
#: rotation is unscaled and the softmax scale grows by (0.1 ln(factor) + 1)^2).
YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def extend_context(config: GLMConfig, length: int) -> GLMConfig:
    """`config` with `length` positions, its RoPE stretched YaRN-style: rope_scaling
    {rope_type: yarn, factor: length / original, original_max_position_embeddings: original,
    ...YARN_DEFAULTS}, where original is the length before any extension (a config extended
    before keeps its original length and YaRN settings: a second extension composes).

    ConfigError where `length` does not extend the config: not longer than its
    max_position_embeddings, or not a multiple of the original length."""
    scaling = config.rope_scaling_dict or {}
    yarn = scaling.get("rope_type", scaling.get("type")) == "yarn"
    original = int(scaling["original_max_position_embeddings"]) if yarn else config.max_position_embeddings
    if length <= config.max_position_embeddings:
        raise ConfigError(f"--context-length {length}: the model already has {config.max_position_embeddings} "
                          "positions (max_position_embeddings); give a longer length or leave the flag out")
    if length % original:
        raise ConfigError(f"--context-length {length}: not a multiple of the model's original "
                          f"{original} positions (YaRN stretches them by a whole factor); use e.g. "
                          f"{-(-length // original) * original}")
    kept = {k: v for k, v in scaling.items() if k not in ("type", "factor")} if yarn else {}
    new_scaling = {**YARN_DEFAULTS, **kept, "rope_type": "yarn", "factor": length // original,
                   "original_max_position_embeddings": original}
    return config.replace(max_position_embeddings=length, rope_scaling=new_scaling)


def _fold_hf_layer_keys(values: dict[str, Any], raw: dict[str, Any], *, source: str) -> None:
    """Checks the per-layer keys Hugging Face transformers writes and folds them into `values`.

    * indexer_types ["full"/"shared" per layer] is the IndexShare pattern: it must agree with
      index_topk_freq / index_skip_topk_offset / index_topk_pattern where those are given,
      and becomes index_topk_pattern where they are not.
    * layer_types: every layer "indexed_attention" (DSA attention, what this model runs).
    * mlp_layer_types: "dense" for the first first_k_dense_replace layers, "sparse" (MoE) after.
    * mlp_bias false (the MLPs have no bias); qk_head_dim = qk_nope_head_dim + qk_rope_head_dim.
    Raises ConfigError naming the key, the layers that disagree and the fix."""
    for key in _HF_DERIVED_KEYS:
        values.pop(key, None)
    layers = raw.get("num_hidden_layers", GLMConfig.num_hidden_layers)

    def per_layer(key: str, allowed: tuple[str, ...]) -> list[str] | None:
        got = raw.get(key)
        if got is None:
            return None
        if not isinstance(got, list) or len(got) != layers or any(v not in allowed for v in got):
            raise ConfigError(f"{source}: `{key}` must list one of {list(allowed)} for each of the "
                              f"{layers} layers, got {got!r}")
        return got

    def disagree(key: str, got: list[str], expected: list[str], against: str) -> None:
        bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
        if bad:
            raise ConfigError(f"{source}: `{key}` disagrees with {against} at layer(s) {bad[:8]}"
                              f"{' ...' if len(bad) > 8 else ''} (expected {[expected[i] for i in bad[:4]]}, "
                              f"got {[got[i] for i in bad[:4]]}); make them agree or drop one of them")

    indexer_types = per_layer("indexer_types", ("full", "shared"))
    if indexer_types is not None:
        given = [k for k in _SCHEDULE_KEYS if k in values]
        if given:
            schedule = layer_schedule(layers, values.get("index_topk_freq", GLMConfig.index_topk_freq),
                                      values.get("index_skip_topk_offset", GLMConfig.index_skip_topk_offset),
                                      values.get("index_topk_pattern"))
            disagree("indexer_types", indexer_types, ["full" if f else "shared" for f in schedule],
                     " / ".join(given))
        else:
            values["index_topk_pattern"] = "".join("F" if t == "full" else "S" for t in indexer_types)
    layer_types = per_layer("layer_types", ("indexed_attention",))
    del layer_types  # validated: every layer runs DSA attention
    mlp_types = per_layer("mlp_layer_types", ("dense", "sparse"))
    if mlp_types is not None:
        dense = values.get("first_k_dense_replace", GLMConfig.first_k_dense_replace)
        disagree("mlp_layer_types", mlp_types, ["dense" if i < dense else "sparse" for i in range(layers)],
                 f"first_k_dense_replace={dense}")
    if raw.get("mlp_bias", False):
        raise ConfigError(f"{source}: `mlp_bias` is true, but this model's MLPs have no bias; "
                          "a checkpoint of this family has mlp_bias false")
    if "qk_head_dim" in raw:
        nope = values.get("qk_nope_head_dim", GLMConfig.qk_nope_head_dim)
        rope = values.get("qk_rope_head_dim", GLMConfig.qk_rope_head_dim)
        if raw["qk_head_dim"] != nope + rope:
            raise ConfigError(f"{source}: `qk_head_dim` {raw['qk_head_dim']} != qk_nope_head_dim {nope} + "
                              f"qk_rope_head_dim {rope}; fix one of them")
