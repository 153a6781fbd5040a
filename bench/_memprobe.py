"""``dataferry serve`` with a memory probe in each worker (``server_memory --probe``).

    python -m dataferry.bench._memprobe [--trim] FOLDER <dataferry serve arguments>

Each forked worker starts ``tracemalloc`` (10 frames) and, on SIGUSR1, writes
``FOLDER/PID-N.txt`` (its Nth report): its RssAnon, what Python's allocations hold (traced), glibc's
``mallinfo2`` over every arena (bytes in use, bytes free but kept, mmapped
chunks), and the allocation sites that grew most since its second report;
``--trim``: then ``malloc_trim(0)`` and the RssAnon it gave back (the free
pages inside the arenas: what fragmentation holds; the next report shows how
fast load takes them again). A lab tool: tracing costs CPU and memory of its own.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import tracemalloc

__all__ = ["main"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> str:
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return "mallinfo2: not glibc 2.33+"
    fn.restype = _MallInfo2
    m = fn()
    mib = 2**20
    return (f"malloc: arenas {m.arena / mib:.1f} MiB (in use {m.uordblks / mib:.1f}, free but kept "
            f"{m.fordblks / mib:.1f} in {m.ordblks} chunks, trimmable at the top {m.keepcost / mib:.1f}), "
            f"mmapped chunks {m.hblkhd / mib:.1f} MiB in {m.hblks}")


def _rss_anon() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _install(folder: str, trim: bool) -> None:
    tracemalloc.start(10)
    reports = 0
    base: list[tracemalloc.Snapshot] = []

    def report(signum, frame) -> None:
        nonlocal reports
        reports += 1
        snap = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
        current, peak = tracemalloc.get_traced_memory()
        anon = _rss_anon()
        info = _mallinfo()
        lines = [f"worker {os.getpid()} report {reports}: RssAnon {anon:.1f} MiB; Python traced "
                 f"{current / 2**20:.1f} MiB (peak {peak / 2**20:.1f}); " + info]
        if trim:
            ctypes.CDLL(None).malloc_trim(0)
            lines.append(f"  malloc_trim(0) gave back {anon - _rss_anon():.1f} MiB of RssAnon")
        if reports == 2:
            base.append(snap)
        if base and reports > 2:
            diffs = snap.compare_to(base[0], "traceback")
            for d in diffs[:6]:
                if d.size_diff <= 0:
                    break
                where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in d.traceback[:6])
                lines.append(f"  {d.size_diff / 1024:+.0f} KiB ({d.count_diff:+d} blocks, now {d.size / 1024:.0f} KiB) "
                             f"{where}")
        path = os.path.join(folder, f"{os.getpid()}-{reports}.txt")
        with open(path + ".part", "w") as fh:
            fh.write("\n".join(lines) + "\n")
        os.replace(path + ".part", path)

    signal.signal(signal.SIGUSR1, report)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    trim = argv[0] == "--trim"
    folder, rest = argv[trim], argv[trim + 1:]
    parent = os.getpid()
    os.register_at_fork(after_in_child=lambda: os.getppid() == parent and _install(folder, trim))
    from dataferry.server.cli import main as serve

    return serve(rest)


if __name__ == "__main__":
    sys.exit(main())
