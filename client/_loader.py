"""The sync facade: ``Loader`` runs the async engine in one background thread.

The training loop sees per-epoch iterators, as with torch's DataLoader or
SPDL's ``get_iterator()``: each ``iter(loader)`` returns a fresh
:class:`LoaderEpoch` for the next epoch (``it1 = iter(loader); it2 =
iter(loader)`` walk two consecutive epochs). An epoch iterator gives
:class:`Batch` es (``for batch in it``, ``get(timeout)``, ``get_nowait()``,
which raises :class:`queue.Empty` when no batch is ready) and stops at the
epoch's end; starting the next one abandons the rest, as torch does. After
``load_state_dict()`` the next ``iter()`` delivers exactly the rest of the
saved epoch. ``loader.get()`` reads the running epoch directly.

The engine prefetches the next epoch while the current one finishes. Options
are read-only: a new option means a new Loader. ``stats()`` merges the
engine's figures and the consumer's (``_stats.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import time
import weakref
from typing import TYPE_CHECKING, Literal

from dataferry.schema import (
    ALL_SPLIT, ConfigError, DataferryError, IdList, LoopThread, SampleSource, content_hash,
)
from dataferry.schema.sources import source_factory

from ._engine import Run
from ._retry import describe_source, retrying
from ._tuner import Link
from ._types import Batch, EndOfEpoch
from ._options import ErrorPolicy, Hedge, PlanOptions, Prefetch, Retry
from ._plan import EpochPlan, make_plan, split_digest
from ._doneset import DoneSet
from ._elastic import DealtPlan, dealt_of, gather, merge_states, resume_plan
from ._attribution import Attributor, Interval
from ._stats import MAX_IDS, Counters, EngineCpu, Stats, Taken, snapshot

if TYPE_CHECKING:
    from dataferry.schema.sources import HttpOptions

__all__ = ["Loader", "LoaderEpoch"]

log = logging.getLogger("dataferry.client")

_STATE_VERSION = 1


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def _open_source(source) -> tuple[SampleSource, bool]:
    """``source`` as the engine holds it: a source object given (not owned), or what an
    async factory opens on the engine's loop (owned: closed with the Loader)."""
    if hasattr(source, "fetch"):
        return source, False
    return await source(), True


async def _derive(source, dataset: str, where: str, parent: str):
    """The derived split of ``parent`` matching ``where``: made (or reused) by the
    data service, or here over a store's metadata."""
    if hasattr(source, "derive_split"):  # the data service
        return await source.derive_split(dataset, where, parent=parent)
    if hasattr(source, "read_meta") and hasattr(source, "put_derived"):
        from dataferry.schema import derive_split

        return await derive_split(source, dataset, where, parent=parent)
    raise ConfigError(f"{describe_source(source)} cannot filter by metadata: where= needs a store or data service")


async def _close_source(source, owned: bool) -> None:
    if owned:
        await source.close()


def _shutdown(lt: LoopThread, state: dict) -> None:
    run_task = state.get("task")
    if run_task is not None:
        lt.loop.call_soon_threadsafe(run_task.cancel)
    src = state.get("source")
    if src is not None and lt.loop.is_running():
        try:
            lt.call(_close_source(*src), timeout=10)
        except Exception:  # noqa: BLE001 - closing is best effort
            log.exception("closing the loader's source failed")
    lt.stop()


