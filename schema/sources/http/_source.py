"""HttpSource: the data service's client, behind the one-method seam.

``await HttpSource.open("https://data.example:8470", token=...)`` gives a
:class:`~dataferry.schema.SampleSource` with the Loader's catalog reads;
``fetch`` sends one batch request per call and yields each record as its bytes
arrive, in the server's completion order (the wire format: ``schema/_wire.py``).
A keep-alive pool (``_pool.py``) carries every request; samples are
``memoryview`` slices of pooled arenas (``_buffers.py``).

Errors are translated here and name the URL (the table: :class:`HttpSource`).
What no retry can heal is a ``PermanentStoreError``, raised at once;
``RequestRejected`` is never retried; the rest is retried until
``Retry.deadline``. The token is sent, never logged; a token file is read
again when the service refuses its token.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from urllib.parse import quote

from yarl import URL

from ..._errors import (
    ConfigError,
    DataferryError,
    DatasetNotFound,
    ProtocolMismatch,
    RequestRejected,
    SampleNotFound,
    SplitNotFound,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    TLSFailed,
    TokenRefused,
    WireFormatError,
    check as _check,
)
from ..._model import DatasetInfo, IdList, Sample, SplitInfo
from ..._tokens import read_token_file, valid_token
from ..._wire import (
    ACCEPT_SUMS, FRAMES_TYPE, IDLIST_TYPE, IDS_TYPE, EndRecord, ErrorRecord, FrameDecoder, decode_idlist, encode_ids,
)

from ._buffers import BufferPool
from ._options import HttpOptions, base_url, ssl_context
from ._connection import Connection, HttpProtocolError, NotHttp, Unreachable, collector, read_body
from ._pool import Pool
from ._timing import ServiceTiming

__all__ = ["HttpSource", "HttpOptions", "TokenRefused", "RequestRejected"]

log = logging.getLogger("dataferry.client")


#: the longest a derive's request asks the service to hold its answer (seconds; at most half the read timeout)
_MAX_POLL_WAIT = 10.0


def _derive_label(dataset: str, where: str, name: str | None, parent: str) -> str:
    """``derive split 'x' of pets/all where 'width > 3'``: the filter on one line, cut at 160 characters."""
    text = " ".join(where.split())
    text = text if len(text) <= 160 else text[:157] + "..."
    named = f"split {name!r}" if name else "a split"
    return f"derive {named} of {dataset}/{parent} where {text!r}"


#: statuses a proxy or balancer answers while the service behind it is down or restarting
_GATEWAY = (502, 503, 504)
#: OpenSSL's reasons for a handshake answered by a peer that does not speak TLS (plain HTTP)
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE",
                      "UNKNOWN_PROTOCOL", "RECORD_TOO_LARGE"})
#: what the connection layer raises about the transport (``_connection.py``, ``_pool.py``)
_TRANSPORT_ERRORS = (OSError, EOFError, TimeoutError, HttpProtocolError)


class HttpSource:
    """A data service at ``url``, read over HTTP(S). Open with :meth:`open`.

    Errors are translated here, at the boundary, and name the service URL.
    What no retry can heal is a :class:`~dataferry.schema.PermanentStoreError`,
    raised at once (the engine never retries one); the rest is retried until
    ``Retry.deadline``:

    =====================================  ==============================
    connection / server                    raised
    =====================================  ==============================
    refused, reset, disconnected, cut      StoreUnavailable
    certificate not verified (untrusted,   TLSFailed (permanent)
    expired, another host's), TLS refused
    https:// to a plain HTTP port,         ProtocolMismatch (permanent)
    http:// to a TLS port, a peer whose
    answer is not HTTP at all
    TLS cut short (EOF in the handshake)   StoreUnavailable
    malformed HTTP                         StoreUnavailable
    connect/read timeout, 503 store_timeout StoreTimeout
    401, 403                               TokenRefused (an AccessDenied:
                                           permanent, after one more try
                                           with a rotated token file)
    404 dataset_not_found/split_not_found  DatasetNotFound / SplitNotFound
    503, other 5xx, corrupt stream         StoreUnavailable / StoreError
    other 4xx                              RequestRejected (server's detail)
    not the service's answer: 502/503/504  StoreUnavailable (a proxy whose
                                           service is down or restarting)
    not the service's answer: otherwise    RequestRejected, error
                                           ``not_a_data_service``
    =====================================  ==============================

    An answer is the service's when it is a 200 of the expected content type, or
    an error with the service's JSON body (``{"error": ..., "detail": ...}``).
    Anything else (a static file server's HTML 404, a web app's HTML 200) did not
    come from a dataferry data service: the error is one line with what was
    expected, what answered (status, content type) and the URL asked, never the
    page itself.

    Store errors but the permanent ones are retryable by the engine;
    ``RequestRejected`` is not (the same request would be rejected again). The
    token is sent, never logged or shown. A token file (``token_file=``) is read
    with :func:`dataferry.schema.read_token_file`, the server's reader: the
    client sends the file's first token, and when the service refuses it (401,
    403) reads the file again and sends the first token in it not refused yet,
    once per request; a literal token refused, or a file with nothing new, is
    TokenRefused at once.
    """

    def __init__(self, url: str, pool: Pool, options: HttpOptions, token: str | None,
                 token_file: str | None = None) -> None:
        self.url = url
        self.options = options
        self.preferred_request_size = options.request_size
        #: requests it carries at once (the engine's tuned window stays within it)
        self.max_concurrency = options.connections
        self._pool: Pool | None = pool
        self._buffers = BufferPool(options.spare_buffers, options.arena)
        self._mean_record = 0.0  # bytes per record of the last response (0: none yet)
        self.timing = ServiceTiming()  # what the service's response heads say of it, for the tuner
        self._has_token = token is not None
        u = URL(url)
        host = f"[{u.host}]" if ":" in (u.host or "") else u.host
        self._netloc = host if u.is_default_port() else f"{host}:{u.port}"
        self._prefix = u.raw_path.rstrip("/")
        self._token_file = token_file  # read again when the token is refused (None: a literal token)
        self._refused: set[str] = set()  # tokens the service refused (kept to skip them in the file; never shown)
        self._use_token(token)

    def _use_token(self, token: str | None) -> None:
        """Send ``token`` from now on (the request heads made before are dropped)."""
        self._token = token
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._headers = f"Host: {self._netloc}\r\nUser-Agent: dataferry\r\nAccept-Encoding: identity\r\n{auth}"
        self._fetch_heads: dict[str, tuple[str, bytes]] = {}  # dataset -> (path, request head up to its length)

    def _rotated(self, refused: str | None) -> bool:
        """After the service refused ``refused``: whether a request may go once more, with another
        token (one another request took already, or the first in the token file not refused yet)."""
        if self._token != refused:
            return True
        if self._token_file is None or refused is None:
            return False
        self._refused.add(refused)
        try:
            tokens = read_token_file(self._token_file)
        except ConfigError as exc:
            log.warning("the data service at %s refused the token, and %s", self.url, exc)
            return False
        fresh = next((t for t in tokens if t not in self._refused), None)
        if fresh is None:
            return False
        log.warning("the data service at %s refused the token; sending the next one in %r", self.url,
                    self._token_file)
        self._use_token(fresh)
        return True

    @classmethod
    async def open(cls, url: str, *, token: str | None = None, token_file: str | None = None,
                   options: HttpOptions = HttpOptions()) -> HttpSource:
        """A source for the service at ``url`` (``http(s)://host:port[/prefix]``), sending ``token``,
        or the first token of ``token_file`` (else ``options.token_file``), read again when refused.

        Connects lazily: a dead server shows up as StoreUnavailable on the first call.
        """
        base = base_url(url)
        if token_file is not None:
            _check(token is None, "pass token= or token_file=, not both")
            options = replace(options, token_file=token_file)
        file = options.token_file if token is None else None
        if file is not None:
            token = read_token_file(file)[0]  # the server accepts each; a rotation lists old first
        if token is not None:
            _check(valid_token(token), "token must be non-empty printable ASCII without spaces")
        u = URL(base)
        pool = Pool(
            u.host, u.port, ssl_context=ssl_context(options) if u.scheme == "https" else None,
            connections=options.connections, connect_timeout=options.connect_timeout,
            read_timeout=options.read_timeout, keepalive=options.keepalive,
            first_byte_timeout=options.first_byte_timeout,
        )
        return cls(base, pool, options, token, file)

    # --- the seam ------------------------------------------------------------------
    @property
    def link_rtt(self) -> float | None:
        """The link's round trip without the service's time (``ServiceTiming``); None: not told yet."""
        return self.timing.link_rtt

    @property
    def server_work(self) -> tuple[float, int]:
        """The service's CPU seconds and samples answered so far, as its workers told them."""
        return self.timing.server_work

    async def fetch(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[Sample | SampleNotFound]:
        """One batch request; yield each record as it arrives (completion order)."""
        async for run in self.fetch_runs(dataset, ids):
            for rec in run:
                yield rec

    async def fetch_runs(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[list[Sample | SampleNotFound]]:
        """:meth:`fetch`, a *run* at a time: the records that each read of the answer completed,
        as one list (not empty), in completion order. The engine takes them so (``Run._on_results``):
        no async step and no call per sample. The same records, errors and retries as ``fetch``."""
        if not len(ids):
            return
        what = f"fetch of {len(ids)} samples of dataset {dataset!r}"
        body = encode_ids(ids)
        for again in (False, True):
            answered = 0
            sent_with = self._token
            made = self._fetch_heads.get(dataset)
            if made is None:  # the request's head, but for its length, made once per dataset (and token)
                path = self._path(dataset, "samples")
                accept = ACCEPT_SUMS if self.options.checksums else None
                made = self._fetch_heads[dataset] = (path, self._head("POST", path, IDS_TYPE, accept=accept))
            path, head = made
            request = b"%s%d\r\n\r\n%s" % (head, len(body), body)
            decoder = FrameDecoder(dataset, max_record=self.options.max_record_bytes, arena=self._buffers.take,
                                   give_back=self._buffers.give_back, expect=len(ids), mean=self._mean_record,
                                   verify=self.options.checksums)
            sent = time.monotonic()
            try:
                async with self._open_pool().exchange(request, FRAMES_TYPE, decoder,
                                                      pause_above=self.options.read_buffer) as conn:
                    reused = conn.last_used > 0  # a new connection's time has its connect in it
                    await self._check_response(conn, "POST", path, FRAMES_TYPE, what, dataset=dataset)
                    if reused:
                        self.timing.timed(time.monotonic() - sent, conn.head.headers.get("server-timing"))
                    work = conn.head.headers.get("dataferry-work")
                    if work is not None:
                        self.timing.worked(work)
                    while True:
                        if decoder.records:
                            run = decoder.take()
                            last = run[-1]  # an ERROR or END record comes last (the decoder stops at it)
                            end = type(last) is ErrorRecord or type(last) is EndRecord
                            if end:
                                run.pop()
                            if run:
                                answered += len(run)
                                yield run
                            if type(last) is ErrorRecord:
                                cls = StoreTimeout if last.error == "store_timeout" else StoreUnavailable
                                raise cls(f"{self.url}: {what} failed after {answered} answers: {last.detail}")
                            if end and answered != len(ids):
                                raise StoreError(f"{self.url}: {what} ended after {answered} answers")
                            conn.resume()
                        elif conn.complete:  # the body's end (after END, so the connection goes back to the pool)
                            if not decoder.done:
                                raise ConnectionResetError("the answer ended in the middle of the records")
                            self._mean_record = decoder.mean  # what the next response's arena region is sized by
                            return
                        else:
                            await conn.wait()
            except WireFormatError as exc:
                raise StoreError(f"{self.url}: corrupt response to {what}: {exc}") from exc
            except TokenRefused:
                if again or answered or not self._rotated(sent_with):
                    raise
            except DataferryError:
                raise  # translated already (a StoreTimeout is a TimeoutError too)
            except _TRANSPORT_ERRORS as exc:
                raise self._translate(exc, f"{what} (after {answered} answers)") from exc

    # --- catalog -------------------------------------------------------------------
    async def list_datasets(self) -> list[DatasetInfo]:
        doc = await self._get_json("/v1/datasets", "list datasets")
        try:
            return [self._info(d) for d in doc["datasets"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{self.url}: malformed dataset list: {exc!r}") from exc

    async def get_dataset(self, name: str) -> DatasetInfo:
        doc = await self._get_json(self._path(name), f"get dataset {name!r}", dataset=name)
        try:
            return self._info(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{self.url}: malformed dataset {name!r}: {exc!r}") from exc

    async def list_splits(self, dataset: str) -> list[SplitInfo]:
        doc = await self._get_json(self._path(dataset), f"list splits of {dataset!r}", dataset=dataset)
        try:
            return [SplitInfo(dataset, str(s["name"]), int(s["num_ids"])) for s in doc["splits"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{self.url}: malformed split list of {dataset!r}: {exc!r}") from exc

    async def read_split(self, dataset: str, split: str) -> IdList:
        what = f"read split {dataset}/{split}"
        try:
            body = await self._read("GET", self._path(dataset, "splits", split), IDLIST_TYPE, what,
                                    dataset=dataset, split=split)
            return decode_idlist(body)
        except WireFormatError as exc:
            raise StoreError(f"{self.url}: corrupt response to {what}: {exc}") from exc

    async def derive_split(self, dataset: str, where: str, *, name: str | None = None, parent: str = "all",
                           progress: bool | None = None, timeout: float | None = None):
        """The split of ``parent`` whose metadata match ``where``, derived (or reused) by the service:
        its ``DerivedSplit`` record (``schema/_splits.py``).

        The service runs the derive as a job (``server/_derive.py``). The POST asks for an answer
        within half the read timeout (``Prefer: respond-async, wait=N``, N at most 10 s): the record
        when the job is quick, else 202 and the job, which is then asked after (``GET`` its
        location, each answer held up to N s until it ends) with a tqdm bar of the samples read
        on stderr (``progress``; None: when stderr is a TTY). A poll that reaches a process that
        does not know the job (another worker, or one that restarted) posts again, which joins,
        starts or reuses the split there. It waits at most ``timeout`` seconds in all (default
        ``HttpOptions.derive_timeout``), then raises StoreTimeout; the job goes on in the
        service, and asking again joins it. A failed job raises one line naming the dataset,
        the filter and the cause: RequestRejected (409: the name is taken), StoreTimeout or
        StoreUnavailable (the store), StoreError (anything else); an unknown dataset or parent
        is DatasetNotFound or SplitNotFound, a malformed request RequestRejected (400).
        """
        import sys

        from tqdm import tqdm

        from ..._splits import DerivedSplit

        bound = self.options.derive_timeout if timeout is None else timeout
        wait = min(_MAX_POLL_WAIT, self.options.read_timeout / 2)
        label = _derive_label(dataset, where, name, parent)
        post = json.dumps({"where": where, "from": parent, **({"name": name} if name is not None else {})}).encode()
        show = sys.stderr.isatty() if progress is None else progress
        bar = tqdm(unit="samples", file=sys.stderr, disable=not show, desc=f"derive {dataset}/{parent}", leave=False)
        try:
            async with asyncio.timeout(bound) as deadline:
                status, doc = await self._derive_call("POST", self._path(dataset, "splits"), wait, post, label,
                                                      dataset, parent)
                while status == 202:
                    bar.total = doc.get("total") or bar.total
                    bar.update(max(0, int(doc.get("done") or 0) - bar.n))
                    if doc.get("state") == "failed":
                        raise self._derive_failed(int(doc.get("status") or 500), str(doc.get("error")),
                                                  str(doc.get("detail")), label)
                    if doc.get("state") == "done":
                        doc = doc.get("record")
                        break
                    job = str(doc.get("job", ""))
                    try:
                        status, doc = await self._derive_call("GET", self._path(dataset, "split-jobs", job), wait,
                                                              None, label, dataset, parent)
                    except RequestRejected as exc:
                        if exc.error != "job_not_found":
                            raise
                        # another process of the service (a balancer, --workers) or one that restarted:
                        # post again, which joins its job, starts one or finds the split made
                        status, doc = await self._derive_call("POST", self._path(dataset, "splits"), wait, post,
                                                              label, dataset, parent)
                    else:
                        status = 202  # a job's document, whatever its state
        except TimeoutError as exc:
            if not deadline.expired():
                raise  # a request's own timeout, translated already
            raise StoreTimeout(f"{self.url}: {label} did not finish within {bound:g} s ({bar.n} samples read); "
                               "the service goes on with it: ask again to wait for it") from exc
        finally:
            bar.close()
        try:
            return DerivedSplit.from_json(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{self.url}: malformed answer to {label}: {exc!r}") from exc

    async def _derive_call(self, method: str, path: str, wait: float, body: bytes | None, label: str,
                           dataset: str, parent: str) -> tuple[int, dict]:
        """One request of a derive: ``(status, JSON document)`` of a 200 or 202; errors raised, a job's
        failure naming ``label``."""
        async def attempt() -> tuple[int, dict]:
            head = f"{method} {self._prefix}{path} HTTP/1.1\r\n{self._headers}Prefer: respond-async, wait={wait:g}\r\n"
            if body is None:
                request = (head + "\r\n").encode("latin-1")
            else:
                request = (head + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                           ).encode("latin-1") + body
            async with self._open_pool().exchange(request, "application/json", collector(), holds=wait) as conn:
                status = conn.head.status
                if status in (200, 202) and conn.head.content_type == "application/json":
                    raw = await read_body(conn)
                    try:
                        doc = json.loads(raw)
                    except ValueError as exc:
                        raise StoreError(f"{self.url}: {label}: the answer is not JSON") from exc
                    if not isinstance(doc, dict):
                        raise StoreError(f"{self.url}: {label}: the answer is not a JSON object")
                    return status, doc
                error = await self._error_doc(conn) if status == 409 or status >= 500 else None
                if error is not None:  # the job's own failure (the request was fine)
                    raise self._derive_failed(status, error[0], error[1], label)
                await self._check_response(conn, method, path, "application/json", label, dataset=dataset,
                                           split=parent)
                raise StoreError(f"{self.url}: {label}: unexpected HTTP {status}")

        return await self._rotating(attempt, label)

    def _derive_failed(self, status: int, error: str, detail: str, label: str) -> DataferryError:
        """A derive job's failure, one line naming the dataset and the filter."""
        message = f"{self.url}: {label} failed ({status} {error}): {' '.join(detail.split())}"
        if status == 409 or 400 <= status < 500:
            return RequestRejected(self.url, status, error, detail, message=message)
        if error == "store_timeout":
            return StoreTimeout(message)
        if status == 503:
            return StoreUnavailable(message)
        return StoreError(message)

    # --- plumbing ----------------------------------------------------------------------
    def _open_pool(self) -> Pool:
        if self._pool is None:
            raise StoreUnavailable(f"HttpSource for {self.url} is closed")
        return self._pool

    def _path(self, dataset: str, *rest: str) -> str:
        return "/".join(["/v1/datasets", *(quote(p, safe="") for p in (dataset, *rest))])

    def _head(self, method: str, path: str, ctype: str | None = None, *, accept: str | None = None) -> bytes:
        """The request's head; with a body (of ``ctype``), up to its Content-Length's value."""
        head = f"{method} {self._prefix}{path} HTTP/1.1\r\n{self._headers}"
        if accept is not None:  # the batch fetch asks for records with the stored checksums
            head += f"Accept: {accept}\r\n"
        if ctype is not None:
            head += f"Content-Type: {ctype}\r\nContent-Length: "
        return head.encode("latin-1")

    def _request(self, method: str, path: str, body: bytes = b"", ctype: str | None = None) -> bytes:
        head = self._head(method, path, ctype)
        return head + b"\r\n" if ctype is None else b"%s%d\r\n\r\n%s" % (head, len(body), body)

    async def _read(self, method: str, path: str, ctype: str, what: str, *, json_body: bytes | None = None,
                    **names: str) -> bytes:
        """The whole answer to ``method path`` (sending ``json_body``, if any), checked to be a 200 of ``ctype``."""
        async def attempt() -> bytes:
            if json_body is None:
                request = self._request(method, path)
            else:
                request = self._request(method, path, json_body, "application/json")
            async with self._open_pool().exchange(request, ctype, collector()) as conn:
                await self._check_response(conn, method, path, ctype, what, **names)
                return await read_body(conn)

        return await self._rotating(attempt, what)

    async def _rotating(self, attempt, what: str):
        """``await attempt()`` (which builds its request with the current token); when the service
        refuses the token and the token file holds a new one, once more. Transport errors are
        translated naming ``what``."""
        for again in (False, True):
            sent_with = self._token
            try:
                return await attempt()
            except TokenRefused:
                if again or not self._rotated(sent_with):
                    raise
            except DataferryError:
                raise  # translated already (a StoreTimeout is a TimeoutError too)
            except _TRANSPORT_ERRORS as exc:
                raise self._translate(exc, what) from exc
        raise AssertionError("unreachable")  # the second try returns or raises

    async def _get_json(self, path: str, what: str, **names: str) -> dict:
        raw = await self._read("GET", path, "application/json", what, **names)
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise StoreError(f"{self.url}: {what}: reply is not JSON") from exc
        if not isinstance(doc, dict):
            raise StoreError(f"{self.url}: {what}: reply is not a JSON object")
        return doc

    @staticmethod
    def _info(d: dict) -> DatasetInfo:
        created = _dt.datetime.fromisoformat(str(d["created"]))
        return DatasetInfo(str(d["name"]), tuple(str(x) for x in d["label_names"]), int(d["num_samples"]), created)

    async def _check_response(self, conn: Connection, method: str, path: str, ctype: str, what: str,
                              **names: str) -> None:
        head = conn.head
        if head.status == 200:
            if head.content_type != ctype:
                raise self._not_the_service(head, method, path, ctype, what)
            return
        doc = await self._error_doc(conn)
        status = head.status
        if status in (401, 403):
            hint = "refused the token" if self._has_token else "requires a token and none was given"
            if self._has_token and self._token_file is not None:
                hint += f" (and token file {self._token_file!r} has no other)"
            detail = doc[1] if doc else f"HTTP {status} ({head.content_type})"
            raise TokenRefused(f"the data service at {self.url} {hint} ({what}): {detail}")
        if doc is None:
            raise self._not_the_service(head, method, path, ctype, what)
        error, detail, body = doc
        if status == 404 and error == "dataset_not_found":
            raise DatasetNotFound(names.get("dataset", str(body.get("dataset", ""))), f"data service {self.url}")
        if status == 404 and error == "split_not_found":
            dataset = names.get("dataset", str(body.get("dataset", "")))
            raise SplitNotFound(dataset, names.get("split", str(body.get("split", ""))), f"data service {self.url}")
        if status == 503:
            cls = StoreTimeout if error == "store_timeout" else StoreUnavailable
            raise cls(f"{self.url}: {what}: {detail or error}")
        if 400 <= status < 500:
            raise RequestRejected(self.url, status, error, detail)
        raise StoreError(f"{self.url}: {what}: HTTP {status} {error}: {detail}")

    @staticmethod
    async def _error_doc(conn: Connection) -> tuple[str, str, dict] | None:
        """``(error, detail, body)`` of the service's JSON error body, or None when the answer is not one."""
        if conn.head.content_type != "application/json":
            return None
        try:
            doc = json.loads(await read_body(conn))
        except ValueError:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("error"), str):
            return None
        return doc["error"], " ".join(str(doc.get("detail", "")).split()), doc

    def _not_the_service(self, head, method: str, path: str, expected: str, what: str) -> DataferryError:
        """One line for an answer that did not come from a data service: what
        was expected, what answered, the URL asked; never the page itself."""
        got = f"HTTP {head.status} {head.reason or ''}".rstrip() + f" ({head.content_type})"
        asked = f"{method} {self.url}{path}"
        if head.status in _GATEWAY:  # a proxy or balancer whose service is down or restarting: retryable
            return StoreUnavailable(
                f"{self.url}: {what}: expected the data service's answer, got {got} from {asked} (a proxy?)"
            )
        return RequestRejected(
            self.url, head.status, "not_a_data_service", got,
            message=f"not a dataferry data service at {self.url} (wrong URL or prefix?): {what}: "
                    f"expected 200 {expected} or a JSON error, got {got} from {asked}",
        )

    def _translate(self, exc: BaseException, what: str) -> StoreError:
        if isinstance(exc, TimeoutError):
            return StoreTimeout(f"{self.url}: {what} timed out: {exc or type(exc).__name__}")
        if isinstance(exc, Unreachable):
            if isinstance(exc.os_error, ssl.SSLError):
                return self._tls_failed(exc.os_error, what)
            return StoreUnavailable(f"cannot connect to {self.url} ({what}): {exc.os_error}")
        if isinstance(exc, NotHttp):
            if exc.tls:
                return ProtocolMismatch(f"{self.url} speaks TLS: use https:// for this port ({what})")
            return ProtocolMismatch(f"not an HTTP server at {self.url} ({what}): {exc}")
        if isinstance(exc, HttpProtocolError):
            return StoreUnavailable(f"malformed HTTP answer from {self.url} ({what}): {exc}")
        return StoreUnavailable(f"lost connection to {self.url} during {what}: {exc or type(exc).__name__}")

    def _tls_failed(self, err: ssl.SSLError, what: str) -> StoreError:
        """A TLS handshake's failure: permanent unless the connection was cut short in it."""
        if isinstance(err, ssl.SSLCertVerificationError):
            reason = err.verify_message or err.reason or str(err)
            return TLSFailed(f"the certificate of {self.url} failed verification: {reason} ({what}); "
                             "pass HttpOptions(ca_file=...) for a private CA")
        if isinstance(err, (ssl.SSLEOFError, ssl.SSLSyscallError, ssl.SSLZeroReturnError)):
            return StoreUnavailable(f"TLS with {self.url} was cut short ({what}): {err}")
        if err.reason in _NOT_TLS:
            return ProtocolMismatch(f"{self.url} does not speak TLS: use http:// for this port ({what}): {err}")
        return TLSFailed(f"TLS with {self.url} failed ({what}): {err}")

    # --- lifetime ----------------------------------------------------------------------
    async def close(self) -> None:
        """Close the pool. Safe to call twice."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    async def __aenter__(self) -> HttpSource:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"HttpSource({self.url!r})"
