"""Write long documents for long-context training: each package of a source tree as one
document (its .py files concatenated in path order, each after a `# file: PATH` line), as
repository-level code data is built. Single-file modules are left out.

    python3 scripts/long_documents.py --out runs/long_docs.jsonl              # the standard library
    python3 scripts/long_documents.py --root ~/src --min-chars 100000 --out docs.jsonl
    python3 scripts/long_documents.py --root "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        --out train.jsonl --heldout-packages 2 --heldout-min-chars 400000 --heldout-out heldout.jsonl
                                                 # the venv's site-packages, whatever its Python version

The output is JSON lines ({"text": ...}) for `train.py --data`. With --root omitted the tree is
the running interpreter's standard library (`glm_jax.data.corpus`: no tests or site-packages),
so every machine can build it; a 128K-token row then holds one to a few documents.

--recall-every CHARS inserts recall pairs into the training documents (`with_recall_pairs`): a
made-up constant defined and used again up to a whole document later, with names and a
template of their own (the retrieval probe's never appear in training).

--heldout-packages N moves N whole packages into --heldout-out (for `train.py --heldout-data`
and benchmarks/long_context_eval.py): those of at least --heldout-min-chars characters whose
names hash lowest (`heldout_names`), so the choice does not depend on the other packages or on
the order of the tree, and no held-out package has a file in the training documents.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np

from glm_jax.data import corpus


def package_documents(root: Path, files: list[Path], min_chars: int, max_chars: int) -> list[tuple[str, str]]:
    """-> [(package name, text)] for the top-level directories under root, in name order; a
    package's files after its first max_chars characters are left out."""
    packages: dict[str, list[Path]] = {}
    for path in files:
        rel = path.relative_to(root)
        if len(rel.parts) > 1:
            packages.setdefault(rel.parts[0], []).append(path)
    docs = []
    for name in sorted(packages):
        parts, size = [], 0
        for p in sorted(packages[name]):
            if size >= max_chars:
                break
            parts.append(f"# file: {p.relative_to(root).as_posix()}\n{p.read_text(encoding='utf-8')}\n")
            size += len(parts[-1])
        text = "".join(parts)
        if len(text) >= min_chars:
            docs.append((name, text))
    return docs


# Recall pairs: made-up constants from a word list and a template of their own, disjoint from
# benchmarks/long_context_eval.py's probe (its `def NAME(v):` and `result = NAME(`), so that the
# probe measures a learned skill carried over, not its own task seen in training.
_RECALL_WORDS = ("amber", "birch", "canyon", "delta", "fjord", "garnet", "heron", "indigo", "juniper", "kestrel",
                 "lumen", "meadow", "nimbus", "onyx", "prism", "quill", "russet", "sierra", "tundra", "umber")
RECALL_DEFINITION = "{} = {}\n"
RECALL_USE = "check({})\n"


def recall_name(rng: np.random.Generator) -> str:
    a, b = rng.choice(len(_RECALL_WORDS), 2, replace=False)
    return f"{_RECALL_WORDS[a].upper()}_{_RECALL_WORDS[b].upper()}_{rng.integers(16 ** 4):04X}"


def with_recall_pairs(text: str, every: int, rng: np.random.Generator, min_gap: int = 2000) -> str:
    """`text` with about len(text) / every recall pairs inserted at line starts: a made-up
    constant defined (`NAME = 123`) and used again (`check(NAME)`) a log-uniform 2K to
    len(text) characters later, the long-range copying that natural code holds too rarely.
    Every pair's name is new, so only the definition tells the name's rest."""
    starts = np.flatnonzero(np.frombuffer(text.encode("utf-32-le"), np.uint32) == ord("\n")) + 1
    count = len(text) // every
    if count == 0 or len(starts) < 2 or len(text) < 2 * min_gap:
        return text
    inserts: list[tuple[int, str]] = []
    for _ in range(count):
        gap = math.exp(rng.uniform(math.log(min_gap), math.log(len(text) - min_gap)))
        first = int(rng.integers(0, max(len(text) - int(gap), 1)))
        a, b = np.searchsorted(starts, [first, first + gap])
        if b >= len(starts) or a >= b:
            continue
        name = recall_name(rng)
        inserts += [(int(starts[a]), RECALL_DEFINITION.format(name, int(rng.integers(1000)))),
                    (int(starts[b]), RECALL_USE.format(name))]
    pieces, last = [], 0
    for at, line in sorted(inserts, key=lambda x: x[0]):
        pieces += [text[last:at], line]
        last = at
    return "".join(pieces) + text[last:]


