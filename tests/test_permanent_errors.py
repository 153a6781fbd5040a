"""What no retry can heal is raised at once, naming the cause and the URL,
instead of being retried for ``Retry.deadline`` (300 s by default): a
certificate that fails verification (untrusted, another host's), a token the
service refuses, ``http://`` to a TLS port and ``https://`` to a plain one, a
peer that does not speak HTTP. Every Loader here keeps the default Retry, so a
permanent error retried would take 300 s; each must raise within 5 s.

A token file is read again when the service refuses its token: a Loader whose
token is revoked and rotated mid-run goes on and delivers every sample once;
one given a literal token fails at once. A server that accepts and never
answers is transient (retried), and its error names a cause.

Real servers on loopback: the service's app (``make_app``) under its own
``Runner``, restarted on the same port to change its tokens, as an operator
does; hand-written peers for what is not HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import logging
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from dataferry.client import HttpOptions, HttpSource, Loader, Prefetch, Retry, TokenRefused
from dataferry.schema import (
    AccessDenied,
    PermanentStoreError,
    ProtocolMismatch,
    StoreError,
    StoreUnavailable,
    TLSFailed,
)
from dataferry.schema._aio import LoopThread
from dataferry.server import ServerOptions, make_app
from dataferry.server._protocol import Runner
from server_kit import RawHttpServer, make_samples, run, seeded_db, self_signed, serve

#: a permanent error must surface within this many seconds (retried, it would take Retry.deadline: 300 s)
FAST = 5.0
OLD, NEW = "old-secret-4f1c9a", "new-secret-8b27d3"


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    return seeded_db(tmp_path_factory.mktemp("db") / "d.db", "d", make_samples(300, size=1500))


@contextlib.contextmanager
def in_thread(start) -> Iterator:
    """The async context manager ``start()`` entered in a loop thread, so this one may block (a Loader)."""
    loop = LoopThread("test-peer")
    stack = contextlib.AsyncExitStack()

    async def enter():
        return await stack.enter_async_context(start())

    try:
        yield loop.call(enter(), timeout=30)
    finally:
        try:
            loop.call(stack.aclose(), timeout=30)
        finally:
            loop.stop()


def _first_error(source, **kw) -> tuple[BaseException, float]:
    """What a Loader over ``source`` (default Retry: 300 s of retries) raises on its first batch, and when."""
    start = time.monotonic()
    with pytest.raises(StoreError) as info:
        with Loader(source, "d", batch_size=16, **kw) as loader:
            next(iter(loader))
    return info.value, time.monotonic() - start


def _one_line(exc: BaseException, *words: str) -> str:
    msg = str(exc)
    assert "\n" not in msg and msg.strip(), msg
    for w in words:
        assert w in msg, (w, msg)
    assert OLD not in msg and NEW not in msg, msg
    return msg


def _tls_server_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


def _other_hosts_cert(folder: Path) -> tuple[str, str]:
    """A self-signed certificate for ``elsewhere.example`` only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "elsewhere.example")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("elsewhere.example")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(exist_ok=True)
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


# --- certificates ---------------------------------------------------------------------------------------
def test_an_untrusted_certificate_fails_at_once(db, tmp_path):
    cert, key = self_signed(tmp_path)
    with in_thread(lambda: serve(make_app(db), ssl_context=_tls_server_context(cert, key))) as url:
        exc, took = _first_error(lambda: HttpSource.open(url))
        assert isinstance(exc, TLSFailed) and not isinstance(exc, StoreUnavailable), repr(exc)
        _one_line(exc, url, "certificate", "self-signed", "ca_file")
        assert took < FAST, took
        # trusted, the same server serves
        with Loader(lambda: HttpSource.open(url, options=HttpOptions(ca_file=cert)), "d", batch_size=16) as loader:
            assert len(next(iter(loader))) == 16


def test_another_hosts_certificate_fails_at_once(db, tmp_path):
    cert, key = _other_hosts_cert(tmp_path / "other")
    with in_thread(lambda: serve(make_app(db), ssl_context=_tls_server_context(cert, key))) as url:
        exc, took = _first_error(lambda: HttpSource.open(url, options=HttpOptions(ca_file=cert)))
        assert isinstance(exc, TLSFailed), repr(exc)
        _one_line(exc, url, "certificate", "localhost")  # OpenSSL: "Hostname mismatch, certificate is not valid for 'localhost'"
        assert took < FAST, took


# --- tokens -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_a_refused_or_missing_token_fails_at_once(db, token):
    with in_thread(lambda: serve(make_app(db, ServerOptions(token=NEW)))) as url:
        exc, took = _first_error(lambda: HttpSource.open(url, token=token))
        assert isinstance(exc, TokenRefused) and isinstance(exc, AccessDenied), repr(exc)
        _one_line(exc, url, "refused the token" if token else "requires a token")
        assert "not-the-token" not in str(exc)
        assert took < FAST, took


# --- schemes and peers that are not the service --------------------------------------------------------------
def test_http_to_a_tls_port_fails_at_once(db, tmp_path):
    cert, key = self_signed(tmp_path)
    with in_thread(lambda: serve(make_app(db), ssl_context=_tls_server_context(cert, key))) as url:
        plain = url.replace("https://", "http://")
        exc, took = _first_error(plain)
        assert isinstance(exc, ProtocolMismatch), repr(exc)
        _one_line(exc, plain, "speaks TLS", "https://")
        assert took < FAST, took


