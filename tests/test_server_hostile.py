"""The data service against what production does to it: clients that stall
mid-upload or hang up, garbage bodies, malformed HTTP, credentials where they
should not be.

Every server here is the real app on loopback, run by the same runner as
``dataferry serve`` (``dataferry.server._protocol.Runner``), over a real SQLite
store, in a background thread with its own event loop; clients are raw
sockets (to send what no HTTP library would), aiohttp, a real ``Loader``, or
the CLI in a subprocess.

Which test covers which defect of issue 10:

* 3, a stalled body holds a slot: ``test_stalled_uploads_do_not_starve_a_loader``,
  ``test_a_request_holds_its_slot_at_most_hold_timeout``, ``test_body_timeout_and_hold_timeout_are_cli_flags``;
* 4, garbage compressed bodies and client aborts: ``test_garbage_compressed_body_is_400``,
  ``test_a_client_that_hangs_up_mid_upload_is_499_in_one_line``;
* 5, credentials echoed: ``test_no_credential_in_any_answer_or_log_line_of_the_cli``,
  ``test_logs_stay_clean_under_a_plain_app_runner``, ``test_a_scheme_less_token_is_not_quoted``;
* 6, plain-text errors: ``test_every_error_answer_is_the_json_error_body``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator

import aiohttp
import pytest
from aiohttp import web
from openapi_schema_validator import OAS30Validator

from dataferry.client import Loader, Retry
from dataferry.schema import open_store
from dataferry.schema._wire import encode_ids
from dataferry.server import ServerOptions, make_app
from dataferry.server._protocol import Runner
from server_kit import SPEC, BrokenStore, Live, live_server, make_samples, parse_metrics, seed, spec_document

N_SAMPLES = 400
SAMPLES = make_samples(N_SAMPLES, size=3000)
IDS = [s.id for s in SAMPLES]
TOKEN = "Zq7hK2mP9xW4vR8sTb3N"


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hostile") / "s.db"

    async def go():
        async with await open_store(f"sqlite://{path}") as store:
            await seed(store, "d", SAMPLES)

    asyncio.run(go())
    return str(path)


@contextlib.contextmanager
def served(db: str, options: ServerOptions = ServerOptions(), *, wrap: Callable = lambda s: s,
           runner: type[web.AppRunner] = Runner, access_log: logging.Logger | None = None) -> Iterator[Live]:
    """The real app over the SQLite store ``db`` (``wrap``-ped: a BrokenStore)
    on a free loopback port, in a background loop thread so blocking clients
    can run here."""

    async def build() -> web.Application:
        store = wrap(await open_store(f"sqlite://{db}"))
        app = make_app(store, options)

        async def close_store(_app: web.Application) -> None:
            await store.close()  # make_app leaves an open store to its caller

        app.on_cleanup.append(close_store)
        return app

    with live_server(build, runner=runner, access_log=access_log) as srv:
        yield srv


# --- raw HTTP ------------------------------------------------------------------------------------
def raw(port: int, data: bytes, *, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return _read_to_eof(s, time.monotonic() + timeout)


def _read_to_eof(s: socket.socket, deadline: float) -> bytes:
    out = b""
    while True:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the server neither answered nor closed in time; got {out[:200]!r}") from None
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def parse(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, sep, body = response.partition(b"\r\n\r\n")
    assert sep, f"not an HTTP response: {response[:200]!r}"
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, body


ERROR_SCHEMA = spec_document()["components"]["schemas"]["Error"]


def assert_json_error(status: int, headers: dict, body: bytes, *, method: str | None = None,
                      template: str | None = None) -> dict:
    """The documented JSON error body; checked against the operation when the spec lists that status."""
    assert headers.get("content-type", "").startswith("application/json"), (status, headers, body[:200])
    doc = json.loads(body)
    OAS30Validator(ERROR_SCHEMA).validate(doc)
    assert doc["detail"], doc
    if template is not None:
        SPEC.check(method, template, status, headers["content-type"], body)
    return doc


def request(method: str, path: str, *, headers: dict | None = None, body: bytes = b"", close: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if close:
        lines.append("Connection: close")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body and not any(k.lower() in ("content-length", "transfer-encoding") for k in headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def metrics(base: str, headers: dict | None = None) -> dict[str, float]:
    req = urllib.request.Request(base + "/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return parse_metrics(resp.read().decode())


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


P = "dataferry_server_"
SAMPLES_T = "/v1/datasets/{name}/samples"


# --- 3: stalled bodies ------------------------------------------------------------------------------
def _epoch_seconds(base: str) -> float:
    """A real Loader over HTTP: the time to stream one whole epoch, from a cold start."""
    t0 = time.perf_counter()
    with Loader(base, "d", batch_size=25, retry=Retry(deadline=8.0, timeout=5.0)) as loader:
        n = sum(len(b) for b in loader)
    assert n == N_SAMPLES
    return time.perf_counter() - t0


def _open_stalls(port: int, n: int) -> list[socket.socket]:
    """``n`` uploads that send their headers, a Content-Length of 800 and 16
    bytes of body, then nothing more."""
    head = request("POST", "/v1/datasets/d/samples", close=False,
                   headers={"Content-Type": "application/octet-stream", "Content-Length": "800"})
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(head + encode_ids([1, 2]))
            socks.append(s)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def test_stalled_uploads_do_not_starve_a_loader(db):
    body_timeout, n_stalls = 6.0, 300
    with served(db, ServerOptions(body_timeout=body_timeout)) as srv:
        _epoch_seconds(srv.base)  # warm-up: imports, the SQLite page cache
        alone = [_epoch_seconds(srv.base) for _ in range(3)]
        stalls = _open_stalls(srv.port, n_stalls)
        stalled_at = time.monotonic()
        try:
            # every stalled request is in the server, waiting for its body
            wait_for(lambda: metrics(srv.base)[P + "requests_in_flight"] >= n_stalls + 1, 10, "the stalled requests")
            with urllib.request.urlopen(srv.base + "/healthz", timeout=2) as resp:
                assert resp.status == 200
            beside = [_epoch_seconds(srv.base) for _ in range(3)]
            with urllib.request.urlopen(srv.base + "/healthz", timeout=2) as resp:
                assert resp.status == 200
            assert time.monotonic() - stalled_at < body_timeout, "measured after the stalls were dropped: raise body_timeout"
            # the Loader's rate beside the stalls / alone, best epoch of each: stalls that starved it
            # would slow every epoch, while the other test worker's load slows one or two of either
            # set (medians read 0.41 once, epochs of 0.10-0.65 s beside 0.11-0.27 alone)
            ratio = min(alone) / min(beside)
            print(f"\nLoader epoch of {N_SAMPLES}: alone {min(alone) * 1e3:.0f} ms, beside {n_stalls} "
                  f"stalled uploads {min(beside) * 1e3:.0f} ms (best of 3 each): rate ratio {ratio:.2f}")
            assert ratio >= 0.5, (alone, beside)
            # the stalled uploads are answered 408 and dropped once their body deadline passes
            for s in stalls:
                status, headers, body = parse(_read_to_eof(s, stalled_at + body_timeout + 5.0))
                assert status == 408
                assert assert_json_error(status, headers, body, method="POST", template=SAMPLES_T)["error"] == "body_timeout"
                assert headers.get("connection", "").lower() == "close"
            assert time.monotonic() - stalled_at >= body_timeout - 0.5  # not before the deadline
        finally:
            for s in stalls:
                s.close()
        m = metrics(srv.base)
        assert m[P + 'errors_total{error="body_timeout"}'] == n_stalls
        assert m[P + 'requests_total{method="POST",route="/v1/datasets/{name}/samples",status="408"}'] == n_stalls


def test_a_request_holds_its_slot_at_most_hold_timeout(db):
    """One slot; a store that hangs. The request holding the slot is ended at
    ``hold_timeout``: 503 before its response started, a dropped connection after."""
    opts = ServerOptions(max_concurrent=1, queue_timeout=5.0, hold_timeout=0.5, store_timeout=60.0)

    async def go(base):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            t0 = time.monotonic()
            hung = asyncio.ensure_future(s.post(f"{base}/v1/datasets/d/samples", data=encode_ids(IDS[:5]),
                                                headers={"Content-Type": "application/octet-stream"}))
            try:
                await asyncio.sleep(0.1)
                async with s.get(f"{base}/v1/datasets") as resp:  # waits in line for the one slot
                    assert resp.status == 200
                async with await hung as resp:
                    body = await resp.read()
                    assert resp.status == 503
                    assert_json_error(resp.status, {"content-type": resp.headers["Content-Type"]}, body,
                                      method="POST", template=SAMPLES_T)
                    assert json.loads(body)["error"] == "hold_timeout"
            finally:
                hung.cancel()
                await asyncio.gather(hung, return_exceptions=True)
            return time.monotonic() - t0

    with served(db, opts, wrap=lambda st: BrokenStore(st, hang_after=0)) as srv:
        assert asyncio.run(go(srv.base)) < 3.0
    with served(db, opts, wrap=lambda st: BrokenStore(st, hang_after=3)) as srv:
        t0 = time.monotonic()
        reply = raw(srv.port, request("POST", "/v1/datasets/d/samples", body=encode_ids(IDS[:10]),
                                      headers={"Content-Type": "application/octet-stream"}), timeout=10)
        assert time.monotonic() - t0 < 3.0
        status, headers, body = parse(reply)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert not body.endswith(b"0\r\n\r\n")  # cut: the chunked body never ended
        assert metrics(srv.base)[P + 'errors_total{error="hold_timeout"}'] == 1


def test_body_timeout_and_hold_timeout_are_cli_flags(tmp_path, db):
    out = subprocess.run([sys.executable, "-m", "dataferry.server", "--help"], capture_output=True, text=True, timeout=30)
    assert "--body-timeout" in out.stdout and "--hold-timeout" in out.stdout
    out = subprocess.run([sys.executable, "-m", "dataferry.server", "--port", "0", "--body-timeout", "0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "body_timeout must be > 0" in out.stderr
    with _cli_server(tmp_path, db, "--body-timeout", "0.5", "--hold-timeout", "30") as (port, _):
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(request("POST", "/v1/datasets/d/samples", close=False, headers={
                "Content-Type": "application/octet-stream", "Content-Length": "80", "Authorization": f"Bearer {TOKEN}"}))
            status, _, _ = parse(_read_to_eof(s, time.monotonic() + 5))
        # 0.5 s, not the default 10: answered well before 8 s (4.0 s seen beside another test worker)
        assert status == 408 and 0.4 < time.monotonic() - t0 < 8.0


# --- 4: garbage compressed bodies, clients that hang up -----------------------------------------------
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
def test_garbage_compressed_body_is_400(db, caplog, encoding):
    with served(db) as srv:
        status, headers, body = parse(raw(srv.port, request("POST", "/v1/datasets/d/samples", body=b"\x01" * 16, headers={
            "Content-Type": "application/octet-stream", "Content-Encoding": encoding})))
        assert status == 400
        assert_json_error(status, headers, body, method="POST", template=SAMPLES_T)
        # a well-formed compressed body still works
        for good in (gzip.compress(encode_ids(IDS[:3])), zlib.compress(encode_ids(IDS[:3]))):
            name = "gzip" if good[:2] == b"\x1f\x8b" else "deflate"
            status, _, _ = parse(raw(srv.port, request("POST", "/v1/datasets/d/samples", body=good, headers={
                "Content-Type": "application/octet-stream", "Content-Encoding": name})))
            assert status == 200
        m = metrics(srv.base)
    assert not [k for k in m if 'status="5' in k]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_that_hangs_up_mid_upload_is_499_in_one_line(db, caplog):
    caplog.set_level(logging.INFO)
    with served(db) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(request("POST", "/v1/datasets/d/samples", close=False,
                              headers={"Content-Type": "application/octet-stream", "Content-Length": "800"}) + b"\x01" * 16)
            wait_for(lambda: metrics(srv.base)[P + "requests_in_flight"] >= 2, 5, "the upload to start")
        key = P + 'requests_total{method="POST",route="/v1/datasets/{name}/samples",status="499"}'
        wait_for(lambda: metrics(srv.base).get(key) == 1, 5, "the abort to be counted")
        m = metrics(srv.base)
        assert m[P + 'errors_total{error="client_closed_request"}'] == 1
        assert not [k for k in m if 'status="5' in k]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.exc_info]
    lines = [r.getMessage() for r in caplog.records if "closed the connection" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines


# --- 5: credentials -------------------------------------------------------------------------------------
def fragments(secret: str, n: int = 6) -> set[str]:
    return {secret[i:i + n] for i in range(len(secret) - n + 1)}


def assert_no_credential(text: bytes | str, where: str) -> None:
    if isinstance(text, bytes):
        text = text.decode("latin-1")
    for frag in fragments(TOKEN):
        assert frag not in text, f"{where} holds {frag!r} of the token: {text[:2000]}"


T = TOKEN.encode()
# (what, raw request) sent to a server whose token is TOKEN
LEAKY = [
    ("space-before-colon", b"GET /v1/datasets HTTP/1.1\r\nHost: x\r\nAuthorization : Bearer " + T + b"\r\n\r\n"),
    ("nul-in-value", b"GET /v1/datasets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + T + b"\x00\r\n\r\n"),
    ("bare-cr", b"GET /v1/datasets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + T[:8] + b"\r" + T[8:] + b"\r\n\r\n"),
    ("del-in-value", b"GET /v1/datasets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + T + b"\x7f\r\n\r\n"),
    ("no-scheme", b"GET /v1/datasets HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + T + b"\r\n\r\n"),
    ("token-as-scheme", b"GET /v1/datasets HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + T + b" x\r\n\r\n"),
    ("query-token", b"GET /v1/datasets?token=" + T + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    ("query-token-authorized", b"GET /v1/datasets?access_token=" + T + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                               b"Authorization: Bearer " + T + b"\r\n\r\n"),
    ("query-bare", b"GET /v1/datasets?" + T + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer " + T
                   + b"\r\n\r\n"),
    ("bad-request-line", b"GET /v1/datasets?token=" + T + b" HTTP/9.9\r\nHost: x\r\n\r\n"),
    ("space-in-target", b"GET /v1/datasets?token=" + T + b" x HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("header-too-long", b"GET /v1/datasets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + T + b"x" * 9000 + b"\r\n\r\n"),
    ("header-after-token", b"GET /v1/datasets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + T + b"\r\nBad Header: y\r\n\r\n"),
    ("upload-then-garbage", b"POST /v1/datasets/d/samples HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + T
                            + b"\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                            + T + b"\r\n\r\n"),
]


def test_no_credential_in_any_answer_or_log_line_of_the_cli(tmp_path, db):
    """``dataferry serve`` with a token, its access log on: malformed header
    lines, scheme-less tokens, tokens in query strings. No answer and no line
    of its log holds the token or any 6-character piece of it."""
    with _cli_server(tmp_path, db) as (port, proc):
        answers = []
        for what, data in LEAKY:
            reply = raw(port, data)
            assert reply, what
            answers.append((what, reply))
            assert_no_credential(reply, f"the answer to {what}")
            status, headers, body = parse(reply)
            assert status in (200, 400, 401), (what, reply[:300])
            if status != 200:
                assert_json_error(status, headers, body)
        assert [parse(r)[0] for w, r in answers if w == "query-token-authorized"] == [400]  # no query taken
    log = proc.stderr_text
    assert "GET /v1/datasets" in log  # the access log was on
    assert_no_credential(log, "the server's log")
    assert "Traceback" not in log


def test_logs_stay_clean_under_a_plain_app_runner(db, caplog):
    """Embedded with aiohttp's own AppRunner (no dataferry runner), the app's
    handler settings still keep credentials out of aiohttp's log lines."""
    caplog.set_level(logging.DEBUG)
    with served(db, ServerOptions(token=TOKEN), runner=web.AppRunner, access_log=logging.getLogger("aiohttp.access")) as srv:
        for what, data in LEAKY:
            raw(srv.port, data)
    text = "\n".join(caplog.text.splitlines())
    assert "aiohttp.access" in text or "GET /v1/datasets" in text
    assert_no_credential(text, "the log")
    assert not [r for r in caplog.records if r.exc_info]


