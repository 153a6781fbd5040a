"""Where a process's CPU goes, by thread: for the GPU runs, where py-spy may not be allowed.

:func:`thread_cpu` reads every thread's user + system CPU from Linux ``/proc/self/task``
and names it (the Python thread's name where there is one, else the OS's ``comm``);
:class:`Sampler` is a sampling profiler of the Python threads (``sys._current_frames``
every ``interval`` s) that counts, per thread, the innermost frame and the innermost
dataferry frame. Both describe this process only; the sampler holds the GIL briefly
at each sample, so runs measured for their rate are made without it.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

from ._common import stat_fields

__all__ = ["thread_cpu", "cpu_by_thread", "Sampler", "LineCounter"]

#: where dataferry's runtime packages live (an editable install's paths do not say "dataferry")
_OURS = tuple(os.path.dirname(__import__(f"dataferry.{p}", fromlist=["_"]).__file__) + os.sep
              for p in ("client", "schema", "server"))


def thread_cpu(unnamed: str | None = None) -> dict[int, tuple[str, float]]:
    """``{native thread id: (name, CPU seconds so far)}`` of this process's threads (Linux
    ``/proc/self/task``; empty elsewhere). The name is the Python thread's, else ``unnamed``,
    else the OS's ``comm``."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in tids:
        fields = stat_fields(f"/proc/self/task/{tid}/stat")
        if fields is None:  # the thread ended meanwhile
            continue
        name = names.get(int(tid)) or unnamed or _comm(tid)
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def _comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return tid


def cpu_by_thread(before: dict, after: dict, top: int = 10) -> list[tuple[str, float]]:
    """The CPU seconds each thread used between two :func:`thread_cpu` snapshots, the busiest first;
    threads with the same name (a pool) are added up as ``name xN``."""
    used = collections.defaultdict(float)
    count = collections.Counter()
    for tid, (name, cpu) in after.items():
        base = name.rstrip("0123456789_-") or name
        used[base] += cpu - before.get(tid, (name, 0.0))[1]
        count[base] += 1
    rows = sorted(used.items(), key=lambda kv: -kv[1])[:top]
    return [(f"{n} x{count[n]}" if count[n] > 1 else n, s) for n, s in rows]


class Sampler:
    """A sampling profiler of this process's Python threads; ``with Sampler() as s: ...; s.report()``."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.samples = 0
        self._leaf = collections.defaultdict(collections.Counter)  # thread -> "file:func" -> count
        self._ours = collections.defaultdict(collections.Counter)  # thread -> innermost dataferry frame
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                self._leaf[name][_where(frame)] += 1
                f = frame
                while f is not None and not f.f_code.co_filename.startswith(_OURS):
                    f = f.f_back
                self._ours[name][_where(f) if f is not None else "(no dataferry frame)"] += 1
            self.samples += 1

    def report(self, top: int = 12) -> str:
        lines = [f"{self.samples} samples every {self.interval * 1e3:g} ms of each Python thread "
                 "(a thread blocked in C or waiting shows where it waits)"]
        for name in sorted(self._leaf, key=lambda n: -sum(self._leaf[n].values())):
            total = sum(self._leaf[name].values())
            lines.append(f"\n## thread {name}: {total} samples\ninnermost frame:")
            lines += [f"  {c / total:6.1%}  {w}" for w, c in self._leaf[name].most_common(top)]
            lines.append("innermost dataferry frame:")
            lines += [f"  {c / total:6.1%}  {w}" for w, c in self._ours[name].most_common(top)]
        return "\n".join(lines) + "\n"


def _where(frame) -> str:
    code = frame.f_code
    path = code.co_filename
    short = "/".join(path.split("/")[-2:])
    return f"{short}:{frame.f_lineno} {code.co_name}"


class LineCounter:
    """The Python lines executed in dataferry's runtime packages, by function, in every
    thread started while it is installed (``threading.settrace``) and this one: a count that
    does not move with the machine's load, where CPU time does (``bench.client_cpu --lines``).
    Slows what it counts by 10x or more: count, then time separately."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.on = False

    def _call(self, frame, event, arg):
        if not self.on or not frame.f_code.co_filename.startswith(_OURS):
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line":
            code = frame.f_code
            self.counts[(code.co_filename.rsplit(os.sep, 2)[-2] + "/" + os.path.basename(code.co_filename),
                         code.co_qualname)] += 1
        return self._line

    def install(self) -> None:
        threading.settrace(self._call)
        sys.settrace(self._call)

    def remove(self) -> None:
        threading.settrace(None)  # type: ignore[arg-type]
        sys.settrace(None)

    def per(self, n: int, top: int = 15) -> list[tuple[str, float]]:
        """The ``top`` functions' lines per one of ``n`` (samples), and ``("all", total)`` first."""
        rows = [("all", sum(self.counts.values()) / n)]
        return rows + [(f"{f}:{q}", c / n) for (f, q), c in self.counts.most_common(top)]