def test_https_to_a_plain_port_fails_at_once(db):
    with in_thread(lambda: serve(make_app(db))) as url:
        tls = url.replace("http://", "https://")
        exc, took = _first_error(tls)
        assert isinstance(exc, ProtocolMismatch), repr(exc)
        _one_line(exc, tls, "does not speak TLS", "http://")
        assert took < FAST, took


class _Ssh(RawHttpServer):
    """A peer that is not HTTP: it greets, reads, and answers in its own protocol."""

    def __init__(self, close: bool) -> None:
        self.close = close

    async def handle(self, reader, writer) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await reader.read(1024)
        writer.write(b"Invalid SSH identification string.\r\n")
        await writer.drain()
        if not self.close:
            with contextlib.suppress(asyncio.CancelledError):  # cancelled as the test's server ends
                await asyncio.sleep(3600)


@pytest.mark.parametrize("close", [True, False], ids=["closes", "stays"])
def test_a_peer_that_is_not_http_fails_at_once(close):
    with in_thread(lambda: _Ssh(close)) as url:
        exc, took = _first_error(url)
        assert isinstance(exc, ProtocolMismatch), repr(exc)
        _one_line(exc, url, "not an HTTP server", "SSH")  # its greeting, or its answer when the greeting came first
        assert took < FAST, took


class _Silent(RawHttpServer):
    """Accepts, reads the request, never answers."""

    async def handle(self, reader, writer) -> None:
        await self.read_request(reader)
        with contextlib.suppress(asyncio.CancelledError):  # cancelled as the test's server ends
            await asyncio.sleep(3600)


def test_a_server_that_never_answers_is_retried_and_names_the_cause():
    with in_thread(_Silent) as url:
        exc, took = _first_error(url, retry=Retry(deadline=0.6, timeout=0.25))
        assert not isinstance(exc, PermanentStoreError), repr(exc)
        msg = _one_line(exc, url, "no answer within 0.25 s")
        assert not msg.rstrip().endswith(":"), msg
        assert took < FAST, took


# --- a token revoked mid-run -------------------------------------------------------------------------------
class Service:
    """The data service on a fixed loopback port, restarted with other tokens on demand
    (an operator rotating the server's token file), in a loop thread of its own."""

    def __init__(self, db: str, token: str) -> None:
        self.db = db
        self.loop = LoopThread("test-service")
        self.runner: Runner | None = None
        self.port = 0
        self.loop.call(self._start(token), timeout=30)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self, token: str) -> None:
        self.runner = Runner(make_app(self.db, ServerOptions(token=token)), shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def _restart(self, token: str) -> None:
        await self.runner.cleanup()
        await self._start(token)

    def restart(self, token: str) -> None:
        self.loop.call(self._restart(token), timeout=30)

    def close(self) -> None:
        try:
            self.loop.call(self.runner.cleanup(), timeout=30)
        finally:
            self.loop.stop()


@pytest.fixture
def service(db):
    made = []

    def start(token: str) -> Service:
        made.append(Service(db, token))
        return made[-1]

    yield start
    for s in made:
        s.close()


_QUICK = Retry(backoff=0.02, max_backoff=0.2)
#: a small byte budget: most of the epoch is still to fetch when the token is revoked
_SMALL = Prefetch(max_bytes=64 << 10)


def test_a_token_file_rotated_mid_run_goes_on_exactly(service, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="dataferry")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# the client's copy\n{OLD}\n")
    svc = service(OLD)
    seen: collections.Counter[int] = collections.Counter()
    with Loader(svc.url, "d", batch_size=8, token_file=str(tokens), retry=_QUICK, prefetch=_SMALL) as loader:
        it = iter(loader)
        for _ in range(4):
            seen.update(next(it).ids.tolist())
        tokens.write_text(f"{NEW}\n")  # rotated: the new token in the client's file, the old one revoked
        svc.restart(NEW)
        start = time.monotonic()
        for batch in it:
            seen.update(batch.ids.tolist())
        took = time.monotonic() - start
    assert len(seen) == 300 and set(seen.values()) == {1}, "every sample exactly once"
    assert took < FAST, took
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "refused the token" in logged and OLD not in logged and NEW not in logged


def test_a_literal_token_revoked_mid_run_fails_at_once(service):
    svc = service(OLD)
    with Loader(lambda: HttpSource.open(svc.url, token=OLD), "d", batch_size=8, retry=_QUICK,
                prefetch=_SMALL) as loader:
        it = iter(loader)
        next(it)
        svc.restart(NEW)
        start = time.monotonic()
        with pytest.raises(TokenRefused) as info:
            for _ in it:
                pass
        took = time.monotonic() - start
    _one_line(info.value, svc.url, "refused the token")
    assert took < FAST, took


def test_a_token_file_with_nothing_new_fails_at_once(service, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{OLD}\n")
    svc = service(NEW)
    exc, took = _first_error(svc.url, token_file=str(tokens))
    assert isinstance(exc, TokenRefused), repr(exc)
    _one_line(exc, svc.url, "refused the token", str(tokens))
    assert took < FAST, took


def test_token_file_is_for_a_data_service_url(db):
    from dataferry.schema import ConfigError

    with pytest.raises(ConfigError, match="token_file"):
        Loader(f"sqlite://{db}", "d", token_file="/nonexistent")

    async def both():
        with pytest.raises(ConfigError, match="not both"):
            await HttpSource.open("http://127.0.0.1:1", token="a", token_file="/x")

    run(both())
