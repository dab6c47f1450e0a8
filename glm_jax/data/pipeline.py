"""The grain training pipeline: documents -> tokens -> packed rows with segment ids and positions.

    batches = PackedBatches(docs, token_encoder(tok), seq_len=256, batch_size=16, seed=0)
    batch = next(batches)            # Batch of int32 [B, L] arrays
    meta["data"] = batches.state()   # JSON; PackedBatches.from_state(docs, encode, state) continues

    # one process of two: data shard 1 of 2, rows 8..15 of every batch of 16
    mine = PackedBatches(docs, encode, seq_len=256, batch_size=16, shards=2, read=range(1, 2))

Steps (every one deterministic from the seed):
  1. documents shuffled by index (a new permutation each epoch), repeated `epochs` times
     (forever by default);
  2. each document encoded to ids ending with the end-of-text token;
  3. cut into pieces of at most L (input, target) pairs: piece j of a document of n ids holds
     inputs ids[jL : jL+L] and targets ids[jL+1 : jL+L+1], so every id is an input once and
     a target once (the first id is never a target, the last never an input);
  4. pieces packed first-fit into rows of L: segment_ids 1, 2, ... per piece in a row (0 =
     padding), positions restart at 0 in each piece;
  5. rows batched B at a time.
With S data shards, shard i runs steps 2-5 on documents i, i + S, i + 2S, ... of the shuffled
order into B / S rows, and a batch is the shards' rows in shard order: the same batches whichever
processes read which shards. The iterator's state (grain's, JSON, one per shard) is small:
indices into the shuffled document order and the packer's position, so a resume replays the
exact following batches.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from glm_jax.data.batch import Batch
from glm_jax.data.tokenizer import eos_id
from glm_jax.extras import require

grain = require("grain")
Tokenizer = require("tokenizers").Tokenizer

STATE_KIND = "grain-packed"


def token_encoder(tok: Tokenizer) -> Callable[[str], np.ndarray]:
    """text -> int32 ids [n] followed by the end-of-text token."""
    eos = eos_id(tok)

    def encode(text: str) -> np.ndarray:
        return np.asarray(tok.encode(text).ids + [eos], np.int32)

    return encode


def split_pieces(ids: np.ndarray, seq_len: int) -> list[dict[str, np.ndarray]]:
    """ids int32 [n] -> pieces {"inputs": [m], "targets": [m]}, m <= seq_len (none if n < 2)."""
    ids = np.asarray(ids, np.int32)
    last = ids.size - 1  # the final id is never an input
    return [{"inputs": ids[s:min(s + seq_len, last)], "targets": ids[s + 1:min(s + seq_len, last) + 1]}
            for s in range(0, last, seq_len)]


class _EncodeAndSplit(grain.experimental.FlatMapTransform):
    max_fan_out = 1 << 20

    def __init__(self, encode: Callable[[str], np.ndarray], seq_len: int):
        self.encode, self.seq_len = encode, seq_len

    def flat_map(self, text: str):
        return split_pieces(self.encode(text), self.seq_len)


def packed_dataset(documents, encode: Callable[[str], np.ndarray], *, seq_len: int, batch_size: int,
                   seed: int = 0, epochs: int | None = None, drop_remainder: bool = True,
                   packing_bins: int | None = None, shard: int = 0, shards: int = 1) -> grain.IterDataset:
    """The grain dataset of packed batches (dicts of int32 [B, L]: inputs, targets,
    inputs_segment_ids, inputs_positions, ...). documents: len() and [i] -> str.

    shard/shards: only documents shard, shard + shards, ... of the shuffled (repeated) order."""
    if len(documents) < shards:
        raise ValueError(f"{len(documents)} documents cannot feed {shards} data shards" if documents
                         else "no documents to train on")
    ds = grain.MapDataset.source(documents).shuffle(seed=seed)
    ds = ds.repeat(epochs)[shard::shards]
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=16))
    ds = grain.experimental.FlatMapIterDataset(ds, _EncodeAndSplit(encode, seq_len))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"inputs": seq_len, "targets": seq_len},
        num_packing_bins=packing_bins or 4 * batch_size, seed=seed, shuffle_bins=True)
    return ds.batch(batch_size, drop_remainder=drop_remainder)


def _to_batch(d: dict) -> Batch:
    return Batch(d["inputs"], d["targets"], d["inputs_segment_ids"], d["inputs_positions"])


def rows_per_shard(batch_size: int, shards: int) -> int:
    if shards < 1 or batch_size % shards:
        raise ValueError(f"a batch of {batch_size} rows cannot be split into {shards} data shards; "
                         "use a number of data shards that divides the batch size")
    return batch_size // shards


def shards_of_rows(rows: range, batch_size: int, shards: int) -> range:
    """The data shards that supply `rows` of a batch of `batch_size` rows, shard i supplying
    rows i * batch_size / shards onwards (batch_size / shards of them)."""
    per = rows_per_shard(batch_size, shards)
    if rows.start % per or rows.stop % per:
        raise ValueError(f"rows {rows.start}..{rows.stop - 1} of the batch are not whole data shards of "
                         f"{per} rows; use a number of data shards that is a multiple of the processes "
                         "holding different rows")
    return range(rows.start // per, rows.stop // per)


class PackedBatches:
    """Iterator of Batch over `documents`, with a JSON state for checkpoints.

    Batches hold the rows of the data shards in `read` (default: all `shards`), in order:
    int32 [len(read) * batch_size / shards, L]; batch_size is the rows of all shards together."""

    def __init__(self, documents, encode: Callable[[str], np.ndarray], *, seq_len: int, batch_size: int,
                 seed: int = 0, epochs: int | None = None, shards: int = 1, read: range | None = None,
                 iterator_states: dict[str, dict] | None = None):
        self.seq_len, self.batch_size, self.seed, self.epochs = seq_len, batch_size, seed, epochs
        self.shards, self.read = shards, range(shards) if read is None else read
        per = rows_per_shard(batch_size, shards)
        self._its = {i: iter(packed_dataset(documents, encode, seq_len=seq_len, batch_size=per, seed=seed,
                                            epochs=epochs, shard=i, shards=shards)) for i in self.read}
        if iterator_states is not None:
            for i, it in self._its.items():
                it.set_state(iterator_states[str(i)])

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        parts = [_to_batch(next(it)) for it in self._its.values()]
        return Batch(*(np.concatenate(arrays) for arrays in zip(*parts)))

    def state(self) -> dict:
        """JSON: the settings and, per shard read, grain's iterator state ("iterators": {"i": ...})."""
        return {"kind": STATE_KIND, "seq_len": self.seq_len, "batch_size": self.batch_size, "seed": self.seed,
                "epochs": self.epochs, "shards": self.shards,
                "iterators": {str(i): it.get_state() for i, it in self._its.items()}}

    @classmethod
    def from_state(cls, documents, encode, state: dict, *, shards: int | None = None,
                   read: range | None = None) -> "PackedBatches":
        """Continue where `state` (of all the shards in `read`; see merge_states) left off.
        shards: the number this run expects, refused if the state's differs."""
        if state.get("kind") != STATE_KIND:
            raise ValueError("the checkpoint's data state is not a packed-pipeline state (it was written "
                             "by an older train.py); start a new run directory")
        saved = state.get("shards", 1)            # states without shards were written by one reader
        if shards is not None and shards != saved:
            raise ValueError(f"the checkpoint's data position is for {saved} data shards, not {shards}: "
                             f"resume with --data-shards {saved} (by default there is one per process)")
        iterators = state["iterators"] if "iterators" in state else {"0": state["iterator"]}
        return cls(documents, encode, seq_len=state["seq_len"], batch_size=state["batch_size"],
                   seed=state["seed"], epochs=state["epochs"], shards=saved, read=read,
                   iterator_states=iterators)


def merge_states(states: list[dict]) -> dict:
    """The states of readers of different shards of one pipeline (e.g. one per process) as one."""
    return {**states[0], "iterators": {i: s for state in states for i, s in state["iterators"].items()}}
