"""``ProcessLoader``: the engine in a child process, batches handed over in shared memory.

The child (spawned, never forked) runs a plain :class:`Loader` over the same URL and options;
it copies each batch's bytes into a shared-memory arena (``_Arena``, bounded by
``arena_bytes``) and sends a small descriptor (offset, lengths, ids, labels, plan positions)
over a pipe. The parent's ``Batch.data`` are numpy views into the arena (no copy); a batch's
region goes back to the child when the last of its views is dropped. Exact-once, resume and
``state_dict()`` stay in the parent (the consumer's ``DoneSet``): each run starts the child
from the parent's state. The child's engine figures reach ``stats()`` every ``STATS_EVERY`` s.
Memory: the child's byte budget plus the arena. The parent dies -> the child exits within a
fraction of a second (it watches its parent); the child dies -> the parent's ``get()`` raises
at once. Only a URL can go to a child: a source object stays in-process (ConfigError).
``engines=N``: N children, child i fetching plan positions i, i+N, ... (``_Shard``; positions stay
the parent's), ``_Merge`` makes their batches one stream with one end per epoch.
"""

from __future__ import annotations

import collections
import logging
import math
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import weakref
from dataclasses import fields, replace
from multiprocessing import shared_memory

import numpy as np

from dataferry.schema import ConfigError, DataferryError

from ._elastic import DealtPlan
from ._hardware import usable_cores
from ._loader import Loader, _Failed
from ._options import PlanOptions
from ._stats import EngineCpu
from ._types import Batch, EndOfEpoch

__all__ = ["ProcessLoader"]

log = logging.getLogger("dataferry.client")

#: seconds between the child's engine figures sent to the parent
STATS_EVERY = 0.5
#: the arena without ``arena_bytes``: the batches between the child's engine and the consumer (the
#: engine's own budget holds the rest); small, and touched once at the start (a page's first touch
#: is a fault: tens of us per 110 KB sample on the first lap round a large arena)
DEFAULT_ARENA = 128 << 20


