"""Write long documents for long-context training: each package of a source tree as one
document (its .py files concatenated in path order, each after a `# file: PATH` line), as
repository-level code data is built. Single-file modules are left out.

    python3 scripts/long_documents.py --out runs/long_docs.jsonl              # the standard library
    python3 scripts/long_documents.py --root ~/src --min-chars 100000 --out docs.jsonl

The output is JSON lines ({"text": ...}) for `train.py --data`. With --root omitted the tree is
the running interpreter's standard library (`glm_jax.data.corpus`: no tests or site-packages),
so every machine can build it; a 128K-token row then holds one to a few documents.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON-lines file to write")
    ap.add_argument("--root", default=None, help="source tree (default: the standard library)")
    ap.add_argument("--min-chars", type=int, default=20_000, help="leave out packages shorter than this")
    ap.add_argument("--max-chars", type=int, default=2_000_000, help="end a package's document after this")
    args = ap.parse_args(argv)
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for _, text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    sizes = sorted(len(t) for _, t in docs)
    print(f"{len(docs)} documents from {root}: {sum(sizes):,} characters, median {sizes[len(sizes) // 2]:,}, "
          f"largest {sizes[-1]:,} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
