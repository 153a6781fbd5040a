"""DoneSet.add_many against add, one position at a time: the same set, count and frontier."""

import numpy as np
import pytest

from dataferry.client._doneset import DoneSet


def test_add_many_marks_what_add_would_in_any_order_with_repeats():
    rng = np.random.default_rng(7)
    n = 5_000
    one, many = DoneSet(n), DoneSet(n)
    order = rng.permutation(n)
    for chunk in np.array_split(order, 37):
        chunk = np.concatenate([chunk, chunk[: len(chunk) // 3]])  # repeats within a batch
        new = sum(one.add(int(p)) for p in chunk)
        assert many.add_many(chunk) == new
        assert (many.frontier, len(many)) == (one.frontier, len(one))
        assert many.beyond() == one.beyond()
        assert many.add_many(chunk) == 0  # all done already: nothing counted twice
    assert many.complete and len(many) == n


def test_add_many_below_a_resumed_frontier_and_out_of_range():
    s = DoneSet(10, frontier=4, beyond=[6])
    assert s.add_many(np.array([0, 3, 4, 6, 5], np.int64)) == 2  # 0 and 3 below the frontier, 6 done
    assert (s.frontier, len(s)) == (7, 7)
    assert s.add_many(np.array([], np.int64)) == 0
    with pytest.raises(IndexError):
        s.add_many(np.array([10]))
    assert (s.frontier, len(s)) == (7, 7)
