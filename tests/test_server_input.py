"""Bad input never reaches the store and never makes a 5xx: every case gets a
4xx with a JSON body ``{"error", "detail"}`` naming the problem.

One server (SQLite, with a token) serves every case of this module; raw
requests go through aiohttp's low-level client so paths are sent unnormalized.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from yarl import URL

from dataferry.schema._wire import encode_ids
from dataferry.server import ServerOptions, make_app
from server_kit import SPEC, live_server, make_samples, seeded_db

TOKEN = "input-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BIN = {"Content-Type": "application/octet-stream", **AUTH}
JSON = {"Content-Type": "application/json", **AUTH}
SAMPLES_T = "/v1/datasets/{name}/samples"
MAX_IDS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The base URL of one server for the module, in a background loop thread."""
    url = seeded_db(tmp_path_factory.mktemp("input") / "s.db", "d", make_samples(5))
    opts = ServerOptions(token=TOKEN, max_ids=MAX_IDS, max_body_bytes=4096)
    with live_server(lambda: make_app(url, opts)) as srv:
        yield srv.base


def request(base: str, method: str, path: str, *, template: str | None = None, **kw) -> tuple[int, dict, bytes]:
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.request(method, URL(base + path, encoded=True), **kw) as resp:
                body = await resp.read()
                if template is not None:
                    SPEC.check(method, template, resp.status, resp.headers.get("Content-Type", ""), body)
                return resp.status, dict(resp.headers), body

    return asyncio.run(go())


def assert_json_4xx(status: int, body: bytes, error: str | None = None, status_is: int | None = None) -> dict:
    assert 400 <= status < 500, (status, body)
    if status_is is not None:
        assert status == status_is, (status, body)
    doc = json.loads(body)
    assert isinstance(doc["error"], str) and isinstance(doc["detail"], str) and doc["detail"], doc
    if error is not None:
        assert doc["error"] == error, doc
    return doc


# --- batch fetch bodies -------------------------------------------------------------------------------
BODIES = [
    pytest.param(BIN, b"", "no_ids", id="empty"),
    pytest.param(BIN, b"\x01" * 7, "bad_body", id="odd-length"),
    pytest.param(BIN, b"\x01" * 17, "bad_body", id="not-a-multiple-of-8"),
    pytest.param(BIN, encode_ids(range(MAX_IDS + 1)), "too_many_ids", id="too-many-ids"),
    pytest.param(BIN, encode_ids([3, 4, 3]), "duplicate_ids", id="duplicate-ids"),
    pytest.param(BIN, b'{"ids": [1, 2]}', "bad_body", id="json-where-binary-expected"),
    pytest.param(JSON, encode_ids([1, 2]), "bad_json", id="binary-where-json-expected"),
    pytest.param(JSON, b"", "no_ids", id="json-empty"),
    pytest.param(JSON, b"{", "bad_json", id="json-truncated"),
    pytest.param(JSON, b"[1, 2]", "bad_body", id="json-array"),
    pytest.param(JSON, b'{"ids": []}', "no_ids", id="json-no-ids"),
    pytest.param(JSON, b'{"ids": [1], "x": 1}', "bad_body", id="json-extra-key"),
    pytest.param(JSON, b'{"ids": "1,2"}', "bad_body", id="json-ids-string"),
    pytest.param(JSON, b'{"ids": [1.5]}', "bad_id", id="json-float"),
    pytest.param(JSON, b'{"ids": [true]}', "bad_id", id="json-bool"),
    pytest.param(JSON, b'{"ids": ["7"]}', "bad_id", id="json-string-id"),
    pytest.param(JSON, b'{"ids": [9223372036854775808]}', "bad_id", id="json-beyond-int64"),
    pytest.param(JSON, b'{"ids": [1, 1]}', "duplicate_ids", id="json-duplicates"),
    pytest.param(JSON, b'{"ids": [NaN]}', "bad_id", id="json-nan"),
    pytest.param(JSON, b"[" * 2000 + b"]" * 2000, "bad_json", id="json-deep-nesting"),
    pytest.param(JSON, b"\xff\xfe{}", "bad_json", id="json-not-utf8"),
    pytest.param({"Content-Type": "text/plain", **AUTH}, encode_ids([1]), "unsupported_media_type", id="text-plain"),
    pytest.param({"Content-Type": "multipart/form-data; boundary=x", **AUTH}, b"--x--", "unsupported_media_type",
                 id="multipart"),
    pytest.param({"Content-Type": "", **AUTH}, encode_ids([1]), "unsupported_media_type", id="empty-content-type"),
    pytest.param(AUTH, encode_ids([1]), "unsupported_media_type", id="no-content-type"),
    pytest.param(BIN, b"\x00" * 8000, "body_too_large", id="body-too-large"),
]


@pytest.mark.parametrize("headers,body,error", BODIES)
def test_bad_batch_bodies(server, headers, body, error):
    kw = {"skip_auto_headers": ["Content-Type"]} if "Content-Type" not in headers else {}
    status, _, raw = request(server, "POST", "/v1/datasets/d/samples", template=SAMPLES_T, data=body,
                             headers=headers, **kw)
    assert_json_4xx(status, raw, error)


def test_a_good_request_still_works(server):
    status, headers, _ = request(server, "POST", "/v1/datasets/d/samples", template=SAMPLES_T,
                                 data=encode_ids([1, 2]), headers=BIN)
    assert status == 200


