"""When decode.py decodes speculatively by default: only where it measured faster than plain decoding.

`MEASURED` holds, per JAX backend, the speedups of MTP speculative decoding over plain decoding
of the default model (tokens/s of speculative / tokens/s of plain, by batch size and number of
drafts K), with the command and file that produced them. `choose(backend, batch)` picks K (0 =
plain decoding) and says why in one line.

Rule: speculate with the K whose speedup is highest and at least MIN_SPEEDUP at the measured
batch sizes on either side of the batch (the same one when it was measured); a batch above the
largest measured one, or a backend never measured, decodes plainly (the speedup falls as the
batch grows: verification work grows with it).
"""

from __future__ import annotations

import dataclasses

#: Speedup that counts as faster: below it, a difference is within the run-to-run spread.
MIN_SPEEDUP = 1.05


@dataclasses.dataclass(frozen=True)
class Measurement:
    device: str
    source: str                             # the file or table that holds the numbers
    command: str                            # what printed them
    speedup: dict[int, dict[int, float]]    # batch -> {K: speculative / plain tokens/s}


MEASURED = {
    "cpu": Measurement(
        device="CPU, 2 cores (jax 0.12), the default model (default-py)",
        source="docs/data/speculative_cpu.json",
        command="python benchmarks/speculative.py --batch 1 4 16 --draft 1 2 3 --temperature 0.7 "
                "--new-tokens 32 --repeat 5 --json docs/data/speculative_cpu.json",
        speedup={1: {1: 0.91, 2: 0.88, 3: 0.78}, 4: {1: 0.85, 2: 0.69, 3: 0.49}, 16: {1: 0.55, 2: 0.47, 3: 0.32}},
    ),
    "gpu": Measurement(
        device="NVIDIA H200 (jax 0.11.2), the previous default model (tiny); not re-measured since",
        source="docs/speculative.md, the H200 table",
        command="python benchmarks/speculative.py --checkpoint checkpoints/default --batch 1 16 --draft 3 7 "
                "--new-tokens 128",
        speedup={1: {3: 2.70, 7: 1.89}, 16: {3: 1.15, 7: 0.83}},
    ),
}


@dataclasses.dataclass(frozen=True)
class Choice:
    num_draft: int      # drafts per verify step; 0 = plain decoding
    reason: str         # one line


def choose(backend: str, batch: int) -> Choice:
    """The default for `batch` sequences on the JAX `backend` ("cpu", "gpu", "tpu")."""
    m = MEASURED.get(backend)
    if m is None or not m.speedup:
        return Choice(0, f"plain decoding: speculative decoding was not measured on {backend}")
    measured = sorted(m.speedup)
    if batch > measured[-1]:
        return Choice(0, f"plain decoding: batch {batch} is above the largest measured on {backend} "
                         f"({measured[-1]}; {m.source})")
    below = max(b for b in measured if b <= batch) if batch >= measured[0] else measured[0]
    above = min(b for b in measured if b >= batch)
    where = f"batch {below}" if below == above else f"batches {below} and {above}"
    worst = {k: min(m.speedup[below][k], m.speedup[above][k])
             for k in m.speedup[below].keys() & m.speedup[above].keys()}
    best = max(worst, key=worst.get)
    said = f"{worst[best]:.2f}x plain decoding with K={best} at {where} on {m.device} ({m.source})"
    if worst[best] >= MIN_SPEEDUP:
        return Choice(best, f"speculative decoding, K={best}: measured {said}")
    return Choice(0, f"plain decoding: speculative was slower or within {MIN_SPEEDUP - 1:.0%}, at best {said}")