def heldout_names(docs: list[tuple[str, str]], count: int, min_chars: int) -> set[str]:
    """The names of the `count` packages of at least `min_chars` characters whose sha256 is lowest."""
    long_enough = [name for name, text in docs if len(text) >= min_chars]
    return set(sorted(long_enough, key=lambda name: hashlib.sha256(name.encode()).hexdigest())[:count])


def write_jsonl(path: str | Path, docs: list[tuple[str, str]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _, text in docs:
            f.write(json.dumps({"text": text}) + "\n")


def summary(docs: list[tuple[str, str]]) -> str:
    sizes = sorted(len(t) for _, t in docs)
    return f"{len(docs)} documents: {sum(sizes):,} characters, median {sizes[len(sizes) // 2]:,}, largest {sizes[-1]:,}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON-lines file to write")
    ap.add_argument("--root", default=None, help="source tree (default: the standard library)")
    ap.add_argument("--min-chars", type=int, default=20_000, help="leave out packages shorter than this")
    ap.add_argument("--max-chars", type=int, default=2_000_000, help="end a package's document after this")
    ap.add_argument("--heldout-packages", type=int, default=0, metavar="N",
                    help="write N whole packages to --heldout-out instead of --out")
    ap.add_argument("--heldout-min-chars", type=int, default=None, metavar="N",
                    help="held-out packages have at least N characters (default: --min-chars)")
    ap.add_argument("--heldout-out", default=None, help="the JSON-lines file of the held-out packages")
    ap.add_argument("--recall-every", type=int, default=0, metavar="CHARS",
                    help="insert a recall pair (a made-up constant defined, then used 2K characters to a whole "
                         "document later) for every CHARS characters of each training document (default 0: none; "
                         "held-out documents never get any)")
    ap.add_argument("--seed", type=int, default=0, help="the recall pairs' random draws")
    args = ap.parse_args(argv)
    if args.recall_every < 0:
        print("error: --recall-every takes a number of characters >= 1 (0: no recall pairs)", file=sys.stderr)
        return 2
    if args.heldout_packages < 0 or bool(args.heldout_packages) != bool(args.heldout_out):
        print("error: --heldout-packages N (N >= 1) and --heldout-out FILE go together", file=sys.stderr)
        return 2
    root = Path(args.root).expanduser() if args.root else corpus.stdlib_root()
    try:
        files = corpus.stdlib_source_files(root)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    docs = package_documents(root, files, args.min_chars, args.max_chars)
    if not docs:
        print(f"error: no package under {root} has {args.min_chars} characters of Python", file=sys.stderr)
        return 2
    held = heldout_names(docs, args.heldout_packages, args.heldout_min_chars or args.min_chars)
    if len(held) < args.heldout_packages or len(held) == len(docs) and held:
        print(f"error: {len(held)} of the {len(docs)} packages under {root} have {args.heldout_min_chars or args.min_chars} "
              f"characters, for {args.heldout_packages} held-out packages and training documents besides; lower "
              "--heldout-min-chars or --heldout-packages", file=sys.stderr)
        return 2
    train_docs = [d for d in docs if d[0] not in held]
    if args.recall_every:
        rng = np.random.default_rng(args.seed)
        train_docs = [(name, with_recall_pairs(text, args.recall_every, rng)) for name, text in train_docs]
    write_jsonl(args.out, train_docs)
    print(f"training: {summary(train_docs)} from {root} -> {args.out}")
    if held:
        heldout = [d for d in docs if d[0] in held]
        write_jsonl(args.heldout_out, heldout)
        print(f"held out: {summary(heldout)} ({', '.join(sorted(held))}) -> {args.heldout_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
