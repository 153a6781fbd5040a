"""A compact set of done positions: a frontier plus the few done beyond it.

Positions are dispatched in plan order and complete out of order, so
everything below some frontier is done and only the positions in flight
around it are not; the set beyond the frontier stays as small as the window.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["DoneSet"]


class DoneSet:
    __slots__ = ("n", "frontier", "_beyond")

    def __init__(self, n: int, frontier: int = 0, beyond: Iterable[int] = ()) -> None:
        self.n = n
        self.frontier = frontier
        self._beyond: set[int] = set()
        for p in beyond:
            self.add(p)
        self._advance()

    def _advance(self) -> None:
        beyond = self._beyond
        f = self.frontier
        while f in beyond:
            beyond.remove(f)
            f += 1
        self.frontier = f

    def add(self, pos: int) -> bool:
        """Mark ``pos`` done; False if it already was."""
        if pos < self.frontier or pos in self._beyond:
            return False
        if pos == self.frontier:
            self.frontier += 1
            self._advance()
        else:
            self._beyond.add(pos)
        return True

    def __contains__(self, pos: int) -> bool:
        return pos < self.frontier or pos in self._beyond

    def __len__(self) -> int:
        return self.frontier + len(self._beyond)

    @property
    def complete(self) -> bool:
        return self.frontier >= self.n

    def beyond(self) -> list[int]:
        return sorted(self._beyond)

    def copy(self) -> DoneSet:
        return DoneSet(self.n, self.frontier, self._beyond)
