"""decode.py --max-batch N: the prompts run as concurrent requests of the serving engine, and
the greedy text does not depend on how many share a batch."""

from __future__ import annotations

import json

import decode


def test_max_batch_greedy_output_equals_one_at_a_time(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in
                                 ["def f(x):", "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):",
                                  "x = [1, 2,"]) + "\n")
    outputs = {}
    for n in (3, 1):
        out = tmp_path / f"out{n}.jsonl"
        assert decode.main(["--prompts-file", str(prompts), "--max-batch", str(n), "--temperature", "0",
                            "--max-new-tokens", "12", "--prefill-chunk", "16", "--max-len", "96", "--quiet",
                            "--output", str(out)]) == 0
        outputs[n] = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(outputs[3]) == 3 and all(row["completion"] for row in outputs[3])
    assert outputs[3] == outputs[1]
