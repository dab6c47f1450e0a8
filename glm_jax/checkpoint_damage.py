"""Damaged checkpoints reported in one line, however slow the machine.

Two layers:
* `write_file_manifest` records, when a model directory's params/ is written, every file's
  size; `check_file_manifest` compares them before anything reads the checkpoint, so a truncated
  or missing file is named before orbax starts a read (no read, no late traceback).
* Where a restore (or a save) fails anyway (a directory written without a manifest, a file
  damaged in place, a training checkpoint, a full disk), the reads and writes orbax still has in
  flight fail later on tensorstore's threads and each prints a traceback ("Exception ignored in:
  <coroutine object _read_array_index_and_device_put ...>") when its coroutine is collected,
  possibly at interpreter exit, and tensorstore's callbacks print tracebacks from their own
  threads. `silence_orbax_leftovers` drops exactly those reports (Python's unraisable hook) and
  the other threads' stderr text (`restoring()` holds that text back during a restore, so none
  escapes before the failure is known), and `orbax_leftovers_seen` tells a front end to end the process without the
  interpreter's final collection (`glm_jax.frontends.cli.exit_with`).
`damage_summary` names the array and the cause of an orbax/tensorstore restore error,
`os_reason` the operating system's reason for a failed write.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from pathlib import Path

from glm_jax.thread_streams import ThreadRoutedStream

#: The file beside params/ that lists params/'s files and their sizes.
MANIFEST_NAME = "params.files.json"


class DamagedFilesError(ValueError):
    """Files of a checkpoint are missing or differ in size from when it was written."""


# ---------------------------------------------------------------------- file manifest
def write_file_manifest(params_dir: str | Path) -> Path:
    """Record every file under params_dir (relative path -> bytes) in MANIFEST_NAME beside it."""
    params_dir = Path(params_dir)
    files = {str(p.relative_to(params_dir)): p.stat().st_size for p in sorted(params_dir.rglob("*")) if p.is_file()}
    path = params_dir.parent / MANIFEST_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": 1, "directory": params_dir.name, "files": files}, indent=0))
    tmp.replace(path)
    return path


def check_file_manifest(params_dir: str | Path) -> bool:
    """Compare params_dir's files with the manifest beside it -> whether there was one to check.

    Raises DamagedFilesError naming the missing and resized files (all of them, shortest
    message first)."""
    params_dir = Path(params_dir)
    path = params_dir.parent / MANIFEST_NAME
    if not path.exists():
        return False
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedFilesError(f"{path} cannot be read ({e}); copy the model directory again") from e
    problems = []
    for name, size in files.items():
        f = params_dir / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != size:
            have = f.stat().st_size
            what = "truncated" if have < size else "longer than written"
            problems.append(f"{name} is {what}: {have:,} bytes, {size:,} when written")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise DamagedFilesError(f"{len(problems)} of its {len(files)} files differ from when it was written: "
                                + "; ".join(problems[:3]) + more)
    return True


# ---------------------------------------------------------------------- failed restores
_orphaned = {"seen": False, "previous_hook": None}


def _is_orphaned_read(unraisable) -> bool:
    """An orbax coroutine that failed after its restore or save had already given up."""
    code = getattr(unraisable.object, "cr_code", None)
    return code is not None and "orbax" in code.co_filename


def _drop_orphaned_reads(unraisable) -> None:
    if not _is_orphaned_read(unraisable):
        (_orphaned["previous_hook"] or sys.__unraisablehook__)(unraisable)


def silence_orbax_leftovers() -> None:
    """Call after a restore or save failed: from now on the late failures of orbax's coroutines are
    not printed (other unraisable exceptions still are), what threads other than the main one
    write to stderr is dropped (tensorstore's callbacks print "Event loop is closed" tracebacks
    from its threads; train.py's loop later routes such output to background.log), and
    `orbax_leftovers_seen()` is True."""
    _orphaned["seen"] = True
    if sys.unraisablehook is not _drop_orphaned_reads:
        _orphaned["previous_hook"] = sys.unraisablehook
        sys.unraisablehook = _drop_orphaned_reads
    if not isinstance(sys.stderr, ThreadRoutedStream):
        sys.stderr = ThreadRoutedStream(sys.stderr, open(os.devnull, "w"))


def orbax_leftovers_seen() -> bool:
    return _orphaned["seen"]


@contextlib.contextmanager
def restoring():
    """Around an orbax restore (the checkpointer's close included): what any thread writes to
    stderr meanwhile is held back. If the block ends normally it is written out then, in order;
    if it raises (the restore failed), it is dropped and `silence_orbax_leftovers` takes over,
    so a read that fails on tensorstore's threads, or an event-loop callback reported while the
    checkpointer closes, prints nothing before the one-line error either. Within another routing
    of stderr (train.py's, or after an earlier failure): a plain block."""
    original = sys.stderr
    if isinstance(original, ThreadRoutedStream):
        yield
        return
    held = sys.stderr = io.StringIO()
    try:
        yield
    except BaseException:
        if sys.stderr is held:
            sys.stderr = ThreadRoutedStream(original, open(os.devnull, "w"))
        silence_orbax_leftovers()
        raise
    if sys.stderr is held:
        sys.stderr = original
    original.write(held.getvalue())


def _chain(error: BaseException, most: int = 16) -> list[BaseException]:
    """The error and the ones it was raised from (cause, else context), outermost first."""
    chain, seen = [], error
    while seen is not None and len(chain) < most:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain


def os_reason(error: BaseException) -> str:
    """The operating system's reason in an orbax/tensorstore error's chain ('File too large',
    'No space left on device': an OSError's, or the code in tensorstore's message), else the
    error's first line."""
    for seen in _chain(error):
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        code = re.search(r"os_error_code='(\d+)'", str(seen))
        if code:
            return os.strerror(int(code.group(1)))
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def damage_summary(error: BaseException) -> str:
    """One line saying which saved array could not be read and why, from an orbax/tensorstore
    restore error (whose text runs to pages of internal detail)."""
    text = "\n".join(str(e) for e in _chain(error))
    item = re.search(r'Error reading "([^"]+)"', text)
    what = f"array {item.group(1).split('/')[0]!r}" if item else "a saved array"
    if re.search(r"byte range .* is not valid for value of size", text):
        why = "its data file is truncated (shorter than when it was written)"
    else:
        first = next((line for line in text.splitlines() if line.strip()), type(error).__name__)
        why = re.sub(r"<bound method [^>]*>|\(?see full tensorstore details.*", "", first, flags=re.I).strip(" :.")
        why = f"{type(error).__name__}: {why[:160]}"
    return f"{what} cannot be read: {why}"
