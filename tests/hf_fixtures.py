"""Tiny random Hugging Face checkpoints in the real `glm_moe_dsa` / `deepseek_v32` naming, written
with the `safetensors` package, and an independent numpy forward pass over their raw tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn

COMMON = dict(
    vocab_size=61, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=5,
    num_attention_heads=2, num_key_value_heads=2, head_dim=8, q_lora_rank=24, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
    topk_method="noaux_tc", first_k_dense_replace=1, hidden_act="silu", max_position_embeddings=64,
    index_topk=4, index_head_dim=16, num_nextn_predict_layers=1, tie_word_embeddings=False,
    torch_dtype="bfloat16", use_cache=True, transformers_version="4.57.0")

# GLM-5.2 shape: IndexShare by freq/offset (Full layers 0, 1, 3 of 5), interleaved indexer RoPE.
GLM = dict(COMMON, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", n_group=1, topk_group=1,
           rms_norm_eps=1e-5, rope_theta=8_000_000.0, rope_scaling=None, index_n_heads=2,
           index_topk_freq=2, index_skip_topk_offset=2, index_share_for_mtp_iteration=True,
           indexer_rope_interleave=True, rope_interleave=True)
# DeepSeek-V3.2 shape: every layer Full, YaRN, half-split indexer RoPE, group-limited routing.
DEEPSEEK = dict(COMMON, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", n_group=2,
                topk_group=1, rms_norm_eps=1e-6, rope_theta=10000.0, index_n_heads=4,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def full_layers(c: dict) -> list[bool]:
    f, off = c.get("index_topk_freq", 1), c.get("index_skip_topk_offset", 0)
    return [max(i - off + 1, 0) % f == 0 for i in range(c["num_hidden_layers"])]


def layer_tensors(c: dict, i: int, *, moe: bool, indexer: bool) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape [out, in] of one decoder layer."""
    h, nh, q, kv = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    p = f"model.layers.{i}."
    t = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
         p + "self_attn.q_a_proj.weight": (q, h), p + "self_attn.q_a_layernorm.weight": (q,),
         p + "self_attn.q_b_proj.weight": (nh * (nope + rope), q),
         p + "self_attn.kv_a_proj_with_mqa.weight": (kv + rope, h), p + "self_attn.kv_a_layernorm.weight": (kv,),
         p + "self_attn.kv_b_proj.weight": (nh * (nope + v), kv), p + "self_attn.o_proj.weight": (h, nh * v)}
    if indexer:
        ih, inh = c["index_head_dim"], c["index_n_heads"]
        t |= {p + "self_attn.indexer.wq_b.weight": (inh * ih, q), p + "self_attn.indexer.wk.weight": (ih, h),
              p + "self_attn.indexer.k_norm.weight": (ih,), p + "self_attn.indexer.k_norm.bias": (ih,),
              p + "self_attn.indexer.weights_proj.weight": (inh, h)}
    if not moe:
        f = c["intermediate_size"]
        return t | {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)}
    e, f = c["n_routed_experts"], c["moe_intermediate_size"]
    t |= {p + "mlp.gate.weight": (e, h), p + "mlp.gate.e_score_correction_bias": (e,)}
    for name, hidden in (("experts.{}", f), ("shared_experts", f * c["n_shared_experts"])):
        for j in range(e) if "{}" in name else [None]:
            q_ = p + "mlp." + name.format(j) + "."
            t |= {q_ + "gate_proj.weight": (hidden, h), q_ + "up_proj.weight": (hidden, h),
                  q_ + "down_proj.weight": (h, hidden)}
    return t


def all_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    h, n = c["hidden_size"], c["num_hidden_layers"]
    t = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
         "lm_head.weight": (c["vocab_size"], h)}
    for i, full in enumerate(full_layers(c)):
        t |= layer_tensors(c, i, moe=i >= c["first_k_dense_replace"], indexer=full)
    t |= layer_tensors(c, n, moe=True, indexer=True)
    t |= {f"model.layers.{n}.{k}.weight": (h,) for k in ("enorm", "hnorm", "shared_head.norm")}
    t[f"model.layers.{n}.eh_proj.weight"] = (h, 2 * h)
    return t


