"""The grain training pipeline: documents -> tokens -> packed rows with segment ids and positions.

    batches = PackedBatches(docs, token_encoder(tok), seq_len=256, batch_size=16, seed=0)
    batch = next(batches)            # Batch of int32 [B, L] arrays
    meta["data"] = batches.state()   # JSON; PackedBatches.from_state(docs, encode, state) continues

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
The iterator's state (grain's, JSON) is small: indices into the shuffled document order and
the packer's position, so a resume replays the exact following batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import grain
import numpy as np
from tokenizers import Tokenizer

from glm_jax.data.tokenizer import eos_id

STATE_KIND = "grain-packed"


class Batch(NamedTuple):
    """One training batch; all int32 [B, L]. segment_ids 0 marks padding (no loss there)."""

    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    @property
    def loss_mask(self) -> np.ndarray:
        """bool [B, L]: positions whose target is a real token."""
        return self.segment_ids > 0


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
                   packing_bins: int | None = None) -> grain.IterDataset:
    """The grain dataset of packed batches (dicts of int32 [B, L]: inputs, targets,
    inputs_segment_ids, inputs_positions, ...). documents: len() and [i] -> str."""
    if len(documents) == 0:
        raise ValueError("no documents to train on")
    ds = grain.MapDataset.source(documents).shuffle(seed=seed)
    ds = ds.repeat(epochs)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=16))
    ds = grain.experimental.FlatMapIterDataset(ds, _EncodeAndSplit(encode, seq_len))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"inputs": seq_len, "targets": seq_len},
        num_packing_bins=packing_bins or 4 * batch_size, seed=seed, shuffle_bins=True)
    return ds.batch(batch_size, drop_remainder=drop_remainder)


def _to_batch(d: dict) -> Batch:
    return Batch(d["inputs"], d["targets"], d["inputs_segment_ids"], d["inputs_positions"])


class PackedBatches:
    """Iterator of Batch over `documents`, with a JSON state for checkpoints."""

    def __init__(self, documents, encode: Callable[[str], np.ndarray], *, seq_len: int, batch_size: int,
                 seed: int = 0, epochs: int | None = None, iterator_state: dict | None = None):
        self.seq_len, self.batch_size, self.seed, self.epochs = seq_len, batch_size, seed, epochs
        self._it = iter(packed_dataset(documents, encode, seq_len=seq_len, batch_size=batch_size, seed=seed,
                                       epochs=epochs))
        if iterator_state is not None:
            self._it.set_state(iterator_state)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        return _to_batch(next(self._it))

    def state(self) -> dict:
        return {"kind": STATE_KIND, "seq_len": self.seq_len, "batch_size": self.batch_size, "seed": self.seed,
                "epochs": self.epochs, "iterator": self._it.get_state()}

    @classmethod
    def from_state(cls, documents, encode, state: dict) -> "PackedBatches":
        if state.get("kind") != STATE_KIND:
            raise ValueError("the checkpoint's data state is not a packed-pipeline state (it was written "
                             "by an older train.py); start a new run directory")
        return cls(documents, encode, seq_len=state["seq_len"], batch_size=state["batch_size"],
                   seed=state["seed"], epochs=state["epochs"], iterator_state=state["iterator"])
