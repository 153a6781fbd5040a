"""Helpers for the data service tests (no tests here).

The real app on loopback: :func:`serve` in the caller's event loop, and
:func:`live_server` in a background loop thread for blocking clients (a
Loader, urllib, raw sockets); both run it under the server's own ``Runner``,
as ``dataferry serve`` does. Test data in a real store (:func:`seed`,
:func:`seeded_db`), a response checker against ``server/openapi.yaml``
(:class:`Spec`), a frame decoder for raw bodies, a metrics parser, a
self-signed certificate, and :class:`BrokenStore`, a wrapper at the store seam
(which we own) that fails or hangs on demand. For the client's side: a
:class:`RawHttpServer` whose subclasses write hand-made answers byte by byte,
and :class:`ServerProcess`, ``python -m dataferry.server`` to kill and restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import functools
import ipaddress
import logging
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
from aiohttp import web
from openapi_schema_validator import OAS30Validator

from dataferry.schema import DatasetInfo, IdList, Sample, SampleMeta, SampleRecord, open_store
from dataferry.schema._aio import LoopThread
from dataferry.schema._errors import StoreUnavailable
from dataferry.schema._wire import read_frames
from dataferry.server._protocol import Runner

SPEC_PATH = Path(__file__).resolve().parent.parent / "server" / "openapi.yaml"

LABELS = ("cat", "dog", "eel")


def run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def serve(
    app: web.Application, *, ssl_context=None, host: str = "127.0.0.1", runner: type[web.AppRunner] = Runner,
    access_log: logging.Logger | None = None,
) -> AsyncIterator[str]:
    """Run ``app`` on a free loopback port; yield its base URL.

    ``runner`` is the server's own ``Runner`` (JSON answers to malformed HTTP,
    as under ``dataferry serve``); ``web.AppRunner`` embeds it the plain way."""
    run = runner(app, access_log=access_log, shutdown_timeout=1.0)
    await run.setup()
    try:
        site = web.TCPSite(run, host, 0, ssl_context=ssl_context, backlog=1024)
        await site.start()
        port = run.addresses[0][1]
        yield f"{'https' if ssl_context else 'http'}://{'localhost' if ssl_context else host}:{port}"
    finally:
        await run.cleanup()


@dataclass(frozen=True)
class Live:
    """A server running in a background loop thread."""

    base: str
    port: int
    app: web.Application
    #: the server's loop thread: ``loop.call(coro)`` runs a coroutine there
    loop: LoopThread


@contextlib.contextmanager
def live_server(
    build: Callable[[], web.Application | Awaitable[web.Application]], *, runner: type[web.AppRunner] = Runner,
    access_log: logging.Logger | None = None,
) -> Iterator[Live]:
    """The app that ``build()`` makes, built and served on loopback by an event
    loop in a background thread (``schema._aio.LoopThread``), so the caller's
    thread is free to block (a Loader, urllib, raw sockets). ``build`` runs in
    that loop; ``serve`` runs the app; both end with the block."""
    loop = LoopThread("test-server")
    stack = contextlib.AsyncExitStack()

    async def start() -> Live:
        app = build()
        if not isinstance(app, web.Application):
            app = await app
        base = await stack.enter_async_context(serve(app, runner=runner, access_log=access_log))
        return Live(base, int(base.rsplit(":", 1)[1]), app, loop)

    try:
        yield loop.call(start(), timeout=30)
    finally:
        try:
            loop.call(stack.aclose(), timeout=30)
        finally:
            loop.stop()


def make_samples(n: int, *, size: int = 2000, seed: int = 0) -> list[Sample]:
    """``n`` samples with ids spread over int64, and every kind of target:
    None, empty, and bytes."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.iinfo(np.int64).max, n, replace=False) * rng.choice([-1, 1], n)
    out = []
    for k, i in enumerate(ids.tolist()):
        data = rng.integers(0, 256, size + 37 * k, dtype=np.uint8).tobytes()
        target = (None, b"", bytes(rng.integers(0, 256, 5 + k, dtype=np.uint8)))[k % 3]
        out.append(Sample(int(i), k % len(LABELS), data, target))
    return out


def seeded_db(path: Path, dataset: str, samples: list[Sample], splits: dict[str, list[int]] | None = None) -> str:
    """A SQLite store at ``path`` holding ``dataset`` (see :func:`seed`); its URL."""
    return seed_url(f"sqlite://{path}", dataset, samples, splits)


def seed_url(url: str, dataset: str, samples: list[Sample], splits: dict[str, list[int]] | None = None) -> str:
    """:func:`seed` the store at ``url`` (opened and closed here); the URL."""

    async def go() -> None:
        async with await open_store(url) as store:
            await seed(store, dataset, samples, splits)

    run(go())
    return url


async def seed(store, dataset: str, samples: list[Sample], splits: dict[str, list[int]] | None = None) -> None:
    """Write ``samples``, the dataset row, ``all``, and ``splits`` (name -> sample indexes)."""
    recs = [
        SampleRecord(s, SampleMeta(s.id, s.label, f"{LABELS[s.label]}/{k}.jpg", "JPEG", 8, 8, len(s.data), "0" * 64))
        for k, s in enumerate(samples)
    ]
    await store.put_samples(dataset, recs)
    await store.put_dataset(DatasetInfo(dataset, LABELS, len(samples), dt.datetime(2024, 5, 1, tzinfo=dt.timezone.utc)))
    every = {"all": list(range(len(samples))), **(splits or {})}
    for name, idx in every.items():
        sel = [samples[k] for k in idx]
        await store.put_split(dataset, name, IdList([s.id for s in sel], [s.label for s in sel]))