def _random(name: str, shape, rng) -> np.ndarray:
    if name.endswith("e_score_correction_bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if len(shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(shape)) if not name.endswith("bias") else 0.1 * rng.standard_normal(shape)
    return rng.standard_normal(shape) * (0.5 if "embed" in name else shape[-1] ** -0.5)


def _quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Per-block absmax fp8 quantisation -> (values float8 [out, in], scale_inv float32 [bo, bi])."""
    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    scale = np.zeros((rows, cols), np.float32)
    q = np.zeros(w.shape, FP8)
    for r in range(rows):
        for k in range(cols):
            part = w[r * block[0]:(r + 1) * block[0], k * block[1]:(k + 1) * block[1]]
            scale[r, k] = max(np.abs(part).max(), 1e-12) / 448.0
            q[r * block[0]:(r + 1) * block[0], k * block[1]:(k + 1) * block[1]] = (part / scale[r, k]).astype(FP8)
    return q, scale


def write_checkpoint(directory: Path, c: dict, *, seed: int = 0, fp8_layer: int | None = None,
                     block=(16, 16), shards: int = 3, mtp_copies: bool = False, edit=None) -> dict[str, np.ndarray]:
    """Write config.json, `shards` safetensors files and the index; every tensor of decoder layer
    `fp8_layer` that is a 2-D projection goes fp8 (with scales) into a shard of its own.
    edit(tensors) may change the stored dict before writing. -> the real values, float32."""
    rng = np.random.default_rng(seed)
    stored, values = {}, {}
    for name, shape in all_tensors(c).items():
        w = np.asarray(_random(name, shape, rng), np.float32)
        quantise = (fp8_layer is not None and name.startswith(f"model.layers.{fp8_layer}.") and w.ndim == 2
                    and not name.endswith(("mlp.gate.weight", "weights_proj.weight")))
        if quantise:
            q, s = _quantize(w, block)
            stored[name], stored[name + "_scale_inv"] = q, s
            values[name] = q.astype(np.float32) * np.kron(s, np.ones(block, np.float32))[:w.shape[0], :w.shape[1]]
        else:
            stored[name] = w if w.dtype == np.float32 and name.endswith("correction_bias") else w.astype(BF16)
            values[name] = stored[name].astype(np.float32)
    n = c["num_hidden_layers"]
    if mtp_copies:
        stored[f"model.layers.{n}.embed_tokens.weight"] = stored["model.embed_tokens.weight"]
        stored[f"model.layers.{n}.shared_head.head.weight"] = stored["lm_head.weight"]
    if edit:
        edit(stored)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(c)
    if fp8_layer is not None:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    files: list[dict] = [{} for _ in range(shards)]
    for name, value in stored.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        plain = shards - 1 if fp8_layer is not None and shards > 1 else shards
        k = shards - 1 if fp8_layer is not None and layer == fp8_layer else (layer + 1) % plain
        files[k][name] = value
    weight_map = {}
    for k, tensors in enumerate(files):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in tensors}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return values


# ---------------------------------------------------------------------- numpy forward
def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _inv_freq(c: dict) -> np.ndarray:
    d, theta = c["qk_rope_head_dim"], c["rope_theta"]
    freqs = theta ** -(np.arange(0, d, 2) / d)
    ys = c.get("rope_scaling")
    if not ys:
        return freqs
    orig, factor = ys["original_max_position_embeddings"], ys["factor"]
    dim_at = lambda rot: d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    lo, hi = max(math.floor(dim_at(ys["beta_fast"])), 0), min(math.ceil(dim_at(ys["beta_slow"])), d - 1)
    ramp = np.clip((np.arange(d // 2) - lo) / max(hi - lo, 1e-3), 0, 1)
    return freqs * ramp / factor + freqs * (1 - ramp)


def _rotate(x, pos, inv_freq, interleaved: bool):
    """x [S, ..., d] rotated by position; pairs (2i, 2i+1) or (i, i + d/2)."""
    ang = pos[:, None] * inv_freq[None, :]
    ang = ang.reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (-1,))
    cos, sin = np.cos(ang), np.sin(ang)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def _indexer_topk(c, W, p, x, qr, pos):
    ih, inh, r = c["index_head_dim"], c["index_n_heads"], c["qk_rope_head_dim"]
    interleaved = c.get("indexer_rope_interleave", c["model_type"] != "deepseek_v32")
    inv = _inv_freq(c)
    q = (qr @ W[p + "self_attn.indexer.wq_b.weight"].T).reshape(len(x), inh, ih)
    k = x @ W[p + "self_attn.indexer.wk.weight"].T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    k = k * W[p + "self_attn.indexer.k_norm.weight"] + W[p + "self_attn.indexer.k_norm.bias"]
    q = np.concatenate([_rotate(q[..., :r], pos, inv, interleaved), q[..., r:]], -1)
    k = np.concatenate([_rotate(k[..., :r], pos, inv, interleaved), k[..., r:]], -1)
    w = (x @ W[p + "self_attn.indexer.weights_proj.weight"].T) * inh ** -0.5
    score = np.einsum("th,ths->ts", w, np.maximum(np.einsum("thd,sd->ths", q, k), 0)) * ih ** -0.5
    sel = np.zeros((len(x), len(x)), bool)
    for t in range(len(x)):
        order = sorted(range(t + 1), key=lambda s: (-score[t, s], s))
        sel[t, order[:min(c["index_topk"], t + 1)]] = True
    return sel


def _experts(c, W, p, x):
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731

    def ffn(q, v):
        return (silu(v @ W[q + "gate_proj.weight"].T) * (v @ W[q + "up_proj.weight"].T)) @ W[q + "down_proj.weight"].T

    if p + "mlp.gate.weight" not in W:
        return ffn(p + "mlp.", x)
    out = ffn(p + "mlp.shared_experts.", x)
    e, k, g = c["n_routed_experts"], c["num_experts_per_tok"], c["n_group"]
    for t in range(len(x)):
        s = 1 / (1 + np.exp(-(W[p + "mlp.gate.weight"] @ x[t])))
        pick = s + W[p + "mlp.gate.e_score_correction_bias"]
        groups = pick.reshape(g, -1)
        best = np.argsort(-np.sort(groups, -1)[:, -2:].sum(-1), kind="stable")[:c["topk_group"]]
        allowed = np.isin(np.arange(e) // (e // g), best)
        chosen = sorted(np.flatnonzero(allowed), key=lambda j: -pick[j])[:k]
        weights = s[chosen] / (s[chosen].sum() if c["norm_topk_prob"] else 1) * c["routed_scaling_factor"]
        for j, wj in zip(chosen, weights):
            out[t] += wj * ffn(f"{p}mlp.experts.{j}.", x[t:t + 1])[0]
    return out


def _layer(c, W, i, x, pos, sel):
    """One decoder layer (numpy, float64). sel: the Full layer's top-k mask, None on a Full layer."""
    p, eps = f"model.layers.{i}.", c["rms_norm_eps"]
    nh, nope, r, v, kvr = (c[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim", "kv_lora_rank"))
    h = _rms(x, W[p + "input_layernorm.weight"], eps)
    qr = _rms(h @ W[p + "self_attn.q_a_proj.weight"].T, W[p + "self_attn.q_a_layernorm.weight"], eps)
    if sel is None:
        sel = _indexer_topk(c, W, p, h, qr, pos)
    q = (qr @ W[p + "self_attn.q_b_proj.weight"].T).reshape(len(x), nh, nope + r)
    kv = h @ W[p + "self_attn.kv_a_proj_with_mqa.weight"].T
    latent, k_pe = _rms(kv[:, :kvr], W[p + "self_attn.kv_a_layernorm.weight"], eps), kv[:, kvr:]
    inv = _inv_freq(c)
    q_pe, k_pe = _rotate(q[..., nope:], pos, inv, True), _rotate(k_pe, pos, inv, True)
    kvb = (latent @ W[p + "self_attn.kv_b_proj.weight"].T).reshape(len(x), nh, nope + v)
    scale = (nope + r) ** -0.5
    if c.get("rope_scaling"):
        m = 0.1 * c["rope_scaling"]["mscale_all_dim"] * math.log(c["rope_scaling"]["factor"]) + 1
        scale *= m * m
    logits = (np.einsum("thd,shd->hts", q[..., :nope], kvb[..., :nope]) + np.einsum("thd,sd->hts", q_pe, k_pe)) * scale
    logits = np.where(sel[None], logits, -np.inf)
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    attn = np.einsum("hts,shd->thd", prob, kvb[..., nope:]).reshape(len(x), -1)
    x = x + attn @ W[p + "self_attn.o_proj.weight"].T
    x = x + _experts(c, W, p, _rms(x, W[p + "post_attention_layernorm.weight"], eps))
    return x, sel


def forward(c: dict, W: dict, tokens: np.ndarray):
    """tokens [S] -> (logits [S, V], final normed hidden [S, H]), float64."""
    W = {k: v.astype(np.float64) for k, v in W.items()}
    pos = np.arange(len(tokens), dtype=np.float64)
    x, sel = W["model.embed_tokens.weight"][tokens], None
    for i, full in enumerate(full_layers(c)):
        x, sel = _layer(c, W, i, x, pos, None if full else sel)
    h = _rms(x, W["model.norm.weight"], c["rms_norm_eps"])
    return h @ W["lm_head.weight"].T, h


def mtp_forward(c: dict, W: dict, hidden: np.ndarray, next_tokens: np.ndarray) -> np.ndarray:
    """The MTP layer: hidden [S, H] (normed), next_tokens [S] -> logits [S, V]."""
    W = {k: v.astype(np.float64) for k, v in W.items()}
    n, eps = c["num_hidden_layers"], c["rms_norm_eps"]
    p = f"model.layers.{n}."
    e = _rms(W["model.embed_tokens.weight"][next_tokens], W[p + "enorm.weight"], eps)
    x = np.concatenate([e, _rms(hidden, W[p + "hnorm.weight"], eps)], -1) @ W[p + "eh_proj.weight"].T
    x, _ = _layer(c, W, n, x, np.arange(len(x), dtype=np.float64), None)
    return _rms(x, W[p + "shared_head.norm.weight"], eps) @ W["lm_head.weight"].T
