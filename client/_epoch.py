"""One epoch's bookkeeping under the engine (``_engine.Run``): :class:`_Epoch` (what is done
and covered, its retries, batch assembly) and :class:`_Req` (a request in flight: the positions
it fills, its reservation, its answers). Owned by the engine and ``_recovery``; nothing else.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter

import numpy as np

from dataferry.schema import Sample

from ._doneset import DoneSet
from ._plan import EpochPlan
from ._types import Batch, EndOfEpoch

__all__ = ["_Epoch", "_Req"]

_data, _target, _id, _label = (attrgetter(name) for name in ("data", "target", "id", "label"))
_as_u8 = partial(np.frombuffer, dtype=np.uint8)


@dataclass(eq=False)
class _Req:
    epoch: _Epoch
    #: id -> the position it fills: ints only, so the cyclic garbage collector does not track it
    #: (with thousands of requests in flight, a container per id made each full collection walk
    #: every id in flight: tens of ms a pause)
    positions: dict[int, int]
    start: float
    attempt: int
    reserved: int
    per_sample: int = 0
    size: int = 0  # the request size when it was sent: fewer ids make it short
    sent_with: int = 0  # requests in flight (not hedges) when it was sent, itself included
    first: float = 0.0  # when its first answer came
    hedge: bool = False
    twin: _Req | None = None
    paired: bool = False  # a hedge, or hedged: its answers may repeat its twin's (``twin`` is cleared at its end)
    deadline: float = float("inf")  # when to hedge it
    task: asyncio.Task | None = None
    answered: set[int] = field(default_factory=set)
    #: id -> its further positions, for an id that fills several (a padded plan); usually None
    extra: dict[int, tuple[int, ...]] | None = None
    count: int = 0  # positions it fills
    blind: bool = False  # sent before any sample's size was seen: reserved at the hint (``_top_up``)
    timed_out: bool = False  # cancelled by the deadline sweep (Retry.timeout), not by a hedge
    sent_delivered: int = 0  # ``Link.delivered`` when it was sent (its delivery-rate sample)

    def all_positions(self) -> Iterable[int]:
        """Every position this request fills."""
        if self.extra is None:
            return self.positions.values()
        return itertools.chain(self.positions.values(), *self.extra.values())


class _Epoch:
    """One epoch: what is done, what is covered, its retries, and batch assembly.

    Assembly (:meth:`deliver`, :meth:`finish`) puts finished batches in
    ``outbox``; :class:`Run` hands them to the consumer once this epoch is
    the current one. ``pending_bytes`` counts delivered bytes not yet handed
    over (the batch being filled, in-order samples held back, the outbox).
    """

    def __init__(self, plan: EpochPlan, done: DoneSet | None, *, batch_size: int, in_order: bool) -> None:
        self.plan = plan
        self.n = len(plan)
        self.batch_size, self.in_order = batch_size, in_order
        self.completed = done.copy() if done is not None else DoneSet(self.n)
        self.cursor = 0
        self.cover: dict[int, int] = {}  # position -> requests covering it
        self.attempts: dict[int, int] = {}  # position -> tries sent, for retried positions until they complete
        self.first_fail: dict[int, float] = {}  # position -> when it first failed (until it completes)
        self.retries: list[tuple[float, int, list[int], int]] = []  # heap of (due, seq, positions, attempt)
        self.active = 0  # requests in flight for this epoch
        self.reserved = 0  # bytes reserved for this epoch's requests in flight
        self.batch: list[Sample] = []  # the batch being filled, and its samples' positions beside it
        self.batch_pos: list[int] = []  # (two lists, not a tuple per sample: a tuple is one more object for the GC)
        self.held: dict[int, Sample | None] = {}  # in-order mode: arrived, not yet released
        self.release = self.completed.frontier  # in-order: next position to release
        self.done_before = set(self.completed.beyond())  # delivered before a resume
        self.skipped: list[int] = []
        self.skipped_count = 0
        self.pending_bytes = 0
        self.outbox: list[Batch] = []  # finished batches not yet handed to the consumer
        self.finished = False  # its end has been emitted

    def fresh(self, k: int) -> list[int]:
        """Up to ``k`` not-yet-sent positions, in plan order."""
        out, self.cursor = self.completed.undone(self.cursor, k)
        return out

    def uncovered(self, positions: Iterable[int]) -> list[int]:
        """Those of ``positions`` neither done nor covered by a request in flight."""
        done, cover = self.completed, self.cover
        return [p for p in positions if p not in done and not cover.get(p)]

    # --- batch assembly ----------------------------------------------------------
    def deliver(self, pos: int, sample: Sample | None, nbytes: int) -> None:
        """Position ``pos`` is done: ``sample`` (None: skipped) of ``nbytes``."""
        self.pending_bytes += nbytes
        if not self.in_order:
            self._take(pos, sample)
            return
        self.held[pos] = sample
        while True:
            if self.release in self.held:
                self._take(self.release, self.held.pop(self.release))
            elif self.release not in self.done_before:
                break
            self.release += 1

    def _take(self, pos: int, sample: Sample | None) -> None:
        if sample is None:
            self.skipped.append(pos)
            return
        self.batch.append(sample)
        self.batch_pos.append(pos)
        if len(self.batch) >= self.batch_size:
            self._flush()

    def _flush(self) -> None:
        samples, positions, self.batch, self.batch_pos = self.batch, self.batch_pos, [], []
        # map over attrgetter and partial: the per-sample steps run in C, not a comprehension's frame
        datas = list(map(_data, samples))
        targets = list(map(_target, samples))
        self.outbox.append(Batch(
            ids=np.array(list(map(_id, samples)), np.int64),
            labels=np.array(list(map(_label, samples)), np.int32),
            data=list(map(_as_u8, datas)),
            targets=None if targets.count(None) == len(targets) else targets,
            epoch=self.plan.epoch,
            positions=np.array(positions, np.int64),
            nbytes=sum(map(len, datas)),
            skipped=tuple(self.skipped),
        ))
        self.skipped = []

    def finish(self, drop_last: bool) -> tuple[EndOfEpoch, int]:
        """Flush (or drop) the last partial batch; the end marker and the bytes dropped."""
        dropped: list[int] = []
        nbytes = 0
        if self.batch:
            if drop_last:
                dropped = self.batch_pos
                nbytes = sum(len(s.data) for s in self.batch)
                self.pending_bytes -= nbytes
                self.batch, self.batch_pos = [], []
            else:
                self._flush()
        end = EndOfEpoch(self.plan.epoch, tuple(self.skipped) + tuple(dropped))
        self.skipped = []
        self.finished = True
        return end, nbytes
