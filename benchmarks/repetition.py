"""How often decoding degenerates into repetition, per sampling setting: the table decode.py's
default sampling settings are chosen from.

    PYTHONPATH=. python3 benchmarks/repetition.py                      # the default settings, 20 prompts
    PYTHONPATH=. python3 benchmarks/repetition.py --settings greedy t=0.7,top_p=0.9 t=1,min_p=0.05 \
        --json repetition.json

Prompts: the first --prompt-len tokens of the first --prompts held-out documents that have
--prompt-len + --new-tokens tokens (`benchmarks/_heldout.py`: the standard library's held-out
split, which the default model, trained on site-packages, never saw; or --heldout JSON lines
such as scripts/build_python_corpus.py writes). The next --new-tokens tokens of each document,
measured like a completion, make the first row: how often real code trips each measure.

Decoding: the generator decode.py builds for the settings (`builders.build_generator`, so
plain or speculative as decode.py would choose for a batch of --prompts), every prompt in one
batch, --new-tokens new tokens each, cut at the stop token as decode.py cuts them; every
setting with the same --seed, so the run is deterministic and settings differ only by their
sampling. The sampling settings are the program's arguments, so one compiled program serves
them all.

Measures of one completion (its new tokens [n] and their decoded text):
  * repeats a line: some non-blank line, stripped of surrounding white space, occurs more than
    LINE_REPEATS (3) times in the text;
  * max line count: the largest number of times any non-blank stripped line occurs (1: no line
    repeats; 0: no non-blank line);
  * 4-gram loop: some run of NGRAM (4) consecutive tokens occurs more than NGRAM_REPEATS (4)
    times in the tokens (occurrences may overlap). It catches loops without newlines, such as
    `len(len(len(`;
  * loop coverage: the fraction of the n tokens that lie inside at least one occurrence of a
    4-gram that occurs more than NGRAM_REPEATS times (0 when there is no 4-gram loop, near 1
    when the whole completion is one loop);
  * distinct ratio: distinct token ids / n (0 for an empty completion).
Per setting: how many completions repeat a line and how many loop (k of N), the median max line
count, and the mean loop coverage, distinct ratio and number of new tokens.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time

import numpy as np

from benchmarks._heldout import heldout_prompts
from benchmarks._report import Table, device_kind, write_json
from glm_jax.decoding.sampling import SamplingError, SamplingParams
from glm_jax.frontends import cli

#: A completion "repeats a line" when some non-blank stripped line occurs more than this many times.
LINE_REPEATS = 3
#: A completion "loops" when some token NGRAM-gram occurs more than NGRAM_REPEATS times.
NGRAM = 4
NGRAM_REPEATS = 4
#: The default settings: greedy, decode.py's defaults (t=0.7,top_p=0.9), temperatures 0.8-1 with
#: nucleus sampling, plain sampling, and the common top-k 40 and min-p 0.05.
DEFAULT_SETTINGS = ("greedy", "t=0.7,top_p=0.9", "t=0.8,top_p=0.95", "t=0.9,top_p=0.95", "t=1,top_p=0.9",
                    "t=1,top_p=0.95", "t=1", "t=0.8,top_k=40", "t=1,top_k=40", "t=1,min_p=0.05")
#: The names a --settings item may give each field of SamplingParams.
FIELDS = {"t": "temperature", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p"}
REFERENCE = "held-out text (reference)"


# ---------------------------------------------------------------------- settings
def parse_setting(text: str) -> SamplingParams:
    """'greedy', or comma-separated field=value items ('t=0.8,top_p=0.95'; fields t or
    temperature, top_p, top_k, min_p; those not named stay off) -> the SamplingParams, checked."""
    if text.strip() == "greedy":
        return SamplingParams()
    values = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        field = FIELDS.get(name.strip())
        if not sep or field is None:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected 'greedy' or items field=value with fields {', '.join(FIELDS)}, got {item!r}")
        try:
            values[field] = int(value) if field == "top_k" else float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {name.strip()} must be a number, got {value!r}") from None
    try:
        return SamplingParams(**values)
    except SamplingError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def setting_label(params: SamplingParams) -> str:
    """'greedy', or the fields that are not off: 't=0.7,top_p=0.9'."""
    if params.greedy:
        return "greedy"
    off = SamplingParams()
    items = [f"t={params.temperature:g}"] + [f"{name}={getattr(params, name):g}" for name in ("top_p", "top_k", "min_p")
                                            if getattr(params, name) != getattr(off, name)]
    return ",".join(items)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


# ---------------------------------------------------------------------- measures
def line_counts(text: str) -> collections.Counter:
    """How many times each non-blank line of `text`, stripped, occurs."""
    return collections.Counter(line.strip() for line in text.splitlines() if line.strip())


def max_line_count(text: str) -> int:
    """The largest count of any non-blank stripped line (0 when there is none)."""
    return max(line_counts(text).values(), default=0)


def ngram_counts(tokens) -> collections.Counter:
    """tokens int [n] -> how many times each run of NGRAM consecutive tokens occurs (overlapping)."""
    tokens = [int(t) for t in tokens]
    return collections.Counter(tuple(tokens[i:i + NGRAM]) for i in range(len(tokens) - NGRAM + 1))


def loop_coverage(tokens) -> float:
    """tokens int [n] -> the fraction of the n tokens inside some occurrence of an NGRAM-gram that
    occurs more than NGRAM_REPEATS times (0.0 for no tokens)."""
    tokens = [int(t) for t in tokens]
    looping = {gram for gram, count in ngram_counts(tokens).items() if count > NGRAM_REPEATS}
    covered = np.zeros(len(tokens), bool)
    for i in range(len(tokens) - NGRAM + 1):
        if tuple(tokens[i:i + NGRAM]) in looping:
            covered[i:i + NGRAM] = True
    return float(covered.mean()) if len(tokens) else 0.0


def distinct_ratio(tokens) -> float:
    """tokens int [n] -> distinct ids / n (0.0 for no tokens)."""
    return len(set(int(t) for t in tokens)) / len(tokens) if len(tokens) else 0.0


def measure(tokens, text: str) -> dict:
    """One completion (its new tokens int [n] and their text) -> its measures (the module docstring)."""
    counts = line_counts(text)
    line, count = counts.most_common(1)[0] if counts else ("", 0)
    most_grams = ngram_counts(tokens).most_common(1)
    return dict(new_tokens=len(tokens), repeats_line=count > LINE_REPEATS, max_line_count=count,
                most_repeated_line=line, loops=bool(most_grams) and most_grams[0][1] > NGRAM_REPEATS,
                loop_coverage=loop_coverage(tokens), distinct_ratio=distinct_ratio(tokens))


def measure_all(completions, tok) -> list[dict]:
    """Completions (rows of new tokens, int [n] each) -> each one's measures and its text."""
    texts = [tok.decode([int(t) for t in row]) for row in completions]
    return [dict(measure(row, text), text=text) for row, text in zip(completions, texts)]


