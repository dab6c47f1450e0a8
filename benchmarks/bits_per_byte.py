"""A trained model's compression of held-out Python source in bits per byte, beside gzip -9 and xz -9e.

    PYTHONPATH=. python3 benchmarks/bits_per_byte.py --model checkpoints/default --max-bytes 300000
    PYTHONPATH=. python3 benchmarks/bits_per_byte.py --model runs/default-py \
        --heldout-jsonl runs/pycorpus/heldout.jsonl --json bits_per_byte.json
    PYTHONPATH=. python3 benchmarks/bits_per_byte.py --context 256 --stride 128    # overlapping windows

Files: the `{"text", "package", "path"}` lines of --heldout-jsonl (what
scripts/build_python_corpus.py writes), or else the held-out packages of --site-packages (default:
this interpreter's site-packages) exactly as that script selects them (its `build`, run into a
temporary directory: same split, skips and de-duplication against the training packages). Files
are taken sorted by package, then path, until --max-files or --max-bytes is reached (the file
that crosses --max-bytes is included).

Bytes are the UTF-8 bytes of each file's text. Each file is compressed on its own by every
measure, and a total is sum(compressed bits) / sum(bytes); each compressor also runs once over
all the files joined (", files joined": it may copy from earlier files, which the model, seeing
one file at a time, cannot):

  gzip -9   8 * len(gzip.compress(data, 9)): the gzip container included (18 bytes a file)
  xz -9e    8 * len(lzma.compress(data, preset=9 | PRESET_EXTREME)): the .xz container
            included (about 60 bytes a file)
  model     the code length of an arithmetic coder driven by the model, -sum log2 p(token):
            each file is tokenized as train.py's pipeline tokenizes a document
            (`pipeline.token_encoder`: the text's ids, then the end-of-text token, no
            start token), and every token after the first is scored with the model's
            next-token log-probabilities (log_softmax in float32 over the logits). The first
            token has no context to be predicted from: it is charged log2(vocab_size) bits
            (a uniform code). The end-of-text token is scored like the others; it is what tells
            the decoder where the file ends, as the compressors' containers do. The tokenizer
            is a byte-level BPE with decode(encode(text)) == text, so these bits code the bytes.

Windows: with the default --stride (= --context) a file's ids are cut into non-overlapping
windows of --context tokens, each run from position 0 and all of its targets scored, which is
how train.py cuts a document into training pieces (`pipeline.split_pieces`). Tokens near a
window's start see less context than the file offers, so this slightly overstates the bits.
With --stride S < --context, window j starts at token j * S and scores only the targets that
no earlier window scored (the last S of a full window): every token sees at least
context - S tokens of context, for context / S times the compute. Either way every token after
the first is scored exactly once (`plan_windows`). The default --context is the config's
max_position_embeddings; a model trained on shorter rows predicts worse past its training
length, so give such a model its train.py --seq-len (checkpoints/default was trained at 4096, its maximum).

The forward pass is set up as train.py's held-out evaluation (`training.step.eval_step`) sets up
its own, but keeps every target's log-probability instead of the mean loss:
sparse attention over the indexer's top-k, as the model is used, in the absorbed form (the
default of --attention-form). Windows are run --batch-size at a time, jitted; a short window
is padded at its end, which no real position attends (attention is causal), and the padding's
targets are left out of the sums.

Prints a markdown table (bits per byte, and each measure's ratio to gzip -9) and the counts;
--json writes them with every file's numbers. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib.util
import json
import lzma
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks._report import write_json

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MAX_BYTES = 2_000_000
MEASURES = ("gzip -9", "xz -9e")
#: Suffix of a compressor's measure over all the files joined into one stream: it can copy from
#: earlier files (shared licence headers, vendored near-copies), which the model, scoring each
#: file alone, cannot; shown for reference, the comparison is file by file.
JOINED = ", files joined"


class Document(NamedTuple):
    package: str
    path: str
    text: str


# ---------------------------------------------------------------------- files
def corpus_script():
    """scripts/build_python_corpus.py as a module."""
    spec = importlib.util.spec_from_file_location("build_python_corpus", ROOT / "scripts" / "build_python_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_heldout_jsonl(path: str | Path) -> list[Document]:
    """The documents of a JSON-lines file of {"text", "package", "path"} objects (package and
    path may be missing: "" and the line number)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"held-out file {path} not found (scripts/build_python_corpus.py --out DIR "
                                "writes DIR/heldout.jsonl)")
    docs = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                record = json.loads(line)
                docs.append(Document(str(record.get("package", "")), str(record.get("path", i)), record["text"]))
    return docs


