"""``dataferry serve --workers N``: N processes on one port, one supervising parent.

The parent binds the port (once without ``SO_REUSEPORT``, so a port in use
fails as for one worker), then one ``SO_REUSEPORT`` socket per worker (or one
shared socket without it), forks the workers and watches them. Each worker is
a whole single-process server. A worker that fails before serving stops the
server (exit 1); one that dies while serving is replaced on the same socket,
up to :data:`MAX_RESTARTS` deaths within :data:`RESTART_WINDOW` seconds; one
whose loop has not beaten (every :data:`BEAT_EVERY` s, into memory the parent
reads) for ``timeout`` seconds is frozen, killed and so replaced, and its
socket's queued connections are answered by the next. SIGTERM/SIGINT to the
parent reaches every worker, which finishes its responses within ``--grace``;
workers die with the parent (``PR_SET_PDEATHSIG``). ``/metrics`` sums all
workers (``_metrics.py``). The rules in full: README.md, Workers.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable

__all__ = ["default_workers", "bind_shared", "supervise", "MAX_RESTARTS", "RESTART_WINDOW", "BEAT_EVERY"]

log = logging.getLogger("dataferry.server")

#: a worker's exit status when it failed before serving (the store would not open)
EXIT_NOT_STARTED = 3
#: more worker deaths than this within RESTART_WINDOW seconds stop the server
MAX_RESTARTS = 5
RESTART_WINDOW = 60.0
#: seconds between a serving worker's beats (and between the parent's looks at them)
BEAT_EVERY = 1.0
_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}
_PR_SET_PDEATHSIG = 1


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def bind_shared(host: str, port: int, count: int, bind: Callable[..., socket.socket]) -> list[socket.socket]:
    """``count`` listening sockets on one address: one per worker with
    ``SO_REUSEPORT``, else one socket for all. ``bind(host, port, reuse_port=)``
    makes one. The port is first taken without ``SO_REUSEPORT``, so a port in
    use by anyone (another dataferry server included) fails here."""
    probe = bind(host, port, reuse_port=False)
    port = probe.getsockname()[1]
    if not hasattr(socket, "SO_REUSEPORT"):
        return [probe]
    probe.close()
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            socks.append(bind(host, port, reuse_port=True))
    except OSError:
        for s in socks:
            s.close()
        if socks:
            raise
        return [bind(host, port, reuse_port=False)]  # SO_REUSEPORT refused: one shared socket
    return socks


def supervise(count: int, socks: list[socket.socket], serve: Callable[[socket.socket, str, Callable[[], None]], int],
              *, timeout: float = 0.0) -> int:
    """Fork ``count`` workers, each running ``serve(sock, metrics_dir, beat)``
    (its return value is its exit status; it calls ``beat()`` from its loop
    every :data:`BEAT_EVERY` seconds once serving); supervise them as the
    module docstring says, killing one whose last beat is ``timeout`` seconds
    old (0: never); return the server's exit status."""
    metrics_dir = tempfile.mkdtemp(prefix="dataferry-metrics-")
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    old_chld = signal.signal(signal.SIGCHLD, lambda *_: None)  # queued for sigtimedwait, never run
    # one monotonic time per slot, shared with the forked workers (0: not serving yet)
    beats = memoryview(mmap.mmap(-1, 8 * count)).cast("d")
    workers: dict[int, int] = {}  # pid -> slot
    deaths: deque[float] = deque()
    status = 0
    stopping = False

    def start(slot: int) -> None:
        sock = socks[slot % len(socks)]
        parent = os.getpid()
        beats[slot] = 0.0

        def beat() -> None:
            beats[slot] = time.monotonic()

        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            code = 1
            try:
                signal.signal(signal.SIGCHLD, old_chld)
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                _die_with(parent)
                for s in socks:
                    if s is not sock:
                        s.close()
                code = serve(sock, metrics_dir, beat)
            except BaseException:  # noqa: BLE001 - a worker reports and exits; it never unwinds into the parent
                log.exception("worker %d failed", os.getpid())
            finally:
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        workers[pid] = slot

    def stop_all() -> None:
        nonlocal stopping
        stopping = True
        for sock in socks:  # the workers close theirs: new connections are refused, not queued
            sock.close()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    try:
        for slot in range(count):
            start(slot)
        while workers:
            info = signal.sigtimedwait(_SIGNALS, BEAT_EVERY)
            if timeout:  # stopping too: a frozen worker never handles its SIGTERM, and the parent waited for good
                _kill_frozen(workers, beats, timeout)
            if info is None:
                continue
            if info.si_signo in (signal.SIGTERM, signal.SIGINT) and not stopping:
                log.info("stopping %d workers (signal %d)", len(workers), info.si_signo)
                stop_all()
            for pid, code in _reap():
                slot = workers.pop(pid)
                _forget(pid, metrics_dir)
                if stopping:
                    if code != 0:
                        log.warning("worker %d %s while stopping", pid, _describe(code))
                        status = 1
                    continue
                if code == EXIT_NOT_STARTED:
                    log.error("worker %d could not start; stopping the server", pid)
                    status = 1
                    stop_all()
                    continue
                now = time.monotonic()
                deaths.append(now)
                while deaths and deaths[0] < now - RESTART_WINDOW:
                    deaths.popleft()
                if len(deaths) > MAX_RESTARTS:
                    log.error("worker %d %s: %d worker deaths within %g s; stopping the server", pid,
                              _describe(code), len(deaths), RESTART_WINDOW)
                    status = 1
                    stop_all()
                    continue
                log.warning("worker %d %s; starting another", pid, _describe(code))
                start(slot)
    finally:
        stop_all()
        for pid in list(workers):
            os.waitpid(pid, 0)
        signal.signal(signal.SIGCHLD, old_chld)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return int(status)


def _kill_frozen(workers: dict[int, int], beats: memoryview, timeout: float) -> None:
    """SIGKILL each serving worker whose loop last beat ``timeout`` seconds ago or more (its death is
    then handled as any other: a replacement on its socket, counted against the crash-loop limit)."""
    now = time.monotonic()
    for pid, slot in workers.items():
        last = beats[slot]
        if last and now - last >= timeout:
            log.error("worker %d has not run its loop for %.0f s (frozen); killing it", pid, now - last)
            beats[slot] = 0.0  # once
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _reap() -> list[tuple[int, int]]:
    """Every worker that has ended: ``(pid, exit status or -signal)``."""
    out = []
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, os.waitstatus_to_exitcode(raw)))


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _forget(pid: int, metrics_dir: str) -> None:
    """A dead worker's live gauges leave the sums (its counters stay)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, metrics_dir)


def _die_with(parent: int) -> None:
    """SIGKILL this process when the parent dies (Linux); exit now if it already has."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: a worker outlives a parent killed with SIGKILL
    if os.getppid() != parent:
        os._exit(1)
