"""Generate text with a trained model: prefill with sparse attention, then decode from the KV cache.

    python decode.py                                   # the shipped default model, a default prompt
    python decode.py --checkpoint runs/tiny --prompt "def parse(" --max-new-tokens 200
    python decode.py --hf-checkpoint GLM-5.2/ --prompt "Hello"      # a Hugging Face checkpoint directory
    python decode.py --hf-checkpoint DIR --prompt-ids 1,2,3          # token ids in and out, no tokenizer
    python decode.py --mesh data=1,layer=8             # KV cache LayerSplit over 8 devices
    python decode.py --prompts-file p.jsonl --max-batch 4   # the prompts as concurrent requests of the
                                                       # serving engine (continuous batching)
    python decode.py --mesh data=2,layer=4 --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0
                                                       # one of several processes (hosts); --distributed
                                                       # finds these by itself on a TPU pod or under SLURM
    python decode.py --config configs/glm-5.2.yaml --topology v5p:4x4x4 --max-context 1048576 --compile-only
    python decode.py --serve --port 8000               # OpenAI-style /v1/completions over HTTP (docs/serving.md)
    python decode.py --decode-config sampling.yaml --top-k 0   # settings from a YAML file, flags overriding them

Output: the prompt, then its completion. On a terminal the prompt is dimmed; piped (or with
NO_COLOR set) a line `----- completion -----` follows the prompt, so the completion is everything
after the first "\n----- completion -----\n" (glm_jax/decoding/display.py). --prompt-ids prints
the ids only, unmarked; --output writes {prompt, completion} JSON lines.
"""

from __future__ import annotations

from glm_jax.frontends import cli
from glm_jax.frontends.decode import DecodeCommand, decode_config, main, parse_args  # noqa: F401 - the command line

if __name__ == "__main__":
    cli.exit_with(main())
