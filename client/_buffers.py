"""BufferPool: the buffers samples are received into, used again once free.

A fresh buffer costs more than its allocation: its pages are faulted in on
first write, and the allocator hands large freed blocks back to the system,
so a stream of 110 KB samples pays a page fault every 4 KiB (measured on the
dev machine: ~70 us per 110 KB sample, more than everything else together).
So received buffers are kept and reused.

A sample's data is a read-only ``memoryview`` over a pooled ``bytearray``.
Every view of it, and every numpy array or memoryview made from one (however
many hops away), keeps the bytearray referenced: so a buffer is free exactly
when only the pool refers to it (its reference count says so). The pool
keeps the buffers it lent in a ring, oldest first, and looks at a few of the
oldest on each ``take``: a free one is taken back, one still in use goes to
the back of the ring. Batches are mostly released in the order their
samples arrived, so free buffers are found at the front; one a user keeps
for long only costs a look per lap.

Sizes are rounded up to one of 16 steps per power of two (at most 1/16 more
than asked, what the engine's byte budget does not see), and at most
``spare_bytes`` of free buffers are kept: more is given back to the allocator.
Below ``min_size`` a buffer is not pooled (small samples cost little).
"""

from __future__ import annotations

import sys
from collections import deque

__all__ = ["BufferPool"]


def size_class(n: int) -> int:
    """``n`` rounded up to 1/16 of its power of two."""
    step = max(1, 1 << (n.bit_length() - 5))
    return -(-n // step) * step


#: references to a lent buffer that only the pool holds: the ring and getrefcount's argument
_ONLY_US = 2
#: lent buffers looked at per take
_LOOKS = 4


class BufferPool:
    """Buffers for received samples: ``take(n)`` -> ``(writable, readonly)`` views of ``n`` bytes."""

    def __init__(self, spare_bytes: int = 64 << 20, min_size: int = 1 << 15) -> None:
        self.spare_bytes = spare_bytes
        self.min_size = min_size
        self._free: dict[int, list[bytearray]] = {}
        self._free_bytes = 0
        self._lent: deque[bytearray] = deque()
        self.reused = self.made = 0

    def take(self, n: int) -> tuple[memoryview, memoryview]:
        if n < self.min_size:
            mv = memoryview(bytearray(n))
            return mv, mv.toreadonly()
        lent = self._lent
        for _ in range(min(_LOOKS, len(lent))):
            if sys.getrefcount(lent[0]) == _ONLY_US:
                self._keep(lent.popleft())
            else:
                lent.rotate(-1)
        cap = size_class(n)
        free = self._free.get(cap)
        if free:
            buf = free.pop()
            self._free_bytes -= cap
            self.reused += 1
        else:
            buf = bytearray(cap)
            self.made += 1
        lent.append(buf)
        mv = memoryview(buf)
        return mv[:n], mv.toreadonly()[:n]

    def _keep(self, buf: bytearray) -> None:
        cap = len(buf)
        if self._free_bytes + cap > self.spare_bytes:
            return  # let it go
        self._free.setdefault(cap, []).append(buf)
        self._free_bytes += cap
