"""Move a training run between machines in parts of a limited size: its newest checkpoint (what
`train.py --resume` continues) with the files beside it, as numbered parts and a manifest of
their sha256 sums, and back.

    python3 scripts/checkpoint_parts.py pack runs/mid32k parts/ --part-mib 12 [--with-params]
    python3 scripts/checkpoint_parts.py unpack parts/ runs/mid32k
    python train.py ... --out runs/mid32k --resume            # the same flags as the run had

`pack` writes one tar stream of checkpoints/<newest complete step>/, config.yaml,
run_config.yaml, tokenizer.json and metrics.jsonl (with --with-params also the exported params/
and params.files.json, what `decode.py --checkpoint` and `train.py --checkpoint` read), cut into
OUT_DIR/part-00000 ... of at most --part-mib MiB each, and OUT_DIR/manifest.json: every part's
size and sha256, the whole stream's sha256, the step and the files. A run that started from weights
(train.py --checkpoint / --hf-checkpoint) reads them again when it resumes (the MoE routing
biases come from there): move them too, e.g. the previous stage's run packed --with-params. `unpack` checks every sum
before it writes anything, then extracts into RUN_DIR (new or empty). Exit code 2 and one line
on stderr for a part missing, short or changed, a run without a checkpoint, or a RUN_DIR in use.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tarfile
from pathlib import Path

MANIFEST = "manifest.json"
PART = "part-{:05d}"
#: The run directory's files a resume reads besides the checkpoint (those present are packed).
RUN_FILES = ("config.yaml", "run_config.yaml", "tokenizer.json", "metrics.jsonl")
EXPORT_FILES = ("params", "params.files.json")


class PartsError(Exception):
    """A run or a set of parts this script cannot pack or unpack; the message says why."""


def newest_checkpoint(run_dir: Path) -> int:
    """The newest step under run_dir/checkpoints that orbax finished (a plain number: one being
    written has a temporary suffix)."""
    root = run_dir / "checkpoints"
    steps = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    if not steps:
        raise PartsError(f"{run_dir} holds no complete checkpoint (checkpoints/<step>/); train it first")
    return max(steps)


class _PartWriter:
    """A write-only stream that cuts what it is given into files of at most `limit` bytes."""

    def __init__(self, out_dir: Path, limit: int):
        self.out_dir, self.limit = out_dir, limit
        self.parts: list[dict] = []
        self.whole = hashlib.sha256()
        self._file = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self._file is None or self.parts[-1]["bytes"] == self.limit:
                self._open_next()
            n = min(len(view), self.limit - self.parts[-1]["bytes"])
            self._file.write(view[:n])
            self._hash.update(view[:n])
            self.whole.update(view[:n])
            self.parts[-1]["bytes"] += n
            view = view[n:]
        return len(data)

    def _open_next(self) -> None:
        self._finish_part()
        name = PART.format(len(self.parts))
        self._file, self._hash = open(self.out_dir / name, "wb"), hashlib.sha256()
        self.parts.append({"name": name, "bytes": 0})

    def _finish_part(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1]["sha256"] = self._hash.hexdigest()
            self._file = None

    def close(self) -> None:
        self._finish_part()


class _PartReader:
    """A read-only stream of the parts one after another."""

    def __init__(self, paths: list[Path]):
        self.paths = list(paths)
        self._file = None

    def read(self, size: int = -1) -> bytes:
        out = bytearray()
        while size < 0 or len(out) < size:
            if self._file is None:
                if not self.paths:
                    break
                self._file = open(self.paths.pop(0), "rb")
            chunk = self._file.read(-1 if size < 0 else size - len(out))
            if not chunk:
                self._file.close()
                self._file = None
                continue
            out += chunk
        return bytes(out)


def pack(run_dir: Path, out_dir: Path, part_mib: float, with_params: bool = False) -> dict:
    """-> the manifest written to out_dir (see the module's docstring)."""
    if not run_dir.is_dir():
        raise PartsError(f"{run_dir} is not a run directory")
    step = newest_checkpoint(run_dir)
    names = [f"checkpoints/{step}"] + [n for n in RUN_FILES + (EXPORT_FILES if with_params else ())
                                       if (run_dir / n).exists()]
    if with_params and not (run_dir / "params").exists():
        raise PartsError(f"{run_dir} has no exported params/ for --with-params (train.py writes it at the end "
                         "of a run or a --stop-after stop)")
    limit = int(part_mib * 2**20)
    if limit < 1:
        raise PartsError(f"--part-mib {part_mib}: give a positive size")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise PartsError(f"{out_dir} is not empty: give a new directory for the parts")
    writer = _PartWriter(out_dir, limit)
    with tarfile.open(fileobj=writer, mode="w|") as tar:
        for name in names:
            tar.add(run_dir / name, arcname=name)
    writer.close()
    manifest = {"format": 1, "step": step, "files": names, "part_bytes": limit, "parts": writer.parts,
                "sha256": writer.whole.hexdigest(), "bytes": sum(p["bytes"] for p in writer.parts)}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _sha256(path: Path, *more) -> str:
    """The file's sha256; its bytes also go to the hashes `more`."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            for each in (h, *more):
                each.update(block)
    return h.hexdigest()


def verify(parts_dir: Path) -> dict:
    """-> the manifest, once every part is there with its size and sum (PartsError otherwise)."""
    if not (parts_dir / MANIFEST).exists():
        raise PartsError(f"{parts_dir} has no {MANIFEST}: give the directory `pack` wrote")
    manifest = json.loads((parts_dir / MANIFEST).read_text())
    whole = hashlib.sha256()
    for part in manifest["parts"]:
        path = parts_dir / part["name"]
        if not path.exists():
            raise PartsError(f"part {part['name']} is missing from {parts_dir}; copy it again")
        if path.stat().st_size != part["bytes"]:
            raise PartsError(f"part {part['name']} has {path.stat().st_size} bytes, not {part['bytes']}; copy it again")
        if _sha256(path, whole) != part["sha256"]:
            raise PartsError(f"part {part['name']} differs from the packed one (sha256); copy it again")
    if whole.hexdigest() != manifest["sha256"]:
        raise PartsError(f"the parts of {parts_dir} do not make up the packed stream (sha256); pack the run again")
    return manifest


def unpack(parts_dir: Path, run_dir: Path) -> dict:
    """Check the parts, then extract them into run_dir (new or empty) -> the manifest."""
    manifest = verify(parts_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        raise PartsError(f"{run_dir} is not empty: unpack into a new directory (or move this one aside)")
    run_dir.mkdir(parents=True, exist_ok=True)
    reader = _PartReader([parts_dir / p["name"] for p in manifest["parts"]])
    with tarfile.open(fileobj=reader, mode="r|") as tar:
        tar.extractall(run_dir, filter="data")
    return manifest


def _source_of(run_dir: Path) -> str | None:
    """The weights the run started from, as its run_config.yaml names them (None: none)."""
    import yaml

    path = run_dir / "run_config.yaml"
    model = (yaml.safe_load(path.read_text()) or {}).get("model", {}) if path.exists() else {}
    return model.get("checkpoint") or model.get("hf_checkpoint")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="RUN_DIR's newest checkpoint and run files -> parts in OUT_DIR")
    p.add_argument("run_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--part-mib", type=float, default=12, help="the largest part, in MiB (default 12)")
    p.add_argument("--with-params", action="store_true", help="also the exported weights (params/)")
    u = sub.add_parser("unpack", help="check the parts in PARTS_DIR and rebuild the run in RUN_DIR")
    u.add_argument("parts_dir", type=Path)
    u.add_argument("run_dir", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.command == "pack":
            m = pack(args.run_dir, args.out_dir, args.part_mib, args.with_params)
            source = _source_of(args.run_dir)
            if source:
                print(f"note: a resume also reads the weights the run started from, {source}: the other "
                      "machine needs them at that path (or give the resume their new one)")
            print(f"packed step {m['step']} of {args.run_dir} ({m['bytes']:,} bytes: {', '.join(m['files'])}) into "
                  f"{len(m['parts'])} part(s) of at most {args.part_mib:g} MiB in {args.out_dir}")
        else:
            m = unpack(args.parts_dir, args.run_dir)
            print(f"unpacked step {m['step']} into {args.run_dir} ({len(m['parts'])} part(s), sums checked); "
                  f"continue with train.py --out {args.run_dir} --resume and the run's flags")
    except (PartsError, OSError, tarfile.TarError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
