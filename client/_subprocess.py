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
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import weakref
from dataclasses import fields
from multiprocessing import shared_memory

import numpy as np

from dataferry.schema import ConfigError, DataferryError

from ._loader import Loader, _Failed
from ._options import PlanOptions
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


def _child_main(conn, shm_name: str, size: int, ppid: int) -> None:
    """The engine process: a Loader whose batches go into the arena."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_watch_parent, args=(ppid,), daemon=True).start()
    shm = _attach(shm_name)
    buf = np.frombuffer(shm.buf, np.uint8)
    buf[:] = 0  # every page made now, not on the first lap
    try:
        source, kwargs = conn.recv()
        loader = Loader(source, **kwargs)
    except EOFError:
        return
    except BaseException as exc:  # noqa: BLE001 - handed to the parent
        conn.send(("error", None, _sendable(exc)))
        return
    arena, counters = _Arena(size), loader._counters
    gen, it, last_stats = None, None, 0.0

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
                conn.send(("counters", {f.name: getattr(counters, f.name) for f in fields(counters)}))
                last_stats = now
            if it is None:
                continue
            try:
                b = it.get(timeout=0.05)
            except TimeoutError:
                continue
            except StopIteration:
                conn.send(("counters", {f.name: getattr(counters, f.name) for f in fields(counters)}))
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
                conn.send(("batch", gen, off, b.nbytes, lengths, b.ids, b.labels, b.targets, b.epoch,
                           b.positions, b.skipped))
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
    """The parent's end: sends (a lock; releases from any thread are queued and flushed),
    and the run's figures the Loader reads (``release``, ``ready_bytes``, ``corrupt_skips``)."""

    def __init__(self, conn) -> None:
        self.conn, self.lock = conn, threading.Lock()
        self.pending: collections.deque[int] = collections.deque()
        self.gen = 0
        self.ready_bytes = 0
        self.corrupt_skips: dict = {}
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

    def release(self, nbytes: int) -> None:
        self.ready_bytes -= nbytes

    def consumer_at(self, epoch: int) -> None:
        pass


def _pump(link: _Link, q, buf: memoryview, counters, proc) -> None:
    """The parent's reader: descriptors become Batches of views into the arena."""
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
                q.put((link.gen, _Failed(DataferryError(f"the loader's engine process (pid {proc.pid}) {how}"))))
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
            link.ready_bytes += nbytes
            q.put((gen, Batch(ids, labels, data, targets, epoch, positions, nbytes, skipped)))
        elif kind == "end":
            q.put((msg[1], EndOfEpoch(msg[2])))
        elif kind == "error":
            q.put((link.gen if msg[1] is None else msg[1], _Failed(msg[2])))
        elif kind == "counters":
            for k, v in msg[1].items():
                setattr(counters, k, v)


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


class ProcessLoader(Loader):
    """A :class:`Loader` whose engine runs in a child process (off the training process's GIL).

    Same arguments and behaviour, plus ``arena_bytes``: the shared memory batches are handed
    over in (default 128 MiB; memory is the engine's byte budget plus it); a batch's bytes go back to the child
    when its last view is dropped, so holding batches holds the arena. ``source`` must be a
    URL (the child opens it again; a token goes over the pipe, never argv or the environment).
    """

    def __init__(self, source: str, dataset: str, *, arena_bytes: int | None = None, **kwargs) -> None:
        if not isinstance(source, str):
            raise ConfigError("ProcessLoader needs a store or service URL: a source object cannot go to "
                              "another process (use Loader)")
        if arena_bytes is not None and arena_bytes < 1 << 16:
            raise ConfigError(f"arena_bytes must be at least 64 KiB, not {arena_bytes}")
        super().__init__(source, dataset, **kwargs)
        self._arena_bytes = arena_bytes or DEFAULT_ARENA
        keep = ("ids", "batch_size", "drop_last", "order", "prefetch", "retry", "hedge", "errors",
                "token", "token_file", "ca_file", "http")
        self._child_args = (source, {"dataset": dataset, "split": self.split,
                                     **{k: v for k, v in kwargs.items() if k in keep}})
        self._child = None

    def _ensure_child(self) -> None:
        if self._child is not None:
            return
        plan = self._plan_for(self.epoch)
        o = self.plan_options
        args = self._child_args[1] | {
            "plan": PlanOptions(seed=o.seed, shuffle=o.shuffle, rank=plan.rank, world_size=plan.world_size,
                                uneven=o.uneven)}
        ctx = mp.get_context("spawn")
        shm = shared_memory.SharedMemory(create=True, size=self._arena_bytes)
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_child_main, args=(theirs, shm.name, self._arena_bytes, os.getpid()),
                           name="dataferry-engine", daemon=True)
        try:
            proc.start()
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        theirs.close()
        link = _Link(mine)
        link.send((self._child_args[0], args))
        link.ready_bytes = 0
        thread = threading.Thread(target=_pump, args=(link, self._queue, shm.buf,
                                                      self._counters, proc), name="dataferry-pump", daemon=True)
        thread.start()
        self._child = (link, proc)
        self._child_stop = weakref.finalize(self, _stop_child, link, proc, shm, thread)

    @property
    def engine_pid(self) -> int | None:
        """The engine process's pid (None before the first ``get()``)."""
        return None if self._child is None else self._child[1].pid

    def _start_run(self) -> None:
        self._begin_run()
        self._ensure_child()
        link = self._child[0]
        link.gen = self._gen
        link.ready_bytes = 0
        link.send(("start", self._gen, self._local_state()))
        self._run = link

    def close(self) -> None:
        """Stop the engine process and free the arena, then close as a Loader. Idempotent."""
        if self._child is not None:
            self._child_stop()
        super().close()