class Loader:
    """Stream batches of ``dataset`` from ``source`` (a SampleSource or a URL).

    ``source`` may be a :class:`~dataferry.schema.SampleSource` (not owned),
    a store URL (``sqlite:...``, ``cassandra://...``) or data service URL
    (``http(s)://...``), or an async factory returning a source (for sources
    bound to the engine's event loop); the loader opens the last three on its
    loop and closes them. For a data service URL only: ``token`` is the bearer
    token, or ``token_file`` holds it, one a line as the server's own file (the
    first is sent, and the file is read again when the service refuses it: a
    rotation); a token refused for good is ``TokenRefused`` at once, never
    retried. ``ca_file`` is the PEM bundle that verifies an ``https://``
    service's certificate (default: the system's CAs); ``http`` sets the rest
    of how it is read (:class:`HttpOptions`: connections, timeouts, ``verify``).
    ``where`` (a metadata filter: ``dataferry/schema/_filter.py``) reads the
    derived split of ``split``'s samples that match it, made or reused (same
    filter over unchanged data) on the fly, by the data service or over the
    store's metadata; ``derived`` is its record. ``state_dict()`` keeps the
    split's name and content hash, and ``load_state_dict`` refuses a split
    whose content changed.
    The epoch's ids come from ``ids`` when given, else from the source's
    ``read_split(dataset, split)``. Every interval (``log_interval``
    seconds, else 10) the loader names what limited it: the link, the
    service, decode or the consumer (``_attribution.py``); ``intervals()``
    returns the recent ones, and with ``log_interval`` each is logged as one
    line to the ``dataferry.client`` logger. ``stats()`` returns the
    figures since the first ``get()`` at any time.
    """

    def __init__(
        self,
        source: SampleSource | str,
        dataset: str,
        *,
        split: str = ALL_SPLIT,
        ids: IdList | None = None,
        where: str | None = None,
        batch_size: int = 256,
        drop_last: bool = False,
        order: Literal["completion", "input"] = "completion",
        plan: PlanOptions = PlanOptions(),
        prefetch: Prefetch = Prefetch(),
        retry: Retry = Retry(),
        hedge: Hedge = Hedge(),
        errors: ErrorPolicy = ErrorPolicy(),
        epoch: int = 0,
        log_interval: float | None = None,
        token: str | None = None,
        token_file: str | None = None,
        ca_file: str | None = None,
        http: HttpOptions | None = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, not {batch_size}")
        if log_interval is not None and log_interval <= 0:
            raise ConfigError(f"log_interval must be > 0 seconds, not {log_interval}")
        service = dict(token=token, token_file=token_file, ca_file=ca_file, http=http)
        if isinstance(source, str) or any(v is not None for v in service.values()):
            # the one URL dispatcher; verify off: a service is asked for no checksums either
            source = source_factory(source, create=False, checksums=errors.verify, **service)
        if order not in ("completion", "input"):
            raise ConfigError(f"order must be 'completion' or 'input', not {order!r}")
        if ids is None and hasattr(source, "fetch") and not hasattr(source, "read_split"):
            raise ConfigError("this source has no catalog: pass ids=IdList(...)")
        if where is not None:
            if ids is not None:
                raise ConfigError("pass ids= or where=, not both")
            from dataferry.schema import parse_filter

            parse_filter(where)  # a bad filter fails here, before any connection
        self._dataset, self._split = dataset, split
        self._batch_size, self._drop_last, self._order = batch_size, drop_last, order
        self._plan_options, self._prefetch, self._retry, self._hedge, self._errors = plan, prefetch, retry, hedge, errors
        self._epoch = epoch
        self._claimed = epoch  # the epoch the next iter() walks
        self._ids = ids
        self._split_hash: str | None = None  # content_hash of the id list read
        self._digest: str | None = None  # its split_digest, which every epoch's plan carries
        self._counters = Counters()  # written on the engine's loop
        self._taken = Taken()  # written by the consumer's thread
        self._link = Link(prefetch, hedge)
        self._queue: queue.Queue = queue.Queue()
        self._gen = 0  # generation of the running epoch; stale queue items are dropped
        self._plan: EpochPlan | None = None
        self._delivered: DoneSet | None = None
        self._run: Run | None = None
        self._closed = False
        self._lt = LoopThread("dataferry-engine")
        self._cpu = EngineCpu(self._lt.thread)
        self._state: dict = {}
        self._finalizer = weakref.finalize(self, _shutdown, self._lt, self._state)
        try:
            self._source, owned = self._lt.call(_open_source(source))
        except BaseException:
            self._finalizer()
            raise
        self._state["source"] = (self._source, owned)
        #: the derived split read, when ``where`` was given (its record)
        self.derived = None
        if where is not None:
            try:
                self.derived = self._lt.call(_derive(self._source, dataset, where, split))
            except BaseException:
                self._finalizer()
                raise
            self._split = self.derived.name
        self._attributor = Attributor()
        self._lt.loop.call_soon_threadsafe(
            _every_interval, weakref.ref(self), self._lt.loop, log_interval or DEFAULT_INTERVAL, log_interval is not None)

    def _tick(self, log_it: bool) -> None:
        """On the loop, every interval once the consumer has asked for data:
        attribute the interval, and log it."""
        if self._taken.first is None:
            return
        iv = self._attributor.tick(self.stats())
        if log_it:
            log.info("%s: %s", self.dataset, iv)

    def intervals(self) -> tuple[Interval, ...]:
        """The recent intervals (oldest first, up to an hour's worth at 10 s),
        each with its figures and what limited it."""
        return self._attributor.history

    # --- options (read-only: a new option means a new Loader) ----------------------------
    dataset = property(lambda self: self._dataset, doc="the dataset's name")
    split = property(lambda self: self._split, doc="the split read")
    batch_size = property(lambda self: self._batch_size)
    drop_last = property(lambda self: self._drop_last)
    order = property(lambda self: self._order, doc='"completion" or "input"')
    plan_options = property(lambda self: self._plan_options)
    prefetch = property(lambda self: self._prefetch)
    retry = property(lambda self: self._retry)
    hedge = property(lambda self: self._hedge)
    errors = property(lambda self: self._errors)

    @property
    def epoch(self) -> int:
        """The epoch the consumer is on (``set_epoch`` or ``load_state_dict`` move it)."""
        return self._epoch

    # --- epochs ------------------------------------------------------------------
    def _idlist(self) -> IdList:
        if self._ids is None:
            src, what = self._source, f"the id list of split {self.split!r} of dataset {self.dataset!r}"
            self._ids = self._lt.call(
                retrying(lambda: src.read_split(self.dataset, self.split), self.retry, what, describe_source(src))
            )
        if self._split_hash is None:
            self._split_hash, self._digest = content_hash(self._ids), split_digest(self._ids)
        return self._ids

    def _plan_for(self, epoch: int) -> EpochPlan:
        if self._plan is None or self._plan.epoch != epoch:
            self._plan = self._make_plan(epoch)
        return self._plan

    def _make_plan(self, epoch: int) -> EpochPlan:  # (an engine process's shard of the plan: _subprocess.py)
        return make_plan(self._idlist(), epoch, self.plan_options, digest=self._digest)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        # every epoch's plan is as long: any plan made will do
        plan = self._plan if self._plan is not None else self._plan_for(self.epoch)
        n = plan.next_len if isinstance(plan, DealtPlan) and plan.epoch != self.epoch else len(plan)  # re-dealt: its own
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` starts ``epoch`` from its beginning."""
        self._move_to(epoch)
        self._claimed = epoch

    def _move_to(self, epoch: int) -> None:
        self._stop_run()
        self._epoch = epoch
        self._delivered = None

    def _stop_run(self) -> None:
        self._gen += 1
        task = self._state.pop("task", None)
        if task is not None:
            self._lt.loop.call_soon_threadsafe(task.cancel)
        self._run = None

    def _begin_run(self) -> EpochPlan:
        """Before a run starts (here or in an engine process): the loader is open, the last run
        stopped, the delivered set sized to this epoch's plan; that plan."""
        if self._closed:
            raise DataferryError("loader is closed")
        self._stop_run()
        plan = self._plan_for(self.epoch)
        if self._delivered is None or self._delivered.n != len(plan):
            self._delivered = DoneSet(len(plan))
        return plan

    def _start_run(self) -> None:
        plan = self._begin_run()
        gen = self._gen
        q = self._queue

        def emit(item, gen=gen):
            q.put((gen, item))

        run = Run(
            self._source, self.dataset, plan,
            batch_size=self.batch_size, drop_last=self.drop_last, in_order=self.order == "input",
            prefetch=self.prefetch, retry=self.retry, hedge=self.hedge, errors=self.errors,
            counters=self._counters, emit=emit, done=self._delivered, link=self._link, next_plan=self._make_plan,
            waited=self._consumer_waited,
        )
        self._run = run

        async def main():
            try:
                await run.run()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                emit(_Failed(exc))

        fut = asyncio.run_coroutine_threadsafe(main(), self._lt.loop)
        self._state["task"] = _FutureTask(fut, self._lt.loop)

    # --- iteration -----------------------------------------------------------------
    def __iter__(self) -> LoaderEpoch:
        """A fresh iterator over the next epoch (the rest of it, after a resume)."""
        epoch = max(self._claimed, self._epoch)
        self._claimed = epoch + 1
        return LoaderEpoch(self, epoch)

    def get(self, timeout: float | None = None) -> Batch:
        """The next batch of the running epoch; StopIteration at its end (the
        next call goes on with the next epoch).

        Raises TimeoutError when no batch arrives within ``timeout`` seconds,
        and the engine's error (e.g. SampleFailed naming the sample) if it failed.
        """
        return self._take(self._epoch, True, timeout)

    def get_nowait(self) -> Batch:
        """The next batch of the running epoch if one is ready, else :class:`queue.Empty`."""
        return self._take(self._epoch, False, None)

    def _consumer_waited(self) -> float:
        """Seconds the consumer's thread has waited in :meth:`_take`, the wait going on now included
        (read on the engine's loop; ``time.monotonic``, the loop's clock)."""
        t = self._taken
        since = t.waiting_since
        return t.wait + (time.monotonic() - since if since is not None else 0.0)

    def _take(self, epoch: int, block: bool, timeout: float | None) -> Batch:
        if self._closed:
            raise DataferryError("loader is closed")
        if epoch < self._epoch:
            raise StopIteration  # that epoch is over (or was abandoned)
        if epoch > self._epoch:
            self._move_to(epoch)  # a later epoch's iterator started: the rest of this one is abandoned
        if self._run is None:
            self._start_run()
        q = self._queue
        t = self._taken
        if t.first is None:
            t.first = time.monotonic()
            self._cpu.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                gen, item = q.get_nowait()
            except queue.Empty:
                if not block:
                    raise
                t0 = t.waiting_since = time.monotonic()
                try:
                    gen, item = q.get(timeout=None if deadline is None else max(0.0, deadline - t0))
                except queue.Empty:
                    raise TimeoutError(f"no batch of {self.dataset!r} within {timeout} s") from None
                finally:
                    t.waiting_since = None
                    t.wait += time.monotonic() - t0
            if gen == self._gen:
                return self._accept(item)

    def _count_corrupt(self, epoch: int, skipped) -> None:
        """Of the positions the engine skipped, those skipped as corrupt (``Stats.corrupt``)."""
        t, marks = self._taken, self._run.corrupt_skips
        for p in skipped:
            sid = marks.pop((epoch, p), None)  # one dict op: safe against the engine's thread
            if sid is not None:
                t.corrupt += 1
                if len(t.corrupt_ids) < MAX_IDS:
                    t.corrupt_ids.append(sid)

    def _accept(self, item) -> Batch:
        run, delivered, t = self._run, self._delivered, self._taken
        if isinstance(item, Batch):
            self._lt.loop.call_soon_threadsafe(run.release, item.nbytes)
            delivered.add_many(item.positions)  # a batch's positions in numpy, not one add each
            for p in item.skipped:
                delivered.add(p)
            t.samples += len(item)
            t.batches += 1
            t.bytes += item.nbytes
            t.skipped += len(item.skipped)
            if item.skipped and run.corrupt_skips:
                self._count_corrupt(item.epoch, item.skipped)
            return item
        if isinstance(item, EndOfEpoch):
            # the run goes on into the next epoch, already prefetched
            for p in item.skipped:
                delivered.add(p)
            t.skipped += len(item.skipped)
            if item.skipped and run.corrupt_skips:
                self._count_corrupt(item.epoch, item.skipped)
            self._epoch += 1
            # the next epoch's plan is as long; the engine has made it (made here only when asked for)
            self._delivered = DoneSet(self._plan.next_len if isinstance(self._plan, DealtPlan) else delivered.n)
            self._lt.loop.call_soon_threadsafe(run.consumer_at, self._epoch)
            raise StopIteration
        self._stop_run()
        raise item.exc

    # --- resume ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What was delivered so far: enough to resume exactly (JSON-safe).

        Under torch.distributed it is a collective (every rank must call it, as
        for any DDP checkpoint): the state covers every rank's part of the epoch
        and resumes with any world size (``_elastic.py``)."""
        return gather(self._local_state())

    merge_states = staticmethod(merge_states)

    def _local_state(self) -> dict:
        plan = self._plan_for(self.epoch)
        done = self._delivered or DoneSet(len(plan))
        return {
            "version": _STATE_VERSION,
            "dataset": self.dataset,
            "split": self.split,
            "split_hash": self._split_hash,
            "epoch": self.epoch,
            "seed": plan.seed,
            "rank": plan.rank,
            "world_size": plan.world_size,
            "split_digest": plan.source_digest,
            "num_samples": len(plan),
            "frontier": done.frontier,
            "beyond": done.beyond(),
            **dealt_of(plan),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next iteration delivers exactly
        the samples of that epoch not delivered before it was taken."""
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(f"unsupported loader state version {state.get('version')!r}")
        self._stop_run()
        epoch = int(state["epoch"])
        ids = self._idlist()
        elastic = resume_plan(state, ids, self._plan_options, self._digest)
        plan = elastic[0] if elastic else self._make_plan(epoch)
        if state.get("dataset") == self.dataset and state.get("split") != self.split:
            raise ConfigError(f"loader state is for split {state.get('split')!r} of dataset {self.dataset!r}, "
                              f"this loader reads split {self.split!r}")
        saved = state.get("split_hash")
        if saved is not None and saved != self._split_hash:
            raise ConfigError(
                f"split {self.split!r} of dataset {self.dataset!r} changed since the state was saved (content "
                f"{saved}, now {self._split_hash}): resuming would mix two different id lists; "
                "start over with set_epoch(), or restore the split"
            )
        checks = {
            "dataset": self.dataset, "seed": plan.seed, "rank": plan.rank,
            "world_size": plan.world_size, "split_digest": plan.source_digest, "num_samples": len(plan),
        }
        if elastic:  # any rank and world size: checked by resume_plan
            checks = {k: checks[k] for k in ("dataset", "seed", "split_digest")}
        for key, mine in checks.items():
            if state.get(key) != mine:
                raise ConfigError(f"loader state does not match this loader: {key} is {state.get(key)!r}, not {mine!r}")
        self._epoch = self._claimed = epoch
        self._plan = plan
        self._delivered = elastic[1] if elastic else DoneSet(len(plan), int(state["frontier"]), state["beyond"])

    # --- stats and lifetime --------------------------------------------------------------
    def stats(self) -> Stats:
        run = self._run
        return snapshot(self._counters, self._taken, 0 if run is None else run.ready_bytes, self._cpu.seconds())

    # for an iterator that decodes this loader's batches (TorchIterator, DaliIterator, yours):
    # called from the thread that takes batches; the figures join stats() and the intervals
    @property
    def waited(self) -> float:
        """Seconds the thread taking batches has waited in ``get()`` so far (its waits that ended)."""
        return self._taken.wait

    def record_decode(self, *, wait: float = 0.0, busy: float = 0.0,
                      gauges: tuple[int, int, int] | None = None) -> None:
        """Add the training loop's seconds waiting on decode (``Stats.decode_wait``) and the decode
        threads' busy seconds (``decode_busy``); ``gauges``: decode threads, batches in the decode
        queue and its capacity, as of now (``decode_threads``, ``decode_queue``, ``decode_depth``)."""
        t = self._taken
        t.decode_wait += wait
        t.decode_busy += busy
        if gauges is not None:
            t.decode_threads, t.decode_queue, t.decode_depth = gauges

    def record_undecodable(self, sample_id: int) -> None:
        """A sample left out because it failed to decode (``ErrorPolicy`` skip): ``Stats.undecodable``."""
        t = self._taken
        t.undecodable += 1
        if len(t.undecodable_ids) < MAX_IDS:
            t.undecodable_ids.append(sample_id)

    def close(self) -> None:
        """Stop the engine, close an owned source, end the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_run()
        self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: seconds per attribution interval without log_interval
DEFAULT_INTERVAL = 10.0


def _every_interval(ref: weakref.ref, loop, interval: float, log_it: bool) -> None:
    """Tick ``ref()``'s loader every ``interval`` s until it is closed or
    collected (a weak reference: the timer does not keep the loader alive)."""
    loader = ref()
    if loader is None or loader._closed:
        return
    loader._tick(log_it)
    del loader
    loop.call_later(interval, _every_interval, ref, loop, interval, log_it)


class _FutureTask:
    """Cancel handle for a coroutine running on the loop thread."""

    def __init__(self, fut, loop) -> None:
        self._fut, self._loop = fut, loop

    def cancel(self) -> None:
        self._fut.cancel()


class LoaderEpoch:
    """One epoch of a :class:`Loader` (what ``iter(loader)`` returns).

    Iterate it, or take batches with :meth:`get` (blocking, with a timeout)
    and :meth:`get_nowait` (``queue.Empty`` when none is ready). It stops at
    the epoch's end, and stays stopped; a new ``iter(loader)`` walks the next
    epoch.
    """

    __slots__ = ("loader", "epoch", "_done", "_used")

    def __init__(self, loader: Loader, epoch: int) -> None:
        self.loader, self.epoch = loader, epoch
        self._done = self._used = False

    def __del__(self) -> None:
        # dropped before it was taken from (Lightning's iter() that checks an iterable): the epoch is given back
        loader = self.loader
        if not self._used and loader._claimed == self.epoch + 1 and loader._epoch <= self.epoch:
            loader._claimed = self.epoch

    def __iter__(self) -> LoaderEpoch:
        return self

    def __next__(self) -> Batch:
        return self.get()

    def get(self, timeout: float | None = None) -> Batch:
        """The next batch; StopIteration at the epoch's end, TimeoutError after ``timeout`` s."""
        return self._take(True, timeout)

    def get_nowait(self) -> Batch:
        """The next batch if one is ready, else ``queue.Empty``; StopIteration at the end."""
        return self._take(False, None)

    def _take(self, block: bool, timeout: float | None) -> Batch:
        self._used = True
        if self._done:
            raise StopIteration
        try:
            return self.loader._take(self.epoch, block, timeout)
        except StopIteration:
            self._done = True
            raise

    def __len__(self) -> int:
        return len(self.loader)
