"""Generate text with a trained model: prefill with sparse attention, then decode from the KV cache.

    python decode.py                                   # the shipped default model, a default prompt
    python decode.py --checkpoint runs/tiny --prompt "def parse(" --max-new-tokens 200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "default"
DEFAULT_PROMPT = "import os\n\n\ndef read_lines(path):\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                    help="a model directory (config.yaml, tokenizer.json, params/)")
    ap.add_argument("--config", default=None, help="expected config; refused if the checkpoint's differs")
    ap.add_argument("--prompt", default=None, help="prompt text (default: a Python function header)")
    ap.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=None, help="cache length (default: the model's context)")
    ap.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", type=int, default=3, metavar="K",
                    help="draft K tokens per step with the MTP layer (0 = plain decoding; default 3)")
    ap.add_argument("--no-kv-share", action="store_true",
                    help="draft steps 2..K run their own indexer over target+draft KV (the baseline)")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--quiet", action="store_true", help="print only the generated text")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # Imported here so that --help answers at once.
    from glm_jax.checkpoint import CheckpointMismatchError, load_model_dir
    from glm_jax.config import ConfigError, load_config
    from glm_jax.data.tokenizer import eos_id, load_tokenizer
    from glm_jax.decoding.generate import ContextTooLongError, Generator, print_progress
    from glm_jax.decoding.speculative import SpeculativeGenerator

    def fail(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 2

    if args.max_new_tokens <= 0:
        return fail("--max-new-tokens must be > 0")
    if args.speculative < 0:
        return fail("--speculative must be >= 0 (0 = plain decoding)")
    if not 0 < args.top_p <= 1 or args.temperature < 0:
        return fail("--top-p must be in (0, 1] and --temperature >= 0")
    prompt = args.prompt
    if args.prompt_file:
        prompt = Path(args.prompt_file).read_text()
    if prompt is None:
        prompt = DEFAULT_PROMPT
    try:
        expected = load_config(args.config) if args.config else None
        model = load_model_dir(args.checkpoint, config=expected)
        tok = load_tokenizer(args.checkpoint)
        ids = np.asarray(tok.encode(prompt).ids, np.int32)
        if args.speculative and model.mtp is not None:
            gen = SpeculativeGenerator(model, batch=1, max_len=args.max_len, num_draft=args.speculative,
                                       kv_share=not args.no_kv_share, prefill_chunk=args.prefill_chunk)
        else:
            gen = Generator(model, batch=1, max_len=args.max_len, prefill_chunk=args.prefill_chunk)
        gen.check_fits(len(ids), args.max_new_tokens)
    except (ConfigError, CheckpointMismatchError, ContextTooLongError, FileNotFoundError, ValueError) as e:
        return fail(str(e))

    stop = eos_id(tok)
    if not args.quiet:
        mode = (f"speculative, K={gen.num_draft}, KVShare {'on' if gen.kv_share else 'off'}"
                if isinstance(gen, SpeculativeGenerator) else "plain")
        print(f"model {model.cfg.name} from {args.checkpoint}; prompt {len(ids)} tokens; {mode} decoding",
              file=sys.stderr)
    print(prompt, end="", flush=True)
    if isinstance(gen, SpeculativeGenerator):
        return _speculative(gen, tok, ids, stop, args)
    new: list[int] = []
    printed = ""
    t0 = time.perf_counter()
    for block in gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed, stop_token=stop, progress=print_progress):
        for t in block[0].tolist():
            if t == stop:
                break
            new.append(t)
        else:
            text = tok.decode(new)
            print(text[len(printed):], end="", flush=True)
            printed = text
            continue
        break
    text = tok.decode(new)
    print(text[len(printed):], flush=True)
    s = gen.stats
    if not args.quiet:
        decode_s = s.get("decode_s", time.perf_counter() - t0)
        print(f"\n[prefill {s['prompt_tokens']} tokens in {s['prefill_s']:.2f}s; decoded {len(new)} tokens "
              f"in {decode_s:.2f}s = {len(new) / max(decode_s, 1e-9):.1f} tokens/s (first block includes "
              f"compilation)]", file=sys.stderr)
    return 0


def _speculative(gen, tok, ids, stop, args) -> int:
    """Speculative decoding runs as one jitted loop: print the text and the acceptance statistics."""
    from glm_jax.decoding.generate import print_progress

    out = gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, seed=args.seed, stop_token=stop, progress=print_progress)[0]
    new = []
    for t in out.tolist():
        if t < 0 or t == stop:
            break
        new.append(t)
    print(tok.decode(new), flush=True)
    s = gen.stats
    if not args.quiet:
        rates = " ".join(f"{r:.2f}" for r in s.acceptance_rate)
        print(f"\n[prefill {len(ids)} tokens in {s.prefill_s:.2f}s; decoded {len(new)} tokens in "
              f"{s.decode_s:.2f}s = {len(new) / max(s.decode_s, 1e-9):.1f} tokens/s (includes compilation); "
              f"acceptance length {s.acceptance_length:.2f} over {s.verify_steps} verify steps; "
              f"acceptance rate per draft position: {rates}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