# --- names and paths ------------------------------------------------------------------------------------
NAMES = [
    pytest.param("%2e%2e", id="dot-dot-encoded"),
    pytest.param("..", id="dot-dot"),
    pytest.param(".hidden", id="leading-dot"),
    pytest.param("-x", id="leading-dash"),
    pytest.param("a%20b", id="space"),
    pytest.param("%C3%A9t%C3%A9", id="unicode"),
    pytest.param("x" * 129, id="overlong"),
    pytest.param("a%00b", id="nul"),
    pytest.param("a%2Fb", id="encoded-slash"),
    pytest.param("a;b", id="semicolon"),
    pytest.param("%252e%252e", id="double-encoded"),
    pytest.param("a%0D%0Ab", id="crlf"),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("method,path,template", [
    ("GET", "/v1/datasets/{}", "/v1/datasets/{name}"),
    ("GET", "/v1/datasets/{}/splits/all", "/v1/datasets/{name}/splits/{split}"),
    ("GET", "/v1/datasets/d/splits/{}", "/v1/datasets/{name}/splits/{split}"),
    ("POST", "/v1/datasets/{}/samples", SAMPLES_T),
])
def test_bad_names(server, name, method, path, template):
    status, _, body = request(server, method, path.format(name), data=encode_ids([1]), headers=BIN)
    doc = assert_json_4xx(status, body)
    if status == 400:
        assert doc["error"] in ("bad_dataset_name", "bad_split_name") and "name" in doc["detail"]
        SPEC.check(method, template, status, "application/json", body)
    else:  # the router never matched (e.g. an encoded slash): 404, still JSON
        assert status == 404 and doc["error"] == "not_found"


@pytest.mark.parametrize("path", [
    "/v1/datasets/../../etc/passwd",
    "/../../etc/passwd",
    "/v1/datasets/d/../../../etc/passwd",
    "/v1/datasets/%2e%2e/%2e%2e/etc/passwd",
    "/static/x",
    "/v1/../openapi.yaml",
    "/v1/datasets/d/split",
    "/v2/datasets",
])
def test_paths_outside_the_api_are_404_json(server, path):
    status, _, body = request(server, "GET", path, headers=AUTH)
    assert_json_4xx(status, body, "not_found", status_is=404)
    assert b"root:" not in body


def test_unknown_dataset_is_404_naming_it(server):
    status, _, body = request(server, "POST", "/v1/datasets/ghost/samples", template=SAMPLES_T,
                              data=encode_ids([1]), headers=BIN)
    doc = assert_json_4xx(status, body, "dataset_not_found", status_is=404)
    assert doc["dataset"] == "ghost" and "ghost" in doc["detail"]


# --- methods, queries, headers ------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path", [
    ("PUT", "/v1/datasets/d/samples"),
    ("DELETE", "/v1/datasets/d"),
    ("GET", "/v1/datasets/d/samples"),
    ("GET", "/v1/datasets/d/splits"),  # POST only: derives a split from a filter
    ("POST", "/v1/datasets"),
    ("PATCH", "/healthz"),
    ("HEAD", "/v1/datasets"),
])
def test_wrong_methods_are_405_json(server, method, path):
    status, headers, body = request(server, method, path, headers=AUTH)
    assert status == 405 and "Allow" in headers
    if method != "HEAD":
        assert_json_4xx(status, body, "method_not_allowed")


@pytest.mark.parametrize("path,template", [
    ("/v1/datasets?x=1", "/v1/datasets"),
    ("/v1/datasets/d?limit=10", "/v1/datasets/{name}"),
    ("/v1/datasets/d/splits/all?format=json", "/v1/datasets/{name}/splits/{split}"),
])
def test_unexpected_query_parameters_are_400(server, path, template):
    status, _, body = request(server, "GET", path, template=template, headers=AUTH)
    assert_json_4xx(status, body, "unexpected_query", status_is=400)


@pytest.mark.parametrize("headers", [
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer  "},
    {"Authorization": "Basic aW5wdXQtdGVzdC10b2tlbg=="},
    {"Authorization": "Digest username=x"},
    {"Authorization": f"bearer{TOKEN}"},
    {"Authorization": f"Token {TOKEN}"},
    {"Authorization": f"Bearer {TOKEN}\u00e9".encode("utf-8").decode("latin-1")},
    {"Authorization": f"Bearer {TOKEN[:-1]}"},
    {"Authorization": "Bearer " + "x" * 4000},
])
def test_bad_authorization_is_401_json(server, headers):
    status, h, body = request(server, "GET", "/v1/datasets", template="/v1/datasets", headers=headers)
    assert_json_4xx(status, body, status_is=401)
    assert h["WWW-Authenticate"].startswith("Bearer")


def test_two_authorization_headers_are_refused(server):
    from multidict import CIMultiDict

    headers = CIMultiDict([("Authorization", f"Bearer {TOKEN}"), ("Authorization", "Bearer other")])
    status, _, body = request(server, "GET", "/v1/datasets", template="/v1/datasets", headers=headers)
    assert_json_4xx(status, body, "missing_token", status_is=401)


def test_bearer_scheme_is_case_insensitive(server):
    status, _, _ = request(server, "GET", "/v1/datasets", template="/v1/datasets",
                           headers={"Authorization": f"bearer {TOKEN}"})
    assert status == 200


def test_malformed_http_is_answered_json_as_under_dataferry_serve(server):
    """The kit serves the app with the server's own Runner, so a request
    aiohttp cannot parse gets the JSON error body here as in production."""
    import socket

    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header : 1\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", head
    assert b"content-type: application/json" in head.lower(), head
    assert_json_4xx(400, body)
