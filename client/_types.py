"""The engine's public types: what a consumer gets (:class:`Batch`, :class:`EndOfEpoch`) and
the error for a sample given up (:class:`SampleFailed`, a ``DataferryError`` like every
other error of the tree in ``dataferry.schema``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dataferry.schema import DataferryError

__all__ = ["Batch", "EndOfEpoch", "SampleFailed"]


class SampleFailed(DataferryError):
    """A sample could not be delivered (unknown id, or its retry deadline passed)."""

    def __init__(
        self, dataset: str, id: int, attempts: int, cause: BaseException,
        *, store: str | None = None, failing_for: float | None = None, down_for: float | None = None,
    ) -> None:
        where = f" from {store}" if store else ""
        span = f" over {failing_for:.1f} s" if failing_for else ""
        down = f"; the store was unreachable for {down_for:.1f} s" if down_for else ""
        super().__init__(f"sample {id} of dataset {dataset!r}{where} failed after {attempts} attempt(s){span}{down}: {cause}")
        self.dataset = dataset
        self.id = id
        self.store = store
        self.failing_for = failing_for
        self.down_for = down_for


@dataclass(eq=False)
class Batch:
    """One batch: encoded bytes as zero-copy uint8 views, labels and ids."""

    ids: np.ndarray  # int64
    labels: np.ndarray  # int32
    data: list[np.ndarray]  # uint8, views over the received bytes
    targets: list[bytes | None] | None
    epoch: int
    positions: np.ndarray  # positions in this rank's plan (for exact resume)
    nbytes: int
    #: positions handled without a sample (skipped by the error policy)
    skipped: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.data)


@dataclass(eq=False)
class EndOfEpoch:
    epoch: int
    #: positions handled without being delivered (skips, a dropped last batch)
    skipped: tuple[int, ...] = ()
