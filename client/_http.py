"""HttpSource: the data service's client, behind the one-method seam.

``await HttpSource.open("https://data.example:8470", token=...)`` gives a
:class:`~dataferry.schema.SampleSource` with the catalog reads the Loader
uses (``read_split``, ``list_datasets``, ``get_dataset``, ``list_splits``).
``fetch`` sends one batch request per call and yields each record as its bytes
arrive, in the server's completion order; the wire format is in
``dataferry/schema/_wire.py``.

One ``aiohttp.ClientSession`` with a keep-alive pool of
``HttpOptions.connections`` connections carries every request, so the engine's
window of requests in flight rides on warm connections; ``preferred_request_size``
ids per request keeps responses few and large across a long link.

Errors are translated here, at the boundary, and name the service URL:

=====================================  ==============================
aiohttp / server                       raised
=====================================  ==============================
refused, reset, disconnected, cut      StoreUnavailable
TLS handshake or verification failed   StoreUnavailable
connect/read timeout, 503 store_timeout StoreTimeout
401                                    TokenRefused (a StoreUnavailable)
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

Store errors are retryable by the engine; ``RequestRejected`` is not (the same
request would be rejected again). The token is sent, never logged or shown;
``HttpOptions.token_file`` is read with :func:`dataferry.schema.read_token_file`,
the server's reader: the client sends the file's first token.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp
from yarl import URL

from dataferry.schema import DatasetInfo, IdList, Sample, SampleNotFound, SplitInfo, read_token_file
from dataferry.schema._errors import (
    ConfigError,
    DataferryError,
    DatasetNotFound,
    SplitNotFound,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from dataferry.schema._errors import check as _check
from dataferry.schema._tokens import valid_token
from dataferry.schema._wire import (
    FRAMES_TYPE,
    IDLIST_TYPE,
    IDS_TYPE,
    EndRecord,
    ErrorRecord,
    WireFormatError,
    decode_idlist,
    encode_ids,
    read_frames,
)

__all__ = ["HttpSource", "HttpOptions", "TokenRefused", "RequestRejected"]


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """How :class:`HttpSource` talks to the data service."""

    #: keep-alive connections in the pool (requests in flight at once)
    connections: int = 128
    #: ids per batch request the engine should send (``preferred_request_size``).
    #: Each request in flight has its own connection, and one connection carries
    #: at most its TCP window per round trip: 32 x 110 KB = 3.5 MB stays under
    #: Linux's usual 6 MiB window (deploy/TRAINING.md, "TCP windows")
    request_size: int = 32
    #: seconds to open a TCP (and TLS) connection
    connect_timeout: float = 10.0
    #: seconds of silence allowed while reading a response
    read_timeout: float = 60.0
    #: seconds an idle pooled connection is kept (below the server's 75 s, so
    #: the client, not the server, closes idle connections: no reuse races)
    keepalive: float = 60.0
    #: PEM bundle to verify the server's certificate with (default: system CAs)
    ca_file: str | None = None
    #: verify the server's certificate and host name (off only for testing)
    verify: bool = True
    #: read the bearer token from this file when ``open`` is given none: the
    #: server's token file (one per line, # comments); the first token is sent
    token_file: str | None = None
    #: bytes aiohttp buffers per response before pausing the socket
    read_buffer: int = 1 << 20
    #: the largest record accepted (guards memory against a broken server)
    max_record_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        _check(self.connections >= 1, f"connections must be >= 1, not {self.connections}")
        _check(self.request_size >= 1, f"request_size must be >= 1, not {self.request_size}")
        _check(min(self.connect_timeout, self.read_timeout, self.keepalive) > 0, "timeouts must be > 0")
        _check(self.read_buffer >= 1 << 14, "read_buffer must be at least 16 KiB")
        _check(self.max_record_bytes >= 1 << 16, "max_record_bytes must be at least 64 KiB")


class TokenRefused(StoreUnavailable):
    """The data service answered 401: the token is missing or wrong."""


class RequestRejected(DataferryError):
    """The data service rejected a request as malformed (a 4xx other than 401/404),
    or what answered is not a data service (``error == "not_a_data_service"``)."""

    def __init__(self, url: str, status: int, error: str, detail: str, *, message: str | None = None) -> None:
        super().__init__(message or f"{url} rejected the request ({status} {error}): {detail}")
        self.status, self.error, self.detail = status, error, detail

    def __reduce__(self):
        return (_rejected, (str(self), self.status, self.error, self.detail))


def _rejected(message: str, status: int, error: str, detail: str) -> RequestRejected:
    return RequestRejected("", status, error, detail, message=message)


#: statuses a proxy or balancer answers while the service behind it is down or restarting
_GATEWAY = (502, 503, 504)


def _base_url(url: str) -> str:
    try:
        u = URL(url)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"invalid data service URL {url!r}: {exc}") from exc
    _check(u.scheme in ("http", "https") and bool(u.host), f"data service URL {url!r} must be http(s)://host[:port]")
    _check(not u.query_string and not u.fragment, f"data service URL {url!r} must have no query or fragment")
    _check(u.user is None and u.password is None, f"data service URL {url!r}: pass the token with token=, not in the URL")
    return str(u.with_path(u.path.rstrip("/"))).rstrip("/")


def _ssl_context(options: HttpOptions) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(cafile=options.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load CA file {options.ca_file!r}: {exc}") from exc
    if not options.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class HttpSource:
    """A data service at ``url``, read over HTTP(S). Open with :meth:`open`."""

    def __init__(self, url: str, session: aiohttp.ClientSession, options: HttpOptions) -> None:
        self.url = url
        self.options = options
        self.preferred_request_size = options.request_size
        self._session: aiohttp.ClientSession | None = session
        self._has_token = "Authorization" in session.headers

    @classmethod
    async def open(cls, url: str, *, token: str | None = None, options: HttpOptions = HttpOptions()) -> HttpSource:
        """A source for the service at ``url`` (``http(s)://host:port[/prefix]``).

        Connects lazily: a dead server shows up as StoreUnavailable on the first call.
        """
        base = _base_url(url)
        if token is None and options.token_file is not None:
            token = read_token_file(options.token_file)[0]  # the server accepts each; a rotation lists old first
        if token is not None:
            _check(valid_token(token), "token must be non-empty printable ASCII without spaces")
        connector = aiohttp.TCPConnector(
            limit=options.connections,
            limit_per_host=0,
            keepalive_timeout=options.keepalive,
            ssl=_ssl_context(options) if base.startswith("https:") else False,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=options.connect_timeout, sock_read=options.read_timeout),
            headers={"Authorization": f"Bearer {token}"} if token else None,
            read_bufsize=options.read_buffer,
            auto_decompress=False,
            trust_env=False,
        )
        return cls(base, session, options)

    # --- the seam ------------------------------------------------------------------
    async def fetch(self, dataset: str, ids: Sequence[int]) -> AsyncIterator[Sample | SampleNotFound]:
        """One batch request; yield each record as it arrives (completion order)."""
        ids = list(ids)
        if not ids:
            return
        what = f"fetch of {len(ids)} samples of dataset {dataset!r}"
        answered = 0
        try:
            async with self._open_session().post(
                self._url(dataset, "samples"), data=encode_ids(ids), headers={"Content-Type": IDS_TYPE}
            ) as resp:
                await self._check_response(resp, FRAMES_TYPE, what, dataset=dataset)
                async for rec in read_frames(resp.content, dataset, max_record=self.options.max_record_bytes):
                    if isinstance(rec, ErrorRecord):
                        cls = StoreTimeout if rec.error == "store_timeout" else StoreUnavailable
                        raise cls(f"{self.url}: {what} failed after {answered} answers: {rec.detail}")
                    if isinstance(rec, EndRecord):
                        if answered != len(ids):
                            raise StoreError(f"{self.url}: {what} ended after {answered} answers")
                        # wait for the body's end too, so the connection goes back to the pool
                        if await resp.content.read():
                            raise WireFormatError("bytes after the END record")
                        return
                    answered += 1
                    yield rec
        except WireFormatError as exc:
            raise StoreError(f"{self.url}: corrupt response to {what}: {exc}") from exc
        except (aiohttp.ClientError, OSError, EOFError, asyncio.TimeoutError) as exc:
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
            async with self._open_session().get(self._url(dataset, "splits", split)) as resp:
                await self._check_response(resp, IDLIST_TYPE, what, dataset=dataset, split=split)
                body = await resp.read()
            return decode_idlist(body)
        except WireFormatError as exc:
            raise StoreError(f"{self.url}: corrupt response to {what}: {exc}") from exc
        except (aiohttp.ClientError, OSError, EOFError, asyncio.TimeoutError) as exc:
            raise self._translate(exc, what) from exc

    # --- plumbing ----------------------------------------------------------------------
    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise StoreUnavailable(f"HttpSource for {self.url} is closed")
        return self._session

    def _path(self, dataset: str, *rest: str) -> str:
        return "/".join(["/v1/datasets", *(quote(p, safe="") for p in (dataset, *rest))])

    def _url(self, dataset: str, *rest: str) -> URL:
        return URL(self.url + self._path(dataset, *rest), encoded=True)

    async def _get_json(self, path: str, what: str, **names: str) -> dict:
        try:
            async with self._open_session().get(URL(self.url + path, encoded=True)) as resp:
                await self._check_response(resp, "application/json", what, **names)
                raw = await resp.read()
        except (aiohttp.ClientError, OSError, EOFError, asyncio.TimeoutError) as exc:
            raise self._translate(exc, what) from exc
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

    async def _check_response(self, resp: aiohttp.ClientResponse, ctype: str, what: str, **names: str) -> None:
        if resp.status == 200:
            if resp.content_type != ctype:
                raise self._not_the_service(resp, ctype, what)
            return
        doc = await self._error_doc(resp)
        status = resp.status
        if status == 401:
            hint = "refused the token" if self._has_token else "requires a token and none was given"
            detail = doc[1] if doc else f"HTTP 401 ({resp.content_type})"
            raise TokenRefused(f"the data service at {self.url} {hint} ({what}): {detail}")
        if doc is None:
            raise self._not_the_service(resp, ctype, what)
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
    async def _error_doc(resp: aiohttp.ClientResponse) -> tuple[str, str, dict] | None:
        """``(error, detail, body)`` of the service's JSON error body, or None when the answer is not one."""
        if resp.content_type != "application/json":
            return None
        try:
            doc = json.loads(await resp.content.read(1 << 16))
        except ValueError:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("error"), str):
            return None
        return doc["error"], " ".join(str(doc.get("detail", "")).split()), doc

    def _not_the_service(self, resp: aiohttp.ClientResponse, expected: str, what: str) -> DataferryError:
        """One line for an answer that did not come from a data service: what
        was expected, what answered, the URL asked; never the page itself."""
        got = f"HTTP {resp.status} {resp.reason or ''}".rstrip() + f" ({resp.content_type})"
        asked = f"{resp.method} {resp.url}"
        if resp.status in _GATEWAY:  # a proxy or balancer whose service is down or restarting: retryable
            return StoreUnavailable(
                f"{self.url}: {what}: expected the data service's answer, got {got} from {asked} (a proxy?)"
            )
        return RequestRejected(
            self.url, resp.status, "not_a_data_service", got,
            message=f"not a dataferry data service at {self.url} (wrong URL or prefix?): {what}: "
                    f"expected 200 {expected} or a JSON error, got {got} from {asked}",
        )

    def _translate(self, exc: BaseException, what: str) -> StoreError:
        if isinstance(exc, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
            return StoreTimeout(f"{self.url}: {what} timed out: {exc or type(exc).__name__}")
        if isinstance(exc, aiohttp.ClientSSLError):
            return StoreUnavailable(f"TLS with {self.url} failed ({what}): {exc}")
        if isinstance(exc, (aiohttp.ClientConnectorError,)):
            return StoreUnavailable(f"cannot connect to {self.url} ({what}): {exc.os_error or exc}")
        if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError, EOFError)):
            return StoreUnavailable(f"lost connection to {self.url} during {what}: {exc or type(exc).__name__}")
        return StoreError(f"{self.url}: {what} failed: {exc}")

    # --- lifetime ----------------------------------------------------------------------
    async def close(self) -> None:
        """Close the pool. Safe to call twice."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> HttpSource:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"HttpSource({self.url!r})"
