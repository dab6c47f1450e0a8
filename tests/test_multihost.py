"""decode.py as several processes on one CPU host: 2 processes of 4 simulated devices each,
joined by jax.distributed (gloo collectives), print the same greedy text as 1 process with 8
devices on the same mesh and as 1 device without a mesh."""

from __future__ import annotations

import json

import pytest

from glm_jax.multihost import DistributedSetup, DistributedSetupError
from multiprocess import finish, gloo_available, launch, launch_processes

PROMPTS = ["import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def push(self, x):"]


def _decode_everywhere(tmp_path, common: list[str], mesh: str) -> dict:
    """The same decode as 1 device and as 2 processes of 4 devices (run at once; one process over
    a mesh of 8 devices against 1 device: tests/test_sharding.py). -> {"1 device",
    "process 0", "process 1"}: (stdout, stderr), plus "output": the --output rows of the
    2-process run."""
    result = tmp_path / "out.jsonl"
    two = launch_processes("decode.py", common + ["--mesh", mesh, "--output", str(result)], processes=2, devices=4)
    procs = {f"process {i}": p for i, p in enumerate(two)}
    procs["1 device"] = launch("decode.py", common, 1)
    runs = {name: finish(p) for name, p in procs.items()}
    runs["output"] = [json.loads(line) for line in result.read_text().splitlines()]
    return runs


@pytest.mark.skipif(not gloo_available(), reason="this jax build has no gloo CPU collectives, so CPU "
                                                  "processes cannot run collectives together")
def test_two_processes_print_the_single_process_text(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    runs = _decode_everywhere(tmp_path, ["--prompts-file", str(prompts), "--temperature", "0",
                                         "--max-new-tokens", "8", "--speculative", "0"], "data=2,layer=4")
    text = runs["process 0"][0]
    assert "===== prompt 1 =====" in text and text.count("\n") > 6
    assert text == runs["1 device"][0]
    assert "mesh data=2,layer=4" in runs["process 0"][1] and "steady state:" in runs["process 0"][1]
    assert runs["process 1"][0].strip() == "" and "steady state:" not in runs["process 1"][1]
    assert [r["prompt"] for r in runs["output"]] == PROMPTS
    assert all(r["completion"] and r["completion"] in text for r in runs["output"])


@pytest.mark.slow
@pytest.mark.skipif(not gloo_available(), reason="this jax build has no gloo CPU collectives")
def test_two_processes_speculative_layer_split_across_processes(tmp_path):
    """decode.py's MTP speculative path, with the KV cache's layers split over the devices of
    both processes."""
    runs = _decode_everywhere(tmp_path, ["--temperature", "0", "--max-new-tokens", "8", "--speculative", "3"],
                              "data=1,layer=8")
    text = runs["process 0"][0]
    assert text.startswith(PROMPTS[0]) and len(text) > len(PROMPTS[0]) + 4
    assert text == runs["1 device"][0]
    assert "speculative" in runs["process 0"][1]


def test_distributed_flags_must_come_together():
    DistributedSetup().check()
    DistributedSetup(coordinator="10.0.0.1:1234", num_processes=2, process_id=1).check()
    with pytest.raises(DistributedSetupError, match="--num-processes given without --coordinator, --process-id"):
        DistributedSetup(num_processes=2).check()
    with pytest.raises(DistributedSetupError, match="HOST:PORT"):
        DistributedSetup(coordinator="10.0.0.1", num_processes=2, process_id=0).check()
    with pytest.raises(DistributedSetupError, match="0..1"):
        DistributedSetup(coordinator="h:1", num_processes=2, process_id=2).check()


def test_decode_refuses_half_given_flags(capsys):
    import decode

    assert decode.main(["--num-processes", "2", "--process-id", "0"]) == 2
    assert "given without --coordinator" in capsys.readouterr().err