def test_a_scheme_less_token_is_not_quoted(db):
    with served(db, ServerOptions(token=TOKEN)) as srv:
        for value in (TOKEN, f"{TOKEN} extra", f"{TOKEN[:10]} {TOKEN[10:]}", f"Basic {TOKEN}"):
            status, headers, body = parse(raw(srv.port, request("GET", "/v1/datasets", headers={"Authorization": value})))
            assert status == 401
            assert_json_error(status, headers, body, method="GET", template="/v1/datasets")
            for frag in fragments(value.split()[0][:20]) | fragments(TOKEN):
                assert frag not in body.decode(), body


class _Proc:
    stderr_text = ""


@contextlib.contextmanager
def _cli_server(tmp_path, db: str, *flags: str):
    """``dataferry serve`` with a token file, access log on; yields (port, proc),
    and proc.stderr_text once it has stopped."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataferry.server", "--store", f"sqlite://{db}", "--port", "0",
         "--token-file", str(token_file), "--log-level", "DEBUG", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    holder = _Proc()
    try:
        line = proc.stdout.readline()
        assert line.startswith("dataferry serve: listening on http://127.0.0.1:"), line + proc.stderr.read()
        yield int(line.rsplit(":", 1)[1]), holder
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        holder.stderr_text = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()


# --- 6: every error is the JSON error body ---------------------------------------------------------------
H = b"Host: x\r\nConnection: close\r\n"
BIN = b"Content-Type: application/octet-stream\r\n"
POST = b"POST /v1/datasets/d/samples HTTP/1.1\r\n" + H + BIN
# (id, raw request, status, the operation to check against the spec or None)
ERRORS = [
    ("bad-header-token", b"GET /healthz HTTP/1.1\r\n" + H + b"Bad Header: x\r\n\r\n", 400, None),
    ("nul-in-header", b"GET /healthz HTTP/1.1\r\n" + H + b"X: a\x00b\r\n\r\n", 400, None),
    ("bad-method", b"GARBAGE /healthz HTTP/1.1\r\n" + H + b"\r\n", 400, None),
    ("not-http", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40, 400, None),
    ("bad-version", b"GET /healthz HTTP/9.9\r\n" + H + b"\r\n", 400, None),
    ("space-in-target", b"GET /a b HTTP/1.1\r\n" + H + b"\r\n", 400, None),
    ("url-too-long", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n" + H + b"\r\n", 400, None),
    ("header-too-long", b"GET /healthz HTTP/1.1\r\n" + H + b"X: " + b"a" * 9000 + b"\r\n\r\n", 400, None),
    ("too-many-headers", b"GET /healthz HTTP/1.1\r\n" + H + b"".join(b"X%d: 1\r\n" % i for i in range(200)) + b"\r\n",
     400, None),
    ("length-and-chunked", POST + b"Content-Length: 8\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n12345678\r\n0\r\n\r\n",
     400, None),
    ("two-lengths", POST + b"Content-Length: 8\r\nContent-Length: 9\r\n\r\n12345678", 400, None),
    ("negative-length", POST + b"Content-Length: -1\r\n\r\n", 400, None),
    ("bad-chunk-size", POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n12345678\r\n0\r\n\r\n", 400, ("POST", SAMPLES_T)),
    ("unsupported-encoding", POST + b"Content-Encoding: br\r\nContent-Length: 8\r\n\r\n12345678", 400, None),
    ("unknown-expect", POST + b"Expect: 200-ok\r\nContent-Length: 8\r\n\r\n12345678", 417, None),
    ("method-not-allowed", b"DELETE /v1/datasets HTTP/1.1\r\n" + H + b"\r\n", 405, None),
    ("method-not-allowed-healthz", b"POST /healthz HTTP/1.1\r\n" + H + b"Content-Length: 2\r\n\r\n{}", 405, None),
    ("too-large-declared", POST + b"Content-Length: 2000000\r\n\r\n", 413, ("POST", SAMPLES_T)),
    ("too-large-chunked", POST + b"Transfer-Encoding: chunked\r\n\r\n"
     + b"".join(b"1000\r\n" + b"\0" * 4096 + b"\r\n" for _ in range(300)) + b"0\r\n\r\n", 413, ("POST", SAMPLES_T)),
    ("garbage-gzip", POST + b"Content-Encoding: gzip\r\nContent-Length: 8\r\n\r\n12345678", 400, ("POST", SAMPLES_T)),
    ("not-found", b"GET /nowhere HTTP/1.1\r\n" + H + b"\r\n", 404, None),
]


@pytest.mark.parametrize("data,status,op", [pytest.param(d, s, o, id=i) for i, d, s, o in ERRORS])
def test_every_error_answer_is_the_json_error_body(db, caplog, data, status, op):
    with served(db, ServerOptions(body_timeout=2.0)) as srv:  # a body answered unread is awaited at most 2 s
        got, headers, body = parse(raw(srv.port, data))
        assert got == status, body[:300]
        method, template = op or (None, None)
        assert_json_error(got, headers, body, method=method, template=template)
        with urllib.request.urlopen(srv.base + "/healthz", timeout=5) as resp:  # and the server is fine
            assert resp.status == 200
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