class _Arena:
    """A ring of regions in a buffer of ``size`` bytes, allocated in order, freed in any order
    (space comes back once every older region is freed too)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.live: collections.deque[list] = collections.deque()  # [offset, nbytes, freed]
        self.by_offset: dict[int, list] = {}
        self.tail = 0  # where the newest region ends

    def alloc(self, n: int) -> int | None:
        """The offset of ``n`` free bytes, or None until older regions are freed."""
        if n > self.size:
            raise ConfigError(f"a batch of {n} bytes does not fit the shared-memory arena of {self.size} bytes: "
                              "raise arena_bytes (or Prefetch.max_bytes)")
        if not self.live:
            off = 0
        else:
            head = self.live[0][0]
            if self.tail > head:  # free: [tail, size) then [0, head)
                off = self.tail if self.size - self.tail >= n else (0 if n < head else None)
            else:  # wrapped: free is [tail, head)
                off = self.tail if head - self.tail > n else None
        if off is None:
            return None
        entry = [off, n, False]
        self.live.append(entry)
        self.by_offset[off] = entry
        self.tail = off + n
        return off

    def free(self, off: int) -> None:
        entry = self.by_offset.pop(off, None)
        if entry is None:
            return
        entry[2] = True
        while self.live and self.live[0][2]:
            self.live.popleft()

    @property
    def held(self) -> int:
        return sum(e[1] for e in self.live)


def _attach(name: str) -> shared_memory.SharedMemory:
    """Attach to the parent's segment without registering it with the resource tracker (the
    parent owns it: the tracker unlinks it if the parent dies)."""
    from multiprocessing import resource_tracker

    register = resource_tracker.register
    resource_tracker.register = lambda *a, **k: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def _watch_parent(ppid: int) -> None:
    while os.getppid() == ppid:
        time.sleep(0.1)
    os._exit(0)  # the parent is gone: no orphan


def _sendable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception that does not survive pickling goes as its message
        return DataferryError(f"{type(exc).__name__}: {exc}")


class _Shard(Loader):
    """An engine process's Loader over plan positions ``index``, ``index + count``, ... of every
    epoch (its positions ``j`` are the parent's ``index + j * count``)."""

    def __init__(self, source, *, shard: tuple[int, int], **kwargs) -> None:
        self._shard = shard
        super().__init__(source, **kwargs)

    def _make_plan(self, epoch: int):
        plan = super()._make_plan(epoch)
        index, count = self._shard
        return replace(plan, order=np.ascontiguousarray(plan.order[index::count]))


def _shard_state(state: dict, index: int, count: int) -> dict:
    """The parent's ``_local_state()`` as shard ``index`` of ``count`` sees it (its own positions)."""
    n, frontier = int(state["num_samples"]), int(state["frontier"])
    own = len(range(index, n, count))
    below = max(0, -(-(frontier - index) // count))  # its positions under the parent's frontier
    beyond = [(p - index) // count for p in state["beyond"] if p % count == index]
    return state | {"num_samples": own, "frontier": min(below, own), "beyond": beyond}


def _child_main(conn, shm_name: str, size: int, ppid: int, shard: tuple[int, int] = (0, 1)) -> None:
    """The engine process: a Loader (shard ``index`` of ``count``) whose batches go into the arena."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_watch_parent, args=(ppid,), daemon=True).start()
    shm = _attach(shm_name)
    buf = np.frombuffer(shm.buf, np.uint8)
    buf[:] = 0  # every page made now, not on the first lap
    try:
        msg = conn.recv()  # spawned with the loader: the first get() sends what to open
        if msg[0] != "init":
            return  # closed before its first get()
        _, source, kwargs = msg
        index, count = shard
        loader = _Shard(source, shard=shard, **kwargs) if count > 1 else Loader(source, **kwargs)
    except EOFError:
        return
    except BaseException as exc:  # noqa: BLE001 - handed to the parent
        conn.send(("error", None, _sendable(exc)))
        return
    arena, counters = _Arena(size), loader._counters
    gen, it, last_stats = None, None, 0.0

    def figures() -> dict:  # the engine's figures as stats() has them (its thread's CPU included)
        st = loader.stats()
        return {f.name: getattr(st, f.name) for f in fields(counters)}

    def handle(msg) -> bool:
        nonlocal gen, it
        kind = msg[0]
        if kind == "release":
            for off in msg[1]:
                arena.free(off)
        elif kind == "start":
            gen = msg[1]
            loader.load_state_dict(msg[2])
            it = iter(loader)
            return True
        elif kind == "stop":
            raise EOFError
        return False

    try:
        while True:
            while conn.poll(0 if it is not None else 0.2):
                msg = conn.recv()
                try:
                    handle(msg)
                except EOFError:
                    raise
                except BaseException as exc:  # noqa: BLE001 - a state the child's loader refuses
                    conn.send(("error", msg[1], _sendable(exc)))
                    it = None
            now = time.monotonic()
            if now - last_stats >= STATS_EVERY:
                conn.send(("counters", figures()))
                last_stats = now
            if it is None:
                continue
            try:
                b = it.get(timeout=0.05)
            except TimeoutError:
                continue
            except StopIteration:
                conn.send(("counters", figures()))
                conn.send(("end", gen, it.epoch))
                it = iter(loader)
                continue
            except BaseException as exc:  # noqa: BLE001 - handed to the parent
                conn.send(("error", gen, _sendable(exc)))
                it = None
                continue
            try:
                restarted = False
                off = arena.alloc(b.nbytes) if b.nbytes else -1
                while off is None and not restarted:
                    restarted = handle(conn.recv())
                    off = arena.alloc(b.nbytes)
                if restarted:
                    if off is not None and off >= 0:
                        arena.free(off)
                    continue
                lengths = np.fromiter((len(d) for d in b.data), np.int64, len(b.data))
                pos = off
                for d in b.data:
                    buf[pos:pos + len(d)] = d
                    pos += len(d)
                positions, skipped = b.positions, b.skipped
                if count > 1:  # the parent's positions
                    positions = np.asarray(positions, np.int64) * count + index
                    skipped = [p * count + index for p in skipped]
                conn.send(("batch", gen, off, b.nbytes, lengths, b.ids, b.labels, b.targets, b.epoch,
                           positions, skipped))
            except (EOFError, OSError):
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the parent (a batch larger than the arena)
                conn.send(("error", gen, _sendable(exc)))
                it = None
    except (EOFError, OSError, BrokenPipeError):
        pass
    finally:
        del buf
        loader.close()
        shm.close()


class _Link:
    """The parent's end of one engine process: sends (a lock; releases from any thread are
    queued and flushed)."""

    def __init__(self, conn) -> None:
        self.conn, self.lock = conn, threading.Lock()
        self.pending: collections.deque[int] = collections.deque()
        self.gen = 0
        self.closing = False

    def send(self, msg, block: bool = True) -> None:
        if not self.lock.acquire(blocking=block):
            return
        try:
            if msg is not None:
                self.conn.send(msg)
            while self.pending:
                offs = [self.pending.popleft() for _ in range(len(self.pending))]
                self.conn.send(("release", offs))
        except (OSError, BrokenPipeError, ValueError):
            pass  # the child is gone: the pump reports it
        finally:
            self.lock.release()

    def free(self, off: int) -> None:  # a batch's last view died (any thread, maybe inside the GC)
        self.pending.append(off)
        if not self.closing:
            self.send(None, block=False)

class _Group:
    """The engine processes as the Loader's run: the figures it reads (``release``, ``ready_bytes``,
    ``corrupt_skips``) and each engine's counters, combined into the Loader's."""

    def __init__(self, counters, engines: int) -> None:
        self.counters, self.shares = counters, [{} for _ in range(engines)]
        self.ready_bytes = 0
        self.corrupt_skips: dict = {}

    def release(self, nbytes: int) -> None:
        self.ready_bytes -= nbytes

    def consumer_at(self, epoch: int) -> None:
        pass

    def update(self, index: int, figures: dict) -> None:
        """Engine ``index``'s latest figures: counts, windows and budgets add up; the seconds a
        window or budget was full, or the engine's thread on CPU, are the most of any; latency is
        the mean, the floor the least."""
        self.shares[index] = figures
        shares = [d for d in self.shares if d]
        for k in figures:
            values = [d[k] for d in shares if d.get(k) is not None]
            if k == "request_latency":
                v = sum(values) / len(values) if values else None
            elif k == "min_latency":
                v = min(values, default=None)
            elif k in ("window_full", "budget_full", "engine_cpu"):
                v = max(values, default=0.0)
            else:
                v = sum(values)
            setattr(self.counters, k, v)


class _Merge:
    """The engines' items as one stream for the consumer's queue: an epoch ends once every engine
    has ended it, and what an engine sends of a later epoch waits until then (its arena bounds it)."""

    def __init__(self, q, engines: int) -> None:
        self.q, self.engines, self.lock = q, engines, threading.Lock()
        self.gen, self.epoch, self.ends, self.held = None, 0, 0, []

    def start(self, gen: int, epoch: int) -> None:
        with self.lock:
            self.gen, self.epoch, self.ends, self.held = gen, epoch, 0, []

    def put(self, gen: int, item) -> None:
        if self.engines == 1:
            self.q.put((gen, item))
            return
        with self.lock:
            self._put(gen, item)

    def _put(self, gen: int, item) -> None:
        if gen != self.gen or not isinstance(item, (Batch, EndOfEpoch)):
            self.q.put((gen, item))  # an error now; an old run's item, which the consumer drops
        elif item.epoch > self.epoch:
            self.held.append(item)
        elif isinstance(item, Batch):
            self.q.put((gen, item))
        else:
            self.ends += 1
            if self.ends == self.engines:
                self.q.put((gen, item))
                self.epoch, self.ends = self.epoch + 1, 0
                held, self.held = self.held, []
                for later in held:
                    self._put(gen, later)


def _pump(link: _Link, merge: _Merge, buf: memoryview, group: _Group, index: int, proc) -> None:
    """The parent's reader of one engine: descriptors become Batches of views into its arena."""
    conn = link.conn
    np.frombuffer(buf, np.uint8)[::4096].sum()  # map every page here too, once
    while True:
        try:
            if not conn.poll(0.1):
                if link.pending:
                    link.send(None)
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            if not link.closing:
                proc.join(1.0)
                code = proc.exitcode
                how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited (code {code})"
                merge.put(link.gen, _Failed(DataferryError(f"the loader's engine process (pid {proc.pid}) {how}")))
            return
        kind = msg[0]
        if kind == "batch":
            _, gen, off, nbytes, lengths, ids, labels, targets, epoch, positions, skipped = msg
            if nbytes:
                base = np.frombuffer(buf, np.uint8, nbytes, off)  # its own export: views of it die with it
                weakref.finalize(base, link.free, off)
                ends = np.cumsum(lengths).tolist()
                starts = [0, *ends[:-1]]
                data = [base[a:b] for a, b in zip(starts, ends)]
                del base
            else:
                data = [np.empty(0, np.uint8) for _ in lengths]
            group.ready_bytes += nbytes
            merge.put(gen, Batch(ids, labels, data, targets, epoch, positions, nbytes, skipped))
        elif kind == "end":
            merge.put(msg[1], EndOfEpoch(msg[2]))
        elif kind == "error":
            merge.put(link.gen if msg[1] is None else msg[1], _Failed(msg[2]))
        elif kind == "counters":
            group.update(index, msg[1])


def _stop_child(link: _Link, proc, shm, thread) -> None:
    link.closing = True
    link.send(("stop",))
    proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(2.0)
    try:
        link.conn.close()
    except OSError:
        pass
    if thread is not None:
        thread.join(2.0)
    try:
        shm.unlink()
    except FileNotFoundError:
        pass
    try:
        shm.close()
    except BufferError:  # batches still held: the mapping goes with their last view
        shm._buf = shm._mmap = None  # (so that SharedMemory.__del__ does not try again)
        os.close(shm._fd)
        shm._fd = -1


def default_engines() -> int:
    """A fifth of the usable cores, 1 to 3: on the 16-core GPU machine at 100 ms one engine gave
    8.8-9.6k images/s steady, two 16.9k, three 18.3-18.8k, four 18.0k (bench/results/gpu/README.md);
    on 2 cores one (a second process has no idle core to run on)."""
    return max(1, min(3, usable_cores() // 5))


class ProcessLoader(Loader):
    """A :class:`Loader` whose engine runs in a child process (off the training process's GIL).

    Same arguments and behaviour, plus ``arena_bytes``: the shared memory batches are handed
    over in (default 128 MiB; memory is the engine's byte budget plus it); a batch's bytes go back to the child
    when its last view is dropped, so holding batches holds the arena. ``source`` must be a
    URL (the child opens it again; a token goes over the pipe, never argv or the environment).
    ``engines``: engine processes, each fetching every ``engines``-th position of the plan over its
    own connections, for a link faster than one engine's thread receives (None: a fifth of the
    usable cores, 1 to 3, and 1 where ``drop_last`` or ``order="input"`` is asked); each has
    its own arena and ``1/engines`` of a fixed ``Prefetch.max_bytes`` (a budget that follows the
    link follows each one's share). An epoch then ends with up to ``engines`` short batches, so
    ``drop_last`` and ``order="input"`` need one engine; so does the epoch of an elastic resume.
    """

    def __init__(self, source: str, dataset: str, *, arena_bytes: int | None = None, engines: int | None = None,
                 **kwargs) -> None:
        if not isinstance(source, str):
            raise ConfigError("ProcessLoader needs a store or service URL: a source object cannot go to "
                              "another process (use Loader)")
        if arena_bytes is not None and arena_bytes < 1 << 16:
            raise ConfigError(f"arena_bytes must be at least 64 KiB, not {arena_bytes}")
        if engines is not None and (not isinstance(engines, int) or isinstance(engines, bool) or engines < 1):
            raise ConfigError(f"engines must be a whole number >= 1 (or None: by the cores), not {engines!r}")
        super().__init__(source, dataset, **kwargs)
        if engines is None:
            engines = 1 if self.drop_last or self.order == "input" else default_engines()
        if engines > 1 and (self.drop_last or self.order == "input"):
            raise ConfigError(f"engines={engines} ends each epoch with up to {engines} short batches and "
                              "interleaves the engines' samples: drop_last=True and order='input' need engines=1")
        self._arena_bytes = arena_bytes or DEFAULT_ARENA
        self._engines = engines
        keep = ("batch_size", "drop_last", "order", "prefetch", "retry", "hedge", "errors",
                "token", "token_file", "ca_file", "http")  # (and the id list, at the first run)
        child = {k: v for k, v in kwargs.items() if k in keep}
        budget = self.prefetch.max_bytes
        if engines > 1 and budget is not None:
            child["prefetch"] = replace(self.prefetch, max_bytes=max(1 << 16, budget // engines))
        self._child_args = (source, {"dataset": dataset, "split": self.split, **child})
        self._children: list = []  # (link, proc) of each engine process
        self._child_stops: list = []
        self._group = _Group(self._counters, engines)
        self._merge = _Merge(self._queue, engines)
        self._cpu = EngineCpu(None)  # the engines' thread CPU comes in their counters
        self._opened = False
        self._spawn()

    def __len__(self) -> int:
        if self._engines == 1:
            return super().__len__()
        n = len(self._plan if self._plan is not None else self._plan_for(self.epoch))
        return sum(math.ceil(len(range(i, n, self._engines)) / self.batch_size) for i in range(self._engines))

    def _spawn(self) -> None:
        """Start the engine processes now, with the loader: their start (the interpreter, imports, the
        arena's pages) goes on while the job builds the rest; what they open waits for the first run."""
        ctx = mp.get_context("spawn")
        try:
            for index in range(self._engines):
                shm = shared_memory.SharedMemory(create=True, size=self._arena_bytes)
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_child_main, name="dataferry-engine", daemon=True,
                                   args=(theirs, shm.name, self._arena_bytes, os.getpid(), (index, self._engines)))
                try:
                    proc.start()
                except BaseException:
                    shm.close()
                    shm.unlink()
                    raise
                theirs.close()
                link = _Link(mine)
                thread = threading.Thread(target=_pump, args=(link, self._merge, shm.buf, self._group, index, proc),
                                          name="dataferry-pump", daemon=True)
                thread.start()
                self._children.append((link, proc))
                self._child_stops.append(weakref.finalize(self, _stop_child, link, proc, shm, thread))
        except BaseException:
            self.close()  # the engines started so far, and the loader's own loop and source
            raise

    def _init_children(self) -> None:
        """At the first run: what each engine opens, with this rank's plan (resolved now, when
        torch.distributed is up, not when the loader was made) and the split's id list."""
        if self._opened:
            return
        plan = self._plan_for(self.epoch)
        o = self.plan_options
        args = self._child_args[1] | {
            "ids": self._idlist(),  # read once, here: not once more by each engine across the link
            "plan": PlanOptions(seed=o.seed, shuffle=o.shuffle, rank=plan.rank, world_size=plan.world_size,
                                uneven=o.uneven)}
        for link, _ in self._children:
            link.send(("init", self._child_args[0], args))
        self._opened = True

    @property
    def engines(self) -> int:
        """Engine processes this loader runs."""
        return self._engines

    @property
    def engine_pid(self) -> int:
        """The (first) engine process's pid."""
        return self.engine_pids[0]

    @property
    def engine_pids(self) -> list[int]:
        """Every engine process's pid."""
        return [proc.pid for _, proc in self._children]

    def _start_run(self) -> None:
        plan = self._begin_run()
        if self._engines > 1 and isinstance(plan, DealtPlan):
            raise ConfigError(f"the epoch of an elastic resume (a state saved under another world size) is "
                              f"dealt unevenly: finish it with engines=1, not {self._engines}")
        self._init_children()
        state = self._local_state()
        self._merge.start(self._gen, self._epoch)
        self._group.ready_bytes = 0
        for index, (link, _) in enumerate(self._children):
            link.gen = self._gen
            mine = state if self._engines == 1 else _shard_state(state, index, self._engines)
            link.send(("start", self._gen, mine))
        self._run = self._group

    def close(self) -> None:
        """Stop the engine processes and free the arenas, then close as a Loader. Idempotent."""
        for stop in self._child_stops:
            stop()
        super().close()
