"""The command line of the IndexShare pattern search (`glm_jax.indexcache_search`).

    python -m glm_jax.frontends.indexcache_search --hf-checkpoint DeepSeek-V3.2/ --flips 45 --state search.json
    python -m glm_jax.frontends.indexcache_search --checkpoint runs/tiny --text-file calib.txt --seq-len 256

The last line printed is the pattern as a config value: `index_topk_pattern: FFSS...`.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

from glm_jax.forward_options import ForwardOptions
from glm_jax.frontends import cli
from glm_jax.indexcache_search import calibration_batches, calibration_loss, greedy_search


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Training-free IndexCache search for an IndexShare pattern")
    cli.add_model_flags(ap, required=True)
    ap.add_argument("--text-file", action="append", default=None,
                    help="calibration text (repeatable); default: held-out Python standard library files")
    ap.add_argument("--seq-len", type=int, default=512, help="should exceed index_topk, else sharing changes nothing")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--flips", type=int, default=None,
                    help="layers to turn Shared in total (default: until about 1/4 of the layers stay Full)")
    ap.add_argument("--state", required=True, help="JSON state file; rerun with it to resume")
    ap.add_argument("--dtype", default=None, help="override the compute dtype (e.g. float32)")
    cli.add_kernel_flags(ap)
    return ap.parse_args(argv)


@cli.reports_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    cli.choose_platforms()
    from glm_jax.checkpoint import load_model
    from glm_jax.data import corpus
    from glm_jax.data.tokenizer import load_tokenizer

    source = cli.model_source(args)
    with cli.user_errors():
        model = load_model(source, dtype=args.dtype)
        tok = load_tokenizer(source.path)
        if args.text_file:
            texts = [Path(f).read_text() for f in args.text_file]
        else:
            texts = corpus.read_texts(corpus.split_files(corpus.stdlib_source_files())[1])
        batches = calibration_batches(tok, texts, args.seq_len, args.batch_size, args.batches)
    cfg = model.cfg
    if args.seq_len <= cfg.index_topk:
        print(f"warning: --seq-len {args.seq_len} <= index_topk {cfg.index_topk}: every query attends every "
              "earlier token, so all patterns give the same loss", file=sys.stderr)
    flips = args.flips if args.flips is not None else \
        max(len(cfg.full_layers) - math.ceil(cfg.num_hidden_layers / 4), 0)
    print(f"model {cfg.name}: {cfg.num_hidden_layers} layers, pattern {cfg.pattern}; calibration "
          f"{len(batches)} batch(es) of {args.batch_size} x {args.seq_len} tokens; {flips} flip(s)", flush=True)
    evaluate = functools.partial(calibration_loss, options=ForwardOptions(kernels=cli.kernel_choice(args)))
    with cli.user_errors():     # a --state file of another search
        state = greedy_search(model, batches, flips=flips, state_path=Path(args.state),
                              log=lambda m: print(m, flush=True), evaluate=evaluate)
    pattern = state["steps"][-1]["pattern"] if state["steps"] else cfg.pattern
    cfg.replace(index_topk_pattern=pattern)  # the pattern is a valid config value
    print(f"index_topk_pattern: {pattern}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