def summarize(measures: list[dict]) -> dict:
    """The measures of a setting's completions -> its row: counts (k of N), median, means."""
    column = lambda name: np.asarray([m[name] for m in measures], float)  # noqa: E731
    return dict(completions=len(measures), repeats_line=int(column("repeats_line").sum()),
                median_max_line_count=float(np.median(column("max_line_count"))),
                loops=int(column("loops").sum()), mean_loop_coverage=float(column("loop_coverage").mean()),
                mean_distinct_ratio=float(column("distinct_ratio").mean()),
                mean_new_tokens=float(column("new_tokens").mean()))


# ---------------------------------------------------------------------- decoding
def new_tokens(tokens, stop: int | None) -> list[int]:
    """A row of generated tokens int [n] -> those before the stop token or the -1 padding."""
    out = []
    for t in (int(t) for t in tokens):
        if t < 0 or t == stop:
            break
        out.append(t)
    return out


def complete(gen, prompts: np.ndarray, sampling: SamplingParams, *, max_new_tokens: int, seed: int,
             stop: int | None) -> list[list[int]]:
    """prompts int32 [B, P] decoded together by `gen` (a Generator or SpeculativeGenerator for
    batch B) -> each row's new tokens, cut at the stop token."""
    from glm_jax.decoding.speculative import SpeculativeGenerator

    out = gen.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, stop_token=stop)
    if not isinstance(gen, SpeculativeGenerator):
        out = np.concatenate(list(out), axis=1)
    return [new_tokens(row[:max_new_tokens], stop) for row in out]