def site_packages_heldout(roots: list[Path] | None = None, *, heldout_fraction: float = 0.05,
                          seed: int = 0) -> list[Document]:
    """The held-out documents that scripts/build_python_corpus.py selects from `roots` (default:
    this interpreter's site-packages) with the same fraction and seed."""
    script = corpus_script()
    with tempfile.TemporaryDirectory() as tmp:
        script.build(roots or script.default_roots(), Path(tmp), heldout_fraction=heldout_fraction, seed=seed,
                     max_file_bytes=script.MAX_FILE_BYTES)
        return read_heldout_jsonl(Path(tmp) / "heldout.jsonl")


def select_documents(docs: list[Document], *, max_files: int | None = None,
                     max_bytes: int | None = DEFAULT_MAX_BYTES) -> list[Document]:
    """docs sorted by (package, path), without empty texts, taken in that order until max_files
    files or max_bytes UTF-8 bytes (the file that reaches max_bytes is included; None or 0: no
    limit)."""
    chosen, total = [], 0
    for doc in sorted((d for d in docs if d.text), key=lambda d: (d.package, d.path)):
        if (max_files and len(chosen) >= max_files) or (max_bytes and total >= max_bytes):
            break
        chosen.append(doc)
        total += len(doc.text.encode("utf-8"))
    return chosen


# ---------------------------------------------------------------------- compressors
def gzip_bits(data: bytes) -> int:
    """Bits of `gzip -9` (the container included)."""
    return 8 * len(gzip.compress(data, 9, mtime=0))


def xz_bits(data: bytes) -> int:
    """Bits of `xz -9e` (the .xz container included)."""
    return 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))


COMPRESSORS: dict[str, Callable[[bytes], int]] = {"gzip -9": gzip_bits, "xz -9e": xz_bits}


# ---------------------------------------------------------------------- model
class Window(NamedTuple):
    """Inputs ids[start : start + length] and targets ids[start + 1 : start + length + 1] of one
    document; the targets at offsets first_scored .. length - 1 are scored."""

    doc: int
    start: int
    length: int
    first_scored: int


def plan_windows(num_ids: int, context: int, stride: int | None = None, doc: int = 0) -> list[Window]:
    """The windows of a document of num_ids ids: window j starts at j * stride (default:
    context, non-overlapping), is at most `context` inputs long and scores the targets no earlier
    window scored. Every target index 1 .. num_ids - 1 is scored exactly once (none if
    num_ids < 2)."""
    stride = context if stride is None else stride
    if not 1 <= stride <= context:
        raise ValueError(f"the stride must be in 1..context ({context}), got {stride}")
    windows, start, done = [], 0, 0          # done: targets 1..done are scored
    last = num_ids - 1                       # the last id is never an input
    while done < last:
        length = min(context, last - start)
        windows.append(Window(doc, start, length, done - start))
        done, start = start + length, start + stride
    return windows


@functools.partial(jax.jit, static_argnames=("graphdef", "options"))
def target_logprobs(graphdef, state, inputs, targets, *, options):
    """inputs, targets int32 [B, S] (windows from position 0) -> float32 [B, S]: the natural log
    of the model's probability of each target (log_softmax in float32 over the logits)."""
    model = nnx.merge(graphdef, state)
    logits = model(inputs, options=options).logits.astype(jnp.float32)       # [B, S, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def window_rows(ids_list: list[np.ndarray], windows: list[Window], rows: int, width: int):
    """windows (at most `rows`) -> (inputs int32 [rows, width], targets int32 [rows, width],
    scored bool [rows, width]); padding (short windows, missing rows) is token 0, never scored."""
    inputs = np.zeros((rows, width), np.int32)
    targets = np.zeros((rows, width), np.int32)
    scored = np.zeros((rows, width), bool)
    for r, w in enumerate(windows):
        ids = ids_list[w.doc]
        inputs[r, :w.length] = ids[w.start:w.start + w.length]
        targets[r, :w.length] = ids[w.start + 1:w.start + w.length + 1]
        scored[r, w.first_scored:w.length] = True
    return inputs, targets, scored


