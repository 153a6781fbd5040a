"""BufferPool: the arenas samples are received into, used again once free.

A response's records are read by the kernel into an *arena*, a large
``bytearray`` (``arena`` bytes, 4 MiB by default): one ``recv_into`` carries
many samples, and each sample's data is a read-only ``memoryview`` slice of
it (``FrameDecoder`` in ``schema/_wire.py``). A record that does not fit in
what is left of an arena starts a new one (its few bytes already read are
copied over); a record larger than ``arena`` gets an arena of its own size.

A fresh buffer costs more than its allocation: its pages are faulted in on
first write, and the allocator hands large freed blocks back to the system
(measured on the dev machine: ~70 us per 110 KB sample when each sample had a
fresh buffer). So arenas are kept and reused.

Every view of an arena, and every numpy array or memoryview made from one
(however many hops away), keeps the bytearray referenced: so an arena is free
exactly when only the pool refers to it (its reference count says so). The
pool keeps the arenas it lent in a ring, oldest first, and looks at a few of
the oldest on each ``take``: a free one is taken back, one still in use goes
to the back of the ring. Batches are mostly released in the order their
samples arrived, so free arenas are found at the front. The price of arenas:
one sample kept by the consumer keeps its whole arena (at most ``arena``
bytes, a few dozen samples' worth) from being reused; copy a sample you keep
for long (``bytes(sample.data)``).

A response that ends with room left in its arena hands that room back
(:meth:`BufferPool.give_back`): the next response on any connection writes
after the last record instead of starting an arena of its own, so arenas are
filled whole however the responses are sized.

Sizes are rounded up to one of 16 steps per power of two, and at most
``spare_bytes`` of free arenas are kept: more is given back to the allocator.
"""

from __future__ import annotations

import sys
from collections import deque

__all__ = ["BufferPool", "ARENA"]

#: default arena size
ARENA = 4 << 20
#: room below which what is left of an arena is not worth handing on
MIN_ROOM = 1 << 16


def size_class(n: int) -> int:
    """``n`` rounded up to 1/16 of its power of two."""
    step = max(1, 1 << (n.bit_length() - 5))
    return -(-n // step) * step


#: references to a lent arena that only the pool holds: the ring and getrefcount's argument
_ONLY_US = 2
#: lent arenas looked at per take
_LOOKS = 4
#: room handed back kept at most (one per response that ended with room left)
_MAX_ROOMS = 64


class BufferPool:
    """Arenas for received samples: ``take(n)`` -> ``(arena, start)``, at least
    ``n`` writable bytes from ``start``; ``give_back(arena, start)`` returns the
    unwritten room from ``start`` on."""

    def __init__(self, spare_bytes: int = 64 << 20, arena: int = ARENA) -> None:
        self.spare_bytes = spare_bytes
        self.arena = arena
        self._free: dict[int, list[bytearray]] = {}
        self._free_bytes = 0
        self._lent: deque[bytearray] = deque()
        self._rooms: list[tuple[bytearray, int]] = []
        self.reused = self.made = 0

    def take(self, n: int) -> tuple[bytearray, int]:
        rooms = self._rooms
        while rooms:
            buf, start = rooms.pop()
            if len(buf) - start >= n:
                return buf, start
        lent = self._lent
        for _ in range(min(_LOOKS, len(lent))):
            if sys.getrefcount(lent[0]) == _ONLY_US:
                self._keep(lent.popleft())
            else:
                lent.rotate(-1)
        cap = size_class(max(n, self.arena))
        free = self._free.get(cap)
        if free:
            buf = free.pop()
            self._free_bytes -= cap
            self.reused += 1
        else:
            buf = bytearray(cap)
            self.made += 1
        lent.append(buf)
        return buf, 0

    def give_back(self, buf: bytearray, start: int) -> None:
        """``buf[start:]`` was never written and nothing refers to it: another response may use it."""
        if len(buf) - start >= MIN_ROOM and len(self._rooms) < _MAX_ROOMS:
            self._rooms.append((buf, start))

    def _keep(self, buf: bytearray) -> None:
        cap = len(buf)
        if self._free_bytes + cap > self.spare_bytes:
            return  # let it go
        self._free.setdefault(cap, []).append(buf)
        self._free_bytes += cap
