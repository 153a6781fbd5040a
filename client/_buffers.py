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
pool keeps the arenas it lent in a ring and, each time it needs a new arena
(once per arena, some dozens of samples, not per sample), looks at them oldest
first up to the first free one: arenas come free about in the order they were
lent, as batches are handed out, so that is usually the first one looked at.
A free arena is taken back with whatever room of its own was waiting for
another response (else an arena whose samples are gone but whose last 100 KB
no response could use stayed out of reach, and a new one was made). An arena
is made only when none in the ring is free: looking at only a few let free
arenas sit unseen while fresh ones were made, each a page fault per 4 KiB
(measured: fresh arenas were 12% of the client's CPU on loopback); looking at
every lent arena each time was a walk of the whole ring per new arena, and of
a growing one while a loader's arenas in use climb (``looked`` counts the
arenas looked at: ``tests/test_http_receive.py``). The price of arenas:
one sample kept by the consumer keeps its whole arena (at most ``arena``
bytes, a few dozen samples' worth) from being reused; copy a sample you keep
for long (``bytes(sample.data)``).

Arenas are shared out in regions: a response asks for what it expects to
carry (the ids it asked for times the mean record size, 1/16 more), so the
room a response holds and has not filled stays near its estimate's error
(the engine's byte budget counts samples' bytes, not arenas); what it did
not use goes back (:meth:`BufferPool.give_back`) for the next response. An
arena's last room is handed out whole even when smaller than asked: the
response moves on to a new region when it is full (copying the part of the
one record it was reading), so arenas are filled whole however the
responses are sized.

Sizes are rounded up to one of 16 steps per power of two, and at most
``spare_bytes`` of free arenas are kept: more is given back to the allocator.
An arena is made only when none is free, so the arenas kept (in use or free)
are never more than were once in use at the same time: keeping free ones
never raises the peak. On loopback, a loader's arenas swung by more than 64
MiB within an epoch, and with 64 MiB kept, 120 arenas were given back and 122
made again over 12 epochs of 1,024 samples (each a page fault per 4 KiB and a
4 MiB memset); with the default 512 MiB, one made and none given back.
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
