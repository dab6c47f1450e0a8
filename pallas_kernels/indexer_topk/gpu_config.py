"""The tuning of the GPU indexer kernels (`IndexerGpuConfig`) and the score kernel's tiling
(`ScoreTiling`, `score_tiling`), shared by the score kernel (`gpu_scores`), the selection
(`gpu`) and the fused prefill top-k (`gpu_fused`)."""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_positive_fields

#: Key tiles per score program.
TILES_PER_PROGRAM = 16
#: Scores per count / compaction program, and per loop step inside it (one step: many small
#: programs hide memory latency better than few looping ones).
CHUNK = 2048
BLOCK = 2048


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def kernel_params(num_warps: int, num_stages: int = 1):
    """The Triton compiler parameters of one kernel."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@dataclasses.dataclass(frozen=True)
class ScoreTiling:
    """How the score kernel tiles its work (see `gpu_scores`)."""
    block_q: int        # queries per program
    block_t: int        # keys per matmul
    num_warps: int
    keys_major: bool    # matmul as [keys, queries x heads]: the head sum stays inside a warp


def score_tiling(seq_len: int, heads: int) -> ScoreTiling:
    """Decode (<= 8 queries): all queries per program, [queries x heads, keys] matmuls, 4 warps
    (memory-bound: about copy bandwidth on an H200). Prefill: up to 8 queries (at most 256
    query-head columns), keys-major matmuls over 64 keys, 8 warps (compute-bound)."""
    if seq_len <= 8:
        return ScoreTiling(next_pow2(seq_len), 128, 4, False)
    hp = max(16, next_pow2(heads))
    return ScoreTiling(max(1, min(8, 256 // hp)), 64, 8, True)


@dataclasses.dataclass(frozen=True)
class IndexerGpuConfig:
    """Tuning of the GPU indexer kernels (`impl="pallas_gpu"`); None: chosen from the shapes.

    block_q, block_t, num_warps, keys_major: the score kernel's `ScoreTiling` (defaults:
      `score_tiling`; block sizes are powers of two).
    tiles_per_program: key tiles per score program.  num_stages: its software pipelining.
    chunk: scores per count / compaction program (a power of two; default CHUNK, or the row
      rounded up to a power of two >= 16 when that is shorter).  block: scores per loop step
      inside them.  select_num_warps: their warps.
    q_chunk: queries per top-k chunk and per chunk of the scores' backward (default: as many as
      keep the top-k's scores under `pallas_ops.SCORE_BUDGET_BYTES`).
    fused: the prefill top-k without a scores array (`FusedRows`: the count and compact passes
      compute their scores from q and k); decode and the paged form keep the scores kernel."""

    block_q: int | None = None
    block_t: int | None = None
    num_warps: int | None = None
    keys_major: bool | None = None
    tiles_per_program: int = TILES_PER_PROGRAM
    num_stages: int = 2
    chunk: int | None = None
    block: int = BLOCK
    select_num_warps: int = 4
    q_chunk: int | None = None
    fused: bool = False

    def __post_init__(self):
        check_positive_fields(self)

    def tiling(self, seq_len: int, heads: int) -> ScoreTiling:
        """The score kernel's tiling for [*, seq_len, heads, *] queries: the fields set here
        over `score_tiling`'s defaults."""
        fixed = {f.name: getattr(self, f.name) for f in dataclasses.fields(ScoreTiling)}
        return dataclasses.replace(score_tiling(seq_len, heads),
                                   **{k: v for k, v in fixed.items() if v is not None})
