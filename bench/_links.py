"""The emulated link between the bench's loaders and its servers.

A link is told one :class:`Condition` at a time (RTT, loss, rate, jitter) and
gives back a *route*: ``route((host, port)) -> (host, port)``, the address a
loader dials to reach that server across the link.

* :class:`ProxyLink`: servers on loopback; per condition, one
  ``dataferry latency-proxy`` process per server, delaying every byte by
  RTT/2 each way. It runs in its own process so that its CPU is not counted as
  the client's and it does not share the client's GIL. It cannot drop
  packets: a loss above zero is not applicable (``unsupported``).
* :class:`NetemLink`: the topology of ``deploy/netem/`` (this process runs in
  ``PREFIX-cli``, servers are started in ``PREFIX-srv`` through ``wrap``);
  each condition is applied to both veth ends with ``shape.sh``; routes are
  the servers' own addresses.

Both start the development Cassandra for the CQL path (:meth:`cassandra`).
``python -m dataferry.bench._links cassandra --host H`` is the server-side
half for netem: Cassandra 1.2 listens on its namespace's loopback only, so a
plain forwarder (the latency proxy with no delay) exposes it on ``H``.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ._common import announced, prepared_store

__all__ = ["Condition", "ProxyLink", "NetemLink", "NETEM_SCRIPTS"]

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


class ProxyLink:
    """Userspace delay through ``dataferry latency-proxy`` processes on loopback."""

    name = "proxy"
    host = "127.0.0.1"  # where servers listen
    wrap: tuple[str, ...] = ()  # how server commands are started

    def unsupported(self, cond: Condition) -> str | None:
        """Why ``cond`` cannot be emulated here, or None."""
        return "n/a: the proxy does not drop packets (loss needs netem)" if cond.loss_pct else None

    @contextlib.contextmanager
    def emulate(self, cond: Condition):
        with contextlib.ExitStack() as stack:
            proxies: dict[Address, Address] = {}

            def route(upstream: Address) -> Address:
                if upstream not in proxies:
                    cmd = [sys.executable, "-m", "dataferry.schema._cli", "latency-proxy",
                           "--listen", f"{self.host}:0", "--upstream", f"{upstream[0]}:{upstream[1]}",
                           "--delay", f"{cond.rtt_ms / 2:g}ms", "--jitter", f"{cond.jitter_ms:g}ms"]
                    if cond.rate:
                        cmd += ["--rate", cond.rate]
                    proxies[upstream] = stack.enter_context(announced(cmd, "the latency proxy"))
                return proxies[upstream]

            yield route

    def cassandra(self, images: int):
        """``(store url, (host, port))`` of a Cassandra 1.2 holding the bench dataset (a context manager)."""
        return _cassandra_on_loopback(images)


@contextlib.contextmanager
def _cassandra_on_loopback(images: int):
    with prepared_store("cassandra", images) as (url, address, _):
        yield url, address


class NetemLink:
    """Kernel shaping of the deploy/netem/ topology named ``prefix``; this process runs in its client namespace."""

    name = "netem"

    def __init__(self, prefix: str, subnet: str = "10.77.0") -> None:
        self.prefix = prefix
        self.host = f"{subnet}.1"
        self.wrap = ("ip", "netns", "exec", f"{prefix}-srv")

    def unsupported(self, cond: Condition) -> str | None:
        return None  # the caller checked for netem before building the topology

    @contextlib.contextmanager
    def emulate(self, cond: Condition):
        args = [str(NETEM_SCRIPTS / "shape.sh"), "--prefix", self.prefix]
        if cond.rtt_ms or cond.jitter_ms:
            args += ["--delay", f"{cond.rtt_ms / 2:g}ms", "--jitter", f"{cond.jitter_ms:g}ms"]
        if cond.loss_pct:
            args += ["--loss", f"{cond.loss_pct:g}%"]
        if cond.rate:
            args += ["--rate", cond.rate]
        subprocess.run(args, check=True, stderr=subprocess.DEVNULL)
        try:
            yield lambda upstream: upstream
        finally:
            subprocess.run(args[:3], check=True, stderr=subprocess.DEVNULL)  # unshaped again

    @contextlib.contextmanager
    def cassandra(self, images: int):
        cmd = [*self.wrap, sys.executable, "-m", "dataferry.bench._links", "cassandra", "--host", self.host]
        with announced(cmd, "Cassandra in the server namespace") as (host, port):
            url = f"cassandra://{host}:{port}/bench?protocol_version=1"
            with prepared_store("cassandra", images, store_url=url):  # schema and data over the unshaped veth
                yield url, (host, port)


def _serve_cassandra(host: str) -> int:
    """Cassandra 1.2 on loopback, forwarded from ``host``; until SIGTERM or SIGINT."""
    import signal

    from dataferry.client import LinkOptions, ProxyThread
    from dataferry.schema._devcassandra import DevCassandra

    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # before any thread starts: they inherit the mask
    with DevCassandra() as cass, ProxyThread((cass.host, cass.port), LinkOptions(), listen=(host, 0)) as fwd:
        print(f"cassandra listening on {fwd.address[0]}:{fwd.address[1]}", flush=True)
        signal.sigwait(stop)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m dataferry.bench._links")
    p.add_argument("role", choices=["cassandra"])
    p.add_argument("--host", required=True)
    sys.exit(_serve_cassandra(p.parse_args().host))
