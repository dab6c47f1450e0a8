"""Prefetched: batches built ahead on a thread, the position handed out with each one."""

import time

import pytest

from glm_jax.data.prefetch import Prefetched


class Counter:
    """Items 0, 1, ... up to `stop` (exclusive), state = the next item; `fail_at` raises there."""

    def __init__(self, stop=None, fail_at=None, delay=0.0):
        self.next_item, self.stop, self.fail_at, self.delay = 0, stop, fail_at, delay

    def __next__(self):
        time.sleep(self.delay)
        if self.next_item == self.fail_at:
            raise ValueError(f"bad document at {self.next_item}")
        if self.stop is not None and self.next_item >= self.stop:
            raise StopIteration
        self.next_item += 1
        return self.next_item - 1

    def state(self):
        return {"next": self.next_item}


def test_state_is_the_position_after_the_last_item_handed_out():
    source = Counter()
    batches = Prefetched(source, depth=3)
    assert batches.state() == {"next": 0}
    assert [next(batches) for _ in range(4)] == [0, 1, 2, 3]
    time.sleep(0.2)                                   # the thread has built items ahead by now
    assert source.next_item > 4
    assert batches.state() == {"next": 4}             # what a checkpoint records: the consumed ones
    batches.close()


def test_source_errors_and_end_reach_the_consumer_in_order():
    batches = Prefetched(Counter(fail_at=2))
    assert [next(batches), next(batches)] == [0, 1]
    for _ in range(2):                                # and again on a later call
        with pytest.raises(ValueError, match="bad document at 2"):
            next(batches)
    assert list(Prefetched(Counter(stop=3))) == [0, 1, 2]


def test_building_overlaps_the_consumer():
    batches = Prefetched(Counter(delay=0.25), depth=2)
    next(batches)
    time.sleep(1.0)                                   # "the step": the next items are built meanwhile
    start = time.perf_counter()
    next(batches), next(batches)
    assert time.perf_counter() - start < 0.25         # built one after the other here: 0.5 s
    batches.close()


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth"):
        Prefetched(Counter(), depth=0)
