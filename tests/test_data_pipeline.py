"""The grain pipeline: packing, determinism, resumable state; document sources and their errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from glm_jax.data import pipeline, sources

SEQ = 8


def _docs(n=13):
    """Document i has 1 + (3 i) % 20 tokens, all distinct across documents: i * 100 + j."""
    return [" ".join(str(i * 100 + j) for j in range(1 + (3 * i) % 20)) for i in range(n)]


def _encode(text: str) -> np.ndarray:
    return np.asarray([int(w) for w in text.split()], np.int32)


def _segments(batch: pipeline.Batch):
    """-> list of (inputs, targets, positions) of every segment in the batch."""
    out = []
    for row in range(batch.inputs.shape[0]):
        seg = batch.segment_ids[row]
        for s in np.unique(seg[seg > 0]):
            m = seg == s
            assert np.all(np.diff(np.flatnonzero(m)) == 1), "a segment must be contiguous"
            out.append((batch.inputs[row, m], batch.targets[row, m], batch.positions[row, m]))
    return out


def test_one_pass_packs_every_token_once_with_restarting_positions():
    docs = _docs()
    ds = pipeline.packed_dataset(docs, _encode, seq_len=SEQ, batch_size=2, seed=1, epochs=1,
                                 drop_remainder=False)
    inputs, targets = {}, {}
    for raw in ds:
        batch = pipeline._to_batch(raw)
        assert batch.inputs.shape[1] == SEQ
        assert np.all(batch.inputs[batch.segment_ids == 0] == 0)
        for x, y, pos in _segments(batch):
            np.testing.assert_array_equal(pos, np.arange(x.size))
            np.testing.assert_array_equal(y[:-1], x[1:])  # targets are the next ids of the same piece
            doc = int(x[0]) // 100
            assert np.all(x // 100 == doc) and np.all(y // 100 == doc), "a piece mixes documents"
            inputs.setdefault(doc, []).extend(x.tolist())
            targets.setdefault(doc, []).extend(y.tolist())
    for i, text in enumerate(docs):
        ids = _encode(text)
        if ids.size < 2:
            assert i not in inputs
            continue
        assert sorted(inputs[i]) == ids[:-1].tolist()    # each id an input exactly once
        assert sorted(targets[i]) == ids[1:].tolist()    # and a target exactly once


def test_split_pieces_cuts_long_documents():
    pieces = pipeline.split_pieces(np.arange(20), 8)
    assert [p["inputs"].tolist() for p in pieces] == [list(range(8)), list(range(8, 16)), [16, 17, 18]]
    assert [p["targets"].tolist() for p in pieces] == [list(range(1, 9)), list(range(9, 17)), [17, 18, 19]]
    assert pipeline.split_pieces(np.arange(1), 8) == []


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_order_is_a_function_of_the_seed():
    docs = _docs()
    a = _take(pipeline.PackedBatches(docs, _encode, seq_len=SEQ, batch_size=2, seed=3), 12)
    b = _take(pipeline.PackedBatches(docs, _encode, seq_len=SEQ, batch_size=2, seed=3), 12)
    c = _take(pipeline.PackedBatches(docs, _encode, seq_len=SEQ, batch_size=2, seed=4), 12)
    assert all(np.array_equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q))
    assert not all(np.array_equal(p.inputs, q.inputs) for p, q in zip(a, c))


@pytest.mark.parametrize("consumed", [1, 5, 9])  # within the first packing round, later, second epoch
def test_state_restores_the_following_batches(consumed):
    docs = _docs()
    it = pipeline.PackedBatches(docs, _encode, seq_len=SEQ, batch_size=2, seed=0)
    _take(it, consumed)
    state = json.loads(json.dumps(it.state()))  # what a checkpoint holds
    expected = _take(it, 6)
    _assert_same_batches(expected, _take(pipeline.PackedBatches.from_state(docs, _encode, state), 6))


def test_state_of_another_pipeline_is_refused():
    with pytest.raises(ValueError, match="older train.py"):
        pipeline.PackedBatches.from_state(_docs(), _encode, {"seed": 0, "step": 3})


def _joined(batches) -> pipeline.Batch:
    """Batches of different shards as one batch of all their rows."""
    return pipeline.Batch(*map(np.concatenate, zip(*batches)))


def _assert_same_batches(expected, got):
    for p, q in zip(expected, got, strict=True):
        for x, y in zip(p, q):
            np.testing.assert_array_equal(x, y)


def test_shard_readers_supply_their_rows_of_the_whole_batch():
    """Two readers of one shard each (two processes) see the rows of one reader of both shards,
    and their merged state continues both, also as one reader."""
    docs, kw = _docs(), dict(seq_len=SEQ, batch_size=4, seed=2, shards=2)
    whole = pipeline.PackedBatches(docs, _encode, **kw)
    halves = [pipeline.PackedBatches(docs, _encode, **kw, read=range(i, i + 1)) for i in range(2)]
    parts = [_take(h, 5) for h in halves]
    assert parts[0][0].inputs.shape == (2, SEQ)
    _assert_same_batches(_take(whole, 5), [_joined(b) for b in zip(*parts)])
    state = json.loads(json.dumps(pipeline.merge_states([h.state() for h in halves])))
    assert state == json.loads(json.dumps(whole.state()))
    expected = _take(whole, 4)
    _assert_same_batches(expected, _take(pipeline.PackedBatches.from_state(docs, _encode, state, shards=2), 4))
    resumed = [pipeline.PackedBatches.from_state(docs, _encode, state, read=range(i, i + 1)) for i in range(2)]
    _assert_same_batches(expected, [_joined(b) for b in zip(*(_take(r, 4) for r in resumed))])


def test_shards_are_whole_rows_and_must_match_on_resume():
    assert pipeline.shards_of_rows(range(4, 8), 8, 4) == range(2, 4)
    assert pipeline.shards_of_rows(range(0, 8), 8, 2) == range(0, 2)
    with pytest.raises(ValueError, match="not whole data shards"):
        pipeline.shards_of_rows(range(2, 4), 8, 2)
    with pytest.raises(ValueError, match="cannot be split into 3"):
        pipeline.PackedBatches(_docs(), _encode, seq_len=SEQ, batch_size=4, shards=3)
    state = pipeline.PackedBatches(_docs(), _encode, seq_len=SEQ, batch_size=4, shards=2).state()
    with pytest.raises(ValueError, match="resume with --data-shards 2"):
        pipeline.PackedBatches.from_state(_docs(), _encode, state, shards=1)


def test_sources_read_text_jsonl_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.jsonl").write_text('{"text": "second"}\n\n{"text": "third", "id": 7}\n')
    (tmp_path / "empty.txt").write_text("")
    docs = sources.open_documents([tmp_path])
    assert [docs[i] for i in range(len(docs))] == ["first document", "second", "third"]
    train, heldout = sources.split_documents(docs, seed=0)
    assert sorted(train.indices + heldout.indices) == [0, 1, 2] and heldout.indices


def test_sources_read_array_record(tmp_path):
    array_record = pytest.importorskip("array_record.python.array_record_module")
    path = tmp_path / "docs.array_record"
    writer = array_record.ArrayRecordWriter(str(path), "group_size:1")
    for text in ("plain text", json.dumps({"text": "from json"})):
        writer.write(text.encode())
    writer.close()
    docs = sources.open_documents([path])
    assert [docs[0], docs[1]] == ["plain text", "from json"]


def test_bad_data_is_refused(tmp_path):
    with pytest.raises(sources.DataError, match="does not exist"):
        sources.open_documents([tmp_path / "missing.txt"])
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(sources.DataError, match="no text"):
        sources.open_documents([tmp_path / "empty.txt"])
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    docs = sources.open_documents([tmp_path / "bad.jsonl"])
    with pytest.raises(sources.DataError, match=r"bad.jsonl:2"):
        docs[1]