# ---------------------------------------------------------------------- report
def print_table(rows: list[dict]) -> None:
    n = rows[0]["completions"]
    table = Table("setting", f"repeats a line > {LINE_REPEATS} times (k/{n})", "median max line count",
                  f"{NGRAM}-gram > {NGRAM_REPEATS} times (k/{n})", "tokens in such loops (mean)",
                  "distinct-token ratio (mean)", "new tokens (mean)")
    for r in rows:
        table.row(r["setting"], f"{r['repeats_line']}/{n}", f"{r['median_max_line_count']:g}", f"{r['loops']}/{n}",
                  f"{r['mean_loop_coverage']:.2f}", f"{r['mean_distinct_ratio']:.2f}", f"{r['mean_new_tokens']:.0f}")


@cli.reports_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/default", help="a model directory (train.py's output)")
    ap.add_argument("--heldout", default=None, help="held-out documents, JSON lines (default: the stdlib split)")
    ap.add_argument("--prompts", type=positive_int, default=20, help="held-out documents, one prompt each")
    ap.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens")
    ap.add_argument("--new-tokens", type=positive_int, default=128, help="new tokens per completion")
    ap.add_argument("--settings", type=parse_setting, nargs="+", default=[parse_setting(s) for s in DEFAULT_SETTINGS],
                    metavar="SETTING", help="sampling settings: 'greedy' or items such as t=0.7,top_p=0.9 (fields t, "
                                            "top_p, top_k, min_p; those not named are off); default: "
                                            + " ".join(DEFAULT_SETTINGS))
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed of every setting")
    ap.add_argument("--speculative", type=int, default=None, metavar="K",
                    help="as decode.py's (default: decode.py's choice for a batch of --prompts)")
    ap.add_argument("--json", default=None, help="also write the rows and every completion's measures here")
    args = ap.parse_args(argv)
    cli.choose_platforms()          # before jax starts a backend: no TPU runtime on a host without TPU chips
    labels = [setting_label(s) for s in args.settings]
    if len(set(labels)) < len(labels):
        ap.error(f"--settings names a setting twice: {' '.join(labels)}")

    from glm_jax.checkpoint import load_model_dir
    from glm_jax.data.tokenizer import load_tokenizer, stop_token
    from glm_jax.decoding.builders import build_generator
    from glm_jax.decoding.decode_config import DecodeConfig

    t_start = time.perf_counter()
    with cli.user_errors():
        model = load_model_dir(args.checkpoint)
        if args.prompt_len + args.new_tokens > model.cfg.max_position_embeddings:
            ap.error(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceeds the model's context "
                     f"of {model.cfg.max_position_embeddings} tokens")
        tok = load_tokenizer(args.checkpoint)
        documents = heldout_prompts(tok, args.prompts, args.prompt_len + args.new_tokens, args.heldout)
        decode_settings = DecodeConfig(max_new_tokens=args.new_tokens, seed=args.seed, speculative=args.speculative)
        gen, choice = build_generator(model, decode_settings, batch=args.prompts)
    prompts, continuations = documents[:, :args.prompt_len], documents[:, args.prompt_len:]
    stop = stop_token(model.cfg, tok)
    header = (f"device {device_kind()}; checkpoint {args.checkpoint} ({model.cfg.name}); {args.prompts} held-out prompts "
              f"of {args.prompt_len} tokens, {args.new_tokens} new tokens, seed {args.seed}; {choice.reason}")
    print(header, file=sys.stderr, flush=True)

    reference = measure_all(continuations, tok)
    results = [dict(setting=REFERENCE, **summarize(reference), per_completion=reference)]
    for i, (label, sampling) in enumerate(zip(labels, args.settings), 1):
        t = time.perf_counter()
        completions = complete(gen, prompts, sampling, max_new_tokens=args.new_tokens, seed=args.seed, stop=stop)
        per = measure_all(completions, tok)
        results.append(dict(setting=label, sampling=dataclasses.asdict(sampling), **summarize(per), per_completion=per))
        print(f"[{i}/{len(labels)}] {label}: {sum(map(len, completions))} new tokens in {time.perf_counter() - t:.1f} s; "
              f"{results[-1]['repeats_line']}/{args.prompts} repeat a line ({time.perf_counter() - t_start:.0f} s "
              f"so far)", file=sys.stderr, flush=True)
        write_json(args.json, dict(header=header, checkpoint=args.checkpoint, prompts=args.prompts,
                                   prompt_len=args.prompt_len, new_tokens=args.new_tokens, seed=args.seed,
                                   rows=results))
    print(header)
    print_table(results)
    print(f"{len(labels)} settings x {args.prompts} prompts decoded in {time.perf_counter() - t_start:.0f} s "
          "(loading and compilation included)")
    return 0


if __name__ == "__main__":
    cli.exit_with(main())
