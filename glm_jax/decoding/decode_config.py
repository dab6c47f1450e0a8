"""`DecodeConfig`: the settings of a decode (decode.py's numbers, sampling, speculation,
placement and kernels), checked on construction (`glm_jax.settings`): a bad value is one
SettingError naming the setting and its flag, before any model is loaded. The generator or
engine they describe: `builders`."""

from __future__ import annotations

import dataclasses

from glm_jax import ops
from glm_jax.cache.fp8 import KV_CACHE_DTYPES, check_fp8_impls, store_dtype
from glm_jax.forward_options import ForwardOptions
from glm_jax.kernel_configs import configured
from glm_jax.decoding.sampling import SamplingError, SamplingParams
from glm_jax.settings import FrozenDict, Settings, SettingError, impl_choices, setting


@dataclasses.dataclass(frozen=True)
class DecodeConfig(Settings):
    max_new_tokens: int = setting(128, above=0, help="tokens to generate per prompt")
    max_len: int | None = setting(None, at_least=1, help="cache length (default: the model's context)")
    # Sampling: chosen by benchmarks/repetition.py (docs/default-model.md, "Default sampling"): at
    # temperature 0.7 / top-p 0.9 the default model repeated a line more than 3 times in 8 of 20
    # held-out completions, at temperature 1 / top-k 40 in 1 of 20.
    temperature: float = setting(1.0, help="0 = greedy")
    top_p: float = setting(1.0, help="nucleus mass to keep (1 = off)")
    top_k: int = setting(40, help="keep the k most likely tokens (0 = off)")
    min_p: float = setting(0.0, help="keep tokens at least this fraction as likely as the most likely one (0 = off)")
    seed: int = setting(0, help="the sampling seed")
    speculative: int | None = setting(None, at_least=0, metavar="K",
                                      help="draft K tokens per step with the MTP layer (0 = plain decoding; default: "
                                           "K where it measured faster than plain decoding for this backend and "
                                           "batch, else plain; glm_jax/decoding/policy.py)")
    kv_share: bool = setting(True, flag="--no-kv-share",
                             help="draft steps 2..K reuse the target's indexer selection (--no-kv-share: they run "
                                  "their own indexer over target+draft KV, the baseline)")
    prefill_chunk: int = setting(256, at_least=1, help="prompt tokens per prefill call")
    max_batch: int | None = setting(None, at_least=1, metavar="N",
                                    help="decode the prompts through the serving engine, N sequences at a time "
                                         "(continuous batching; plain decoding, each prompt its own sampling "
                                         "stream); with --serve, the requests decoded together (default 4)")
    mesh: str | None = setting(None, metavar="SPEC",
                               help="a device mesh 'axis=size,...' over data, context, tensor, layer: e.g. "
                                    "data=1,layer=8; layer > 1 splits the KV cache across devices by layer "
                                    "(LayerSplit); on a CPU the devices are simulated")
    collective: str = setting("permute", choices=("permute", "psum"),
                              help="how a layer's cache owner sends rows to the other devices (LayerSplit)")
    attention_impl: str = setting("auto", choices=impl_choices("sparse_mla"),
                                  help="the sparse attention (sparse MLA) kernel; auto: the backend's Pallas kernel "
                                       "on a TPU or GPU, else xla")
    indexer_impl: str = setting("auto", choices=impl_choices("indexer_topk"),
                                help="the lightning indexer's kernels (scores and top-k)")
    kernel_config: FrozenDict = setting(FrozenDict(), help="group -> field -> value (the command line's "
                                                           "--kernel-config GROUP.FIELD=VALUE items)")
    # Checked in __post_init__ (not as tyro choices) so that a bad value is refused in one line.
    kv_cache_dtype: str = setting("auto", metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                                  help="the KV cache's rows: auto (the model's dtype), bf16, or fp8 (e4m3 latent "
                                       "values with a float32 scale per 128, bf16 RoPE part, e4m3 indexer keys: "
                                       "quantized per token when written, 1.77x the tokens per byte at GLM-5.2's "
                                       "shape; docs/serving.md)")
    batch_invariant: bool = setting(False, help="give each prompt the tokens it gets alone, whatever its batch, "
                                                "chunk size or speculation: every token computed in row chunks of "
                                                "one shape (glm_jax.ops.KernelChoice; its cost: "
                                                "benchmarks/speculative.py --batch-invariant)")
    decode_steps: int = setting(1, at_least=1, metavar="N",
                                help="with --max-batch or --serve: up to N decode steps per call of the serving "
                                     "engine while no prompt is prefilled or admitted (1..the page size: 16, or "
                                     "--page-size with --serve; a new request waits up to one block, the host's "
                                     "cost of a call is spread over N tokens; docs/serving.md)")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sampling()               # its rules are SamplingParams'
        try:
            store_dtype(self.kv_cache_dtype)          # one of KV_CACHE_DTYPES
            if self.kv_cache_dtype == "fp8":
                check_fp8_impls(self.attention_impl, self.indexer_impl)
        except ValueError as e:
            raise SettingError(str(e)) from None

    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)
        except SamplingError as e:
            raise SettingError(f"--{e.field.replace('_', '-')} must be {e.rule}, got {e.value!r}") from None

    def forward(self) -> ForwardOptions:
        """The decoding programs' `ForwardOptions`: the kernels, their configs set
        (`kernel_configs.configured`: resolves "auto" on this backend)."""
        return ForwardOptions(kernels=configured(ops.KernelChoice(
            indexer_topk=self.indexer_impl, sparse_mla=self.attention_impl, batch_invariant=self.batch_invariant),
            self.kernel_config))
