"""BufferPool: the arenas samples are received into, used again once free.

A response's records are read by the kernel into an *arena* (a ``bytearray``,
4 MiB by default), many samples per ``recv_into``; each ``Sample.data`` is a
read-only ``memoryview`` slice of it. An arena is free again exactly when only
the pool refers to it; arenas are shared out in regions sized to what a
response expects, and at most ``spare_bytes`` of free arenas are kept. The
price: one sample kept by the consumer keeps its whole arena from reuse (copy
a sample you keep for long: ``bytes(sample.data)``).

Why arenas, how the ring is searched, region sizing and what each choice
measured: ``bench/results/http_receive.md``.
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


#: references to an arena just taken off the ring that only the pool holds: our local and getrefcount's argument
_ONLY_US_POPPED = 2
#: rooms kept at most (the unused ends of arenas, and what responses handed back)
_MAX_ROOMS = 16


class BufferPool:
    """Arenas for received samples: ``take(n)`` -> ``(arena, start, stop)``, a
    region of writable bytes carved from an arena; ``give_back(arena, start,
    stop)`` returns what a response did not write."""

    def __init__(self, spare_bytes: int = 512 << 20, arena: int = ARENA) -> None:
        self.spare_bytes = spare_bytes
        self.arena = arena
        self._free: dict[int, list[bytearray]] = {}
        self._free_bytes = 0
        self._lent: deque[bytearray] = deque()
        self._rooms: list[tuple[bytearray, int, int]] = []  # unwritten regions, the newest last
        self.reused = self.made = self.looked = 0

    def take(self, n: int, least: int | None = None) -> tuple[bytearray, int, int]:
        """A region of ``n`` bytes (at most an arena's, unless ``least`` is more);
        or, rather than a new arena, the newest room of at least ``least``
        bytes whole (the rest of an arena: the caller moves on to another
        region when it is full)."""
        n = max(min(n, self.arena), least or 0)  # a region larger than an arena only for a record that is
        rooms = self._rooms
        for k in range(len(rooms) - 1, -1, -1):
            buf, start, stop = rooms[k]
            if stop - start >= n:
                del rooms[k]
                self._room(buf, start + n, stop)
                return buf, start, start + n
        buf = None  # a reference of ours would make that arena look in use to _arena
        if least is not None and rooms and rooms[-1][2] - rooms[-1][1] >= least:
            return rooms.pop()
        buf = self._arena(n)
        self._room(buf, n, len(buf))
        return buf, 0, n

    def give_back(self, buf: bytearray, start: int, stop: int) -> None:
        """``buf[start:stop]`` was never written and nothing refers to it: another response may use it."""
        rooms = self._rooms
        for k in range(len(rooms) - 1, -1, -1):
            b, s, e = rooms[k]
            if b is buf and s == stop:  # the rest of the arena, just after: one room again
                del rooms[k]
                stop = e
                break
        self._room(buf, start, stop)

    def _room(self, buf: bytearray, start: int, stop: int) -> None:
        if stop - start >= MIN_ROOM:
            self._rooms.append((buf, start, stop))
            if len(self._rooms) > _MAX_ROOMS:
                del self._rooms[0]

    def _arena(self, n: int) -> bytearray:
        cap = size_class(max(n, self.arena))
        lent = self._lent
        for _ in range(len(lent)):  # oldest first, up to the first free one: arenas come free about in that order
            buf = lent.popleft()
            self.looked += 1
            refs = sys.getrefcount(buf) - _ONLY_US_POPPED
            if refs:  # in use, unless its only other references are rooms waiting in the pool
                rooms = 0
                for room in self._rooms:
                    if room[0] is buf:
                        rooms += 1
                if refs != rooms:
                    lent.append(buf)
                    continue
                self._rooms = [r for r in self._rooms if r[0] is not buf]  # free whole: reused from the start
            if len(buf) == cap:
                self.reused += 1
                lent.append(buf)
                return buf
            self._keep(buf)  # free, another size: kept for a take of that size
        buf = None
        free = self._free.get(cap)
        if free:
            buf = free.pop()
            self._free_bytes -= cap
            self.reused += 1
        else:
            buf = bytearray(cap)
            self.made += 1
        lent.append(buf)
        return buf

    def _keep(self, buf: bytearray) -> None:
        cap = len(buf)
        if self._free_bytes + cap > self.spare_bytes:
            return  # let it go
        self._free.setdefault(cap, []).append(buf)
        self._free_bytes += cap