def score_documents(model, ids_list: list[np.ndarray], *, context: int, stride: int | None = None,
                    batch_size: int = 8, options=None, progress: Callable[[int, int, int], None] | None = None):
    """ids_list: each document's int32 ids [n_i] -> (bits float64 [D]: -sum log2 p of the
    targets 1 .. n_i - 1, scored int64 [D]: how many). The first id of each is not included.

    options: the ForwardOptions (default: sparse, absorbed, as the held-out evaluation).
    progress(windows done, windows, documents done) after each batch."""
    from glm_jax.forward_options import ForwardOptions

    options = options or ForwardOptions(mode="sparse", form="absorbed")
    windows = [w for d, ids in enumerate(ids_list) for w in plan_windows(len(ids), context, stride, d)]
    bits = np.zeros(len(ids_list), np.float64)
    scored = np.zeros(len(ids_list), np.int64)
    if not windows:
        return bits, scored
    last_window = {w.doc: i for i, w in enumerate(windows)}
    rows = min(batch_size, len(windows))
    width = max(w.length for w in windows)                 # = context unless every document is shorter
    graphdef, state = nnx.split(model)
    for b in range(0, len(windows), rows):
        chunk = windows[b:b + rows]
        inputs, targets, mask = window_rows(ids_list, chunk, rows, width)
        logp = np.asarray(target_logprobs(graphdef, state, jnp.asarray(inputs), jnp.asarray(targets),
                                          options=options), np.float64)
        row_bits = -np.where(mask, logp, 0.0).sum(axis=1) / math.log(2)
        for r, w in enumerate(chunk):
            bits[w.doc] += row_bits[r]
            scored[w.doc] += int(mask[r].sum())
        if progress is not None:
            end = b + len(chunk) - 1
            done = windows[end].doc + (last_window[windows[end].doc] == end)
            progress(end + 1, len(windows), done)
    return bits, scored


# ---------------------------------------------------------------------- the measurement
def measure(model, tok, docs: list[Document], *, context: int | None = None, stride: int | None = None,
            batch_size: int = 8, options=None, log=None) -> dict:
    """The bits of `docs` under the model and each compressor -> the result dict (see --json):
    totals, per-measure bits and bits/byte, every file's numbers. log: a text stream for
    progress lines (None: quiet)."""
    from glm_jax.data.pipeline import token_encoder
    from glm_jax.model import count_params

    if not docs:
        raise ValueError("no held-out files to measure")
    cfg = model.cfg
    context = context or cfg.max_position_embeddings
    if not 2 <= context <= cfg.max_position_embeddings:
        raise ValueError(f"--context must be in 2..{cfg.max_position_embeddings} (the model's "
                         f"max_position_embeddings), got {context}")
    stride = stride or context
    data = [d.text.encode("utf-8") for d in docs]
    encode = token_encoder(tok)
    ids_list = [encode(d.text) for d in docs]
    first_bits = math.log2(cfg.vocab_size)
    cumulative = np.cumsum([len(x) for x in data])
    t0 = time.perf_counter()
    last_print = [t0]

    def progress(windows_done: int, windows: int, docs_done: int) -> None:
        now = time.perf_counter()
        if log is not None and (now - last_print[0] >= 5 or windows_done == windows):
            last_print[0] = now
            done_bytes = int(cumulative[docs_done - 1]) if docs_done else 0
            print(f"  {docs_done}/{len(docs)} files, {done_bytes:,}/{int(cumulative[-1]):,} bytes, "
                  f"{windows_done}/{windows} windows, {now - t0:.0f} s", file=log, flush=True)

    scored_bits, scored = score_documents(model, ids_list, context=context, stride=stride, batch_size=batch_size,
                                          options=options, progress=progress)
    model_seconds = time.perf_counter() - t0
    files = []
    for doc, raw, ids, bits, n in zip(docs, data, ids_list, scored_bits, scored):
        row = {"package": doc.package, "path": doc.path, "bytes": len(raw), "tokens": int(ids.size),
               "scored_tokens": int(n), "first_token_bits": first_bits, "model_bits": float(bits) + first_bits}
        row.update({name: fn(raw) for name, fn in COMPRESSORS.items()})
        files.append(row)
    total_bytes = sum(f["bytes"] for f in files)
    total_tokens = sum(f["tokens"] for f in files)
    model_bits = sum(f["model_bits"] for f in files)
    measures = {"model": {"bits": model_bits, "bits_per_byte": model_bits / total_bytes,
                          "bits_per_token": model_bits / total_tokens, "tokens_per_byte": total_tokens / total_bytes}}
    for name, fn in COMPRESSORS.items():
        bits = sum(f[name] for f in files)
        measures[name] = {"bits": bits, "bits_per_byte": bits / total_bytes}
        joined = fn(b"".join(data))
        measures[name + JOINED] = {"bits": joined, "bits_per_byte": joined / total_bytes}
    form = (options.form if options is not None else "absorbed")
    return {"model": {"name": cfg.name, "params": count_params(model), "vocab_size": cfg.vocab_size,
                      "context": context, "stride": stride, "attention": f"sparse, {form}",
                      "dtype": str(jax.tree.leaves(nnx.state(model))[0].dtype)},
            "files": len(files), "packages": sorted({f["package"] for f in files}), "bytes": total_bytes,
            "tokens": total_tokens, "scored_tokens": sum(f["scored_tokens"] for f in files),
            "measures": measures, "model_seconds": model_seconds,
            "scored_tokens_per_s": sum(f["scored_tokens"] for f in files) / max(model_seconds, 1e-9),
            "per_file": files}


