"""The emulated link between the bench's loaders and its servers.

A link is told one :class:`Condition` at a time (RTT, loss, rate, jitter) and
gives back a *route*: ``route((host, port)) -> (host, port)``, the address a
loader dials to reach that server across the link.

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ._common import announced, prepared_store

__all__ = ["Condition", "ProxyLink", "NamespaceLink", "NETEM_SCRIPTS"]

#: deploy/netem/ of this checkout (the scripts are not installed with the package)
NETEM_SCRIPTS = Path(__file__).resolve().parent.parent / "deploy" / "netem"

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Condition:
    """One point of the sweep. Each direction gets RTT/2 of delay, varied within
    ± ``jitter_ms``, and the loss and the rate."""

    rtt_ms: float = 0.0
    loss_pct: float = 0.0
    rate: str | None = None  # tc-style: "1gbit", "100mbit"; None: unlimited
    jitter_ms: float = 0.0

    @property
    def rate_label(self) -> str:
        return self.rate or "unlimited"

    def describe(self) -> str:
        parts = [f"rtt {self.rtt_ms:g} ms", f"loss {self.loss_pct:g}%", f"rate {self.rate_label}"]
        if self.jitter_ms:
            parts.append(f"jitter {self.jitter_ms:g} ms")
        return ", ".join(parts)


@contextlib.contextmanager
def _proxies(cond: Condition, *, host: str, wrap: tuple[str, ...], rate: bool, window: str | None = None,
             processes: int = 1):
    """Yield a route that starts one latency proxy per upstream, listening on ``host``;
    ``window``: the proxies' ``--window`` (None: theirs, the kernel's tcp_rmem maximum);
    ``processes``: their ``--processes`` (each proxy relays in that many processes)."""
    with contextlib.ExitStack() as stack:
        proxies: dict[Address, Address] = {}

        def route(upstream: Address) -> Address:
            if upstream not in proxies:
                cmd = [*wrap, sys.executable, "-m", "dataferry.schema.cli", "latency-proxy",
                       "--listen", f"{host}:0", "--upstream", f"{upstream[0]}:{upstream[1]}",
                       "--delay", f"{cond.rtt_ms / 2:g}ms", "--jitter", f"{cond.jitter_ms:g}ms"]
                if rate and cond.rate:
                    cmd += ["--rate", cond.rate]
                if window is not None:
                    cmd += ["--window", window]
                if processes != 1:
                    cmd += ["--processes", str(processes)]
                proxies[upstream] = stack.enter_context(announced(cmd, "the latency proxy"))
            return proxies[upstream]

        yield route


def default_proxy_processes() -> int:
    """A quarter of the usable cores, 1 to 4: one Python relay costs about 100 us per 110 KB image with a
    delay (a core at ~10k images/s), under the 2+ GB/s a GPU job's 20k images/s of 110 KB need."""
    from dataferry.server._workers import default_workers

    return max(1, min(4, default_workers() // 4))


_NO_LOSS = "n/a: the latency proxy does not drop packets (loss needs --link netem)"


class ProxyLink:
    """Userspace delay through ``dataferry latency-proxy`` processes on loopback."""

    name = "proxy"
    host = "127.0.0.1"  # where servers listen
    wrap: tuple[str, ...] = ()  # how server commands are started

    def __init__(self, window: str | None = None, processes: int = 1) -> None:
        self.window = window  # the proxies' TCP window (latency-proxy --window); None: their default
        self.processes = processes  # latency-proxy --processes: one Python process relays ~1 GB/s at most

    def unsupported(self, cond: Condition) -> str | None:
        """Why ``cond`` cannot be emulated here, or None."""
        return _NO_LOSS if cond.loss_pct else None

    def emulate(self, cond: Condition):
        return _proxies(cond, host=self.host, wrap=self.wrap, rate=True, window=self.window, processes=self.processes)

    @contextlib.contextmanager
    def cassandra(self, images: int):
        """``(store url, (host, port))`` of a Cassandra 5.0 node holding the bench dataset."""
        with prepared_store("cassandra", images) as (url, address, _):
            yield url, address


class NamespaceLink:
    """The deploy/netem/ topology named ``prefix``; this process runs in its client namespace.

    ``netem=True``: kernel delay, jitter, loss and rate. ``netem=False``: a tbf
    rate on the veth, and the delay from latency proxies in the server namespace.
    """

    def __init__(self, prefix: str, *, netem: bool, subnet: str = "10.77.0") -> None:
        self.prefix = prefix
        self.netem = netem
        self.name = "netem" if netem else "veth"
        self.host = f"{subnet}.1"
        self.wrap = ("ip", "netns", "exec", f"{prefix}-srv")

    def unsupported(self, cond: Condition) -> str | None:
        return None if self.netem or not cond.loss_pct else _NO_LOSS

    @contextlib.contextmanager
    def emulate(self, cond: Condition):
        unshaped = [str(NETEM_SCRIPTS / "shape.sh"), "--prefix", self.prefix]
        args = list(unshaped)
        if self.netem and (cond.rtt_ms or cond.jitter_ms):
            args += ["--delay", f"{cond.rtt_ms / 2:g}ms", "--jitter", f"{cond.jitter_ms:g}ms"]
        if self.netem and cond.loss_pct:
            args += ["--loss", f"{cond.loss_pct:g}%"]
        if cond.rate:
            args += ["--rate", cond.rate]
        subprocess.run(args, check=True, stderr=subprocess.DEVNULL)
        try:
            if self.netem:
                yield lambda upstream: upstream
            else:
                with _proxies(cond, host=self.host, wrap=self.wrap, rate=False) as route:
                    yield route
        finally:
            subprocess.run(unshaped, check=True, stderr=subprocess.DEVNULL)

    @contextlib.contextmanager
    def cassandra(self, images: int):
        cmd = [*self.wrap, sys.executable, "-m", "dataferry.bench._links", "cassandra", "--host", self.host,
               "--images", str(images)]
        with announced(cmd, "Cassandra in the server namespace") as (host, port):
            yield f"cassandra://{host}:{port}/bench", (host, port)


def _serve_cassandra(host: str, images: int) -> int:
    """Cassandra 5.0 on loopback holding the bench dataset, forwarded from ``host``, until SIGTERM or SIGINT."""
    import signal
    import threading

    from ._latency_proxy import LinkOptions, ProxyThread

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with prepared_store("cassandra", images) as (_, upstream, _), \
            ProxyThread(upstream, LinkOptions(), listen=(host, 0)) as forwarder:
        print(f"cassandra listening on {forwarder.address[0]}:{forwarder.address[1]}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m dataferry.bench._links")
    p.add_argument("role", choices=["cassandra"])
    p.add_argument("--host", required=True)
    p.add_argument("--images", type=int, required=True)
    args = p.parse_args()
    sys.exit(_serve_cassandra(args.host, args.images))
