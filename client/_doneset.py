"""A compact set of done positions: a frontier plus a byte map.

Positions are dispatched in plan order and complete out of order, so
everything below some frontier is done and only the positions in flight
around it are not. What is done is one byte a position (``n`` bytes, made
with the set: 1.28 MB for 1.28M positions), never a Python object a
position, so a position that stays undone for long (a sample retried through
an outage) does not make the set grow with the rest of the epoch. A byte, not
a bit: ``bytearray`` indexing and ``find`` run the hot path (an add per
sample, the frontier's advance) at C speed; a bit a position cost about twice
the CPU in Python.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["DoneSet"]


class DoneSet:
    __slots__ = ("n", "frontier", "_done", "_count")

    def __init__(self, n: int, frontier: int = 0, beyond: Iterable[int] = ()) -> None:
        self.n = n
        self._done = bytearray(n)  # 1: done (below the frontier, only those added since it was made)
        self.frontier = frontier
        self._count = frontier  # positions done
        for p in beyond:
            self.add(p)

    def add(self, pos: int) -> bool:
        """Mark ``pos`` done; False if it already was."""
        done = self._done
        if pos < self.frontier or done[pos]:
            return False
        done[pos] = 1
        self._count += 1
        if pos == self.frontier:
            f = done.find(0, pos + 1)
            self.frontier = self.n if f < 0 else f
        return True

    def add_many(self, positions: np.ndarray) -> int:
        """Mark every one of ``positions`` (int array, repeats allowed) done at once, in numpy;
        the count newly done."""
        pos = np.asarray(positions, np.int64)
        if not len(pos):
            return 0
        least, most = int(pos.min()), int(pos.max())
        if least < 0 or most >= self.n:
            raise IndexError(f"positions outside 0..{self.n - 1}")
        lo, hi = max(least, self.frontier), most + 1
        if lo >= hi:
            return 0
        done = np.frombuffer(self._done, np.uint8)
        span = done[lo:hi]  # positions arrive near the frontier: a short span, counted at C speed
        before = int(np.count_nonzero(span))
        done[pos[pos >= lo]] = 1
        added = int(np.count_nonzero(span)) - before
        del done, span  # the bytearray exports no buffer once back
        self._count += added
        f = self.frontier
        if f < self.n and self._done[f]:
            f = self._done.find(0, f)
            self.frontier = self.n if f < 0 else f
        return added

    def undone(self, start: int, k: int) -> tuple[list[int], int]:
        """Up to ``k`` positions from ``start`` on that are not done, in order, and the position
        after the last one looked at (where the next call starts); found at C speed."""
        n, done = self.n, self._done
        cur, out = max(start, self.frontier), []
        while cur < n and len(out) < k:
            f = done.find(0, cur)  # the next not done
            if f < 0:
                return out, n
            stop = min(n, f + k - len(out))
            e = done.find(1, f, stop)  # and the run of them that follows
            cur = stop if e < 0 else e
            out.extend(range(f, cur))
        return out, cur

    def __contains__(self, pos: int) -> bool:
        return pos < self.frontier or (pos < self.n and self._done[pos] == 1)

    def __len__(self) -> int:
        return self._count

    @property
    def complete(self) -> bool:
        return self.frontier >= self.n

    def beyond(self) -> list[int]:
        """The positions done past the frontier, in order."""
        f = self.frontier
        return (np.flatnonzero(np.frombuffer(self._done, np.uint8)[f:]) + f).tolist()

    def copy(self) -> DoneSet:
        new = DoneSet.__new__(DoneSet)
        new.n, new.frontier, new._done, new._count = self.n, self.frontier, bytearray(self._done), self._count
        return new
