"""benchmarks/_report.py: the markdown table, the JSON file, and a failed part's row naming its
exception (type and the message's last line; the traceback on stderr)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks._report import Table, child_failure, failure, failure_text, write_json
from conftest import ROOT

#: A JAX error raised through jit: JAX filters its frames and notes so after the message.
JIT_ERROR = "import jax, jax.numpy as jnp; jax.jit(lambda x: x.reshape(7))(jnp.ones(3))"


def test_table_prints_header_and_rows(capsys):
    table = Table("part", "ms", "limit ms")
    table.row("matmul", "1.5")
    assert capsys.readouterr().out.splitlines() == ["| part | ms | limit ms |", "|---|---|---|",
                                                    "| matmul | 1.5 |  |"]


def test_write_json(tmp_path):
    write_json(None, {"rows": []})
    write_json(tmp_path / "out.json", {"rows": [{"ms": 1.5, "path": tmp_path}]})
    assert json.loads((tmp_path / "out.json").read_text()) == {"rows": [{"ms": 1.5, "path": str(tmp_path)}]}


def test_failure_text_is_the_type_and_the_last_line():
    assert failure_text(ValueError("while compiling:\n  context\n\nout of memory: 12 GiB\n")) == \
        "ValueError: out of memory: 12 GiB"
    assert failure_text(KeyError()) == "KeyError"


def test_failure_of_a_jax_error_names_it_and_prints_the_traceback(capsys):
    with pytest.raises(TypeError) as caught:
        exec(JIT_ERROR)
    row = failure(caught.value)
    assert row.startswith("TypeError: ") and "reshape" in row and "For simplicity" not in row
    assert "Traceback" in capsys.readouterr().err


def test_child_failure_names_the_exception_past_jaxs_note():
    done = subprocess.run([sys.executable, "-c", JIT_ERROR], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    row = child_failure(done.stderr, done.returncode)
    assert row.startswith("TypeError: ") and "reshape" in row, done.stderr[-2000:]
    assert child_failure("Killed\n", -9) == "exit status -9: Killed"