def parse_metrics(text: str) -> dict[str, float]:
    """A /metrics scrape, parsed by prometheus-client's own parser, as
    ``{'name{label="value",...}': value}`` with the labels in name order
    (``name`` alone for a series without labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def decode(body: bytes, dataset: str) -> list:
    """The records of a complete batch fetch body (END/ERROR records included)."""
    reader = asyncio.StreamReader()
    reader.feed_data(body)
    reader.feed_eof()
    return [r async for r in read_frames(reader, dataset)]


# --- the OpenAPI document ----------------------------------------------------------------------
def _deref(node, root):
    if isinstance(node, dict):
        if "$ref" in node:
            target = root
            for part in node["$ref"].lstrip("#/").split("/"):
                target = target[part]
            return _deref(target, root)
        return {k: _deref(v, root) for k, v in node.items()}
    if isinstance(node, list):
        return [_deref(v, root) for v in node]
    return node


@functools.lru_cache(maxsize=1)
def spec_document() -> dict:
    return yaml.safe_load(SPEC_PATH.read_text())


class Spec:
    """Check a response against ``openapi.yaml``: documented status, media type, JSON schema."""

    def __init__(self) -> None:
        raw = spec_document()
        self.doc = _deref(copy.deepcopy(raw), raw)

    def check(self, method: str, template: str, status: int, content_type: str, body: bytes) -> None:
        op = self.doc["paths"][template][method.lower()]
        responses = op["responses"]
        assert str(status) in responses, f"{method} {template}: status {status} is not documented"
        content = responses[str(status)].get("content", {})
        ctype = content_type.split(";")[0].strip()
        assert ctype in content, f"{method} {template} {status}: media type {ctype!r} not in {sorted(content)}"
        if ctype == "application/json":
            import json

            OAS30Validator(content[ctype]["schema"]).validate(json.loads(body))


SPEC = Spec()


async def call(
    session: aiohttp.ClientSession, method: str, url: str, template: str | None = None, **kw
) -> tuple[int, dict, bytes]:
    """One request; the response is checked against the spec when ``template`` names its path."""
    async with session.request(method, url, **kw) as resp:
        body = await resp.read()
        if template is not None:
            SPEC.check(method, template, resp.status, resp.headers.get("Content-Type", ""), body)
        return resp.status, dict(resp.headers), body


# --- servers for the client's side --------------------------------------------------------------
class RawHttpServer:
    """A TCP server on loopback for hand-written answers: a subclass's
    ``handle(reader, writer)`` serves each connection (a cut request or a reset
    ends it quietly; the writer is closed after). ``async with`` yields the
    ``http://`` base URL; leaving the block ends the handlers still running."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    @staticmethod
    async def read_request(reader: asyncio.StreamReader) -> bytes:
        """The next request's head, its body (``Content-Length`` bytes) read and dropped."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = [int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")]
        await reader.readexactly(length[0] if length else 0)
        return head

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        try:
            await self.handle(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self._tasks: set[asyncio.Task] = set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()


@contextlib.contextmanager
def ended_after(make: Callable[..., Any], end: Callable[[Any], None]) -> Iterator[Callable[..., Any]]:
    """A fixture's factory of processes: ``start(*args)`` is ``make(*args)``,
    and each one made is ended with ``end`` when the block ends (the last
    first; the others still if one's ``end`` fails)."""
    with contextlib.ExitStack() as stack:

        def start(*args: Any) -> Any:
            made = make(*args)
            stack.callback(end, made)
            return made

        yield start


class ServerProcess:
    """``python -m dataferry.server`` on a fixed or free port."""

    def __init__(self, store_url: str, port: int = 0, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dataferry.server", "--store", store_url, "--port", str(port),
             "--no-access-log", "--log-level", "ERROR", *args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        line = self.proc.stdout.readline()
        assert "listening on" in line, line
        self.url = line.split()[-1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        """SIGKILL, and wait for it; safe to call again (a process that has ended is left alone)."""
        self.proc.send_signal(signal.SIGKILL)  # Popen sends nothing to a process it has reaped
        self.proc.wait(10)
        self.proc.stdout.close()


# --- TLS -----------------------------------------------------------------------------------------
def self_signed(folder: Path) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1; (cert, key) PEM paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


# --- a store that fails on demand ------------------------------------------------------------------
class BrokenStore:
    """Wrap a real store. ``fail_after``: fetch raises StoreUnavailable after
    that many results (0: before any). ``hang_after``: fetch hangs after that
    many. ``catalog``: "fail" or "hang" for list_datasets. ``yielded`` counts
    results handed out."""

    def __init__(self, inner, *, fail_after=None, hang_after=None, catalog=None) -> None:
        self.inner = inner
        self.url = getattr(inner, "url", "broken")
        self.fail_after, self.hang_after, self.catalog = fail_after, hang_after, catalog
        self.yielded = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def list_datasets(self):
        if self.catalog == "fail":
            raise StoreUnavailable("injected: catalog unreachable")
        if self.catalog == "hang":
            await asyncio.Event().wait()
        return await self.inner.list_datasets()

    async def fetch(self, dataset, ids):
        n = 0
        async for r in self.inner.fetch(dataset, ids):
            if n == self.fail_after:
                raise StoreUnavailable("injected: connection to the store lost")
            if n == self.hang_after:
                await asyncio.Event().wait()
            n += 1
            self.yielded += 1
            yield r
        if n == self.fail_after:
            raise StoreUnavailable("injected: connection to the store lost")