def format_table(result: dict) -> str:
    """The result as a markdown table of bits per byte and the ratio to gzip -9, then the counts."""
    m, gz = result["model"], result["measures"]["gzip -9"]["bits_per_byte"]
    names = {"model": f"model {m['name']} ({m['params']:,} params)", **{k: k for k in MEASURES},
             **{k + JOINED: k + JOINED + " (sees other files)" for k in MEASURES}}
    lines = ["| measure | bits/byte | vs gzip -9 |", "|---|---|---|"]
    for key, label in names.items():
        bpb = result["measures"][key]["bits_per_byte"]
        lines.append(f"| {label} | {bpb:.3f} | {bpb / gz:.3f} |")
    model = result["measures"]["model"]
    lines += ["",
              f"files: {result['files']:,}, bytes: {result['bytes']:,}, tokens: {result['tokens']:,} "
              f"(each file's text and its end-of-text token), packages: {len(result['packages'])} "
              f"({', '.join(result['packages'])})",
              f"model: {model['bits_per_token']:.3f} bits/token, {model['tokens_per_byte']:.3f} tokens/byte; "
              f"context {m['context']}, stride {m['stride']}, {m['attention']} attention, {m['dtype']}; "
              f"first token of each file charged log2({m['vocab_size']}) = {math.log2(m['vocab_size']):.1f} bits; "
              f"forward passes {result['model_seconds']:.1f} s (compilation included)"]
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def main(argv=None) -> int:
    from glm_jax.frontends import cli
    from glm_jax.checkpoint import load_model_dir
    from glm_jax.data.tokenizer import load_tokenizer
    from glm_jax.forward_options import ForwardOptions
    from glm_jax.training.step import attention_form

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/default", help="a model directory (train.py's output)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--heldout-jsonl", default=None, metavar="PATH",
                     help="held-out documents, JSON lines of {text, package, path}")
    src.add_argument("--site-packages", nargs="+", type=Path, default=None, metavar="DIR",
                     help="select the held-out packages of these directories as scripts/build_python_corpus.py "
                          "does (the default, with this interpreter's site-packages)")
    ap.add_argument("--heldout-fraction", type=float, default=0.05, help="as build_python_corpus.py's")
    ap.add_argument("--seed", type=int, default=0, help="as build_python_corpus.py's")
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                    help="stop adding files once this many bytes are taken (0: no limit)")
    ap.add_argument("--context", type=int, default=None, help="tokens per window (default: max_position_embeddings)")
    ap.add_argument("--stride", type=int, default=None,
                    help="window starts this far apart, scoring only its new targets (default: --context)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    ap.add_argument("--attention-form", default="absorbed", choices=["auto", "expanded", "absorbed"],
                    help="sparse attention's form (training.step.attention_form); the held-out evaluation's: absorbed")
    ap.add_argument("--dtype", default=None, help="compute dtype in place of the model's config")
    cli.add_kernel_flags(ap)
    ap.add_argument("--json", default=None, metavar="OUT", help="write the numbers and every file's to OUT")
    args = ap.parse_args(argv)

    try:
        model_dir = Path(args.model)
        if not (model_dir / "config.yaml").is_file():
            raise FileNotFoundError(f"model directory {model_dir} not found or without config.yaml "
                                    "(train.py writes one; checkpoints/default ships with the project)")
        if args.heldout_jsonl:
            docs = read_heldout_jsonl(args.heldout_jsonl)
            where = args.heldout_jsonl
        else:
            roots = args.site_packages or corpus_script().default_roots()
            docs = site_packages_heldout(roots, heldout_fraction=args.heldout_fraction, seed=args.seed)
            where = "the held-out packages of " + ", ".join(map(str, roots))
        docs = select_documents(docs, max_files=args.max_files, max_bytes=args.max_bytes)
        if not docs:
            raise ValueError(f"no held-out files in {where}")
        model = load_model_dir(model_dir, dtype=args.dtype)
        tok = load_tokenizer(model_dir)
        context = args.context or model.cfg.max_position_embeddings
        options = ForwardOptions(mode="sparse", form=attention_form(args.attention_form, context),
                                 kernels=cli.kernel_choice(args))
        print(f"{len(docs):,} files from {where}; model {model_dir} ({model.cfg.name}), context {context}",
              file=sys.stderr)
        result = measure(model, tok, docs, context=context, stride=args.stride, batch_size=args.batch_size,
                         options=options, log=sys.stderr)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["model"]["dir"] = str(model_dir)
    print(format_table(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
