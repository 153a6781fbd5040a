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


def _undone_one_at_a_time(s: DoneSet, start: int, k: int) -> tuple[list[int], int]:
    """What _Epoch.fresh did before DoneSet.undone: a position at a time."""
    out, cur = [], start
    while cur < s.n and len(out) < k:
        if cur not in s:
            out.append(cur)
        cur += 1
    return out, cur


@pytest.mark.parametrize("seed", range(6))
def test_undone_finds_what_a_walk_one_position_at_a_time_finds(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    frontier = int(rng.integers(0, n + 1))
    s = DoneSet(n, frontier=frontier, beyond=rng.choice(np.arange(frontier, n), size=(n - frontier) // 3,
                                                        replace=False).tolist() if n > frontier else [])
    for p in rng.permutation(n)[: n // 4]:
        s.add(int(p))
    cursor = walked = 0
    while True:
        k = int(rng.integers(0, 40))
        got, cursor_next = s.undone(cursor, k)
        want, walked_next = _undone_one_at_a_time(s, walked, k)
        assert got == want
        if got:  # the next call starts where the walk stopped: after the last found, or at the end
            assert cursor_next == walked_next
        cursor, walked = cursor_next, walked_next
        if cursor >= n and walked >= n:
            break
        if k and not got:
            assert cursor == n and walked == n
            break
    assert s.undone(n, 5) == ([], n)
