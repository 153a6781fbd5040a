"""A Loader or HttpSource pointed at an HTTP server that is not a dataferry data
service (a static file server, a web app answering HTML) fails with one line:
what was expected, what answered (status, content type) and the URL, never
the HTML page it got.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from dataferry.client import Loader
from dataferry.schema.sources.http._source import HttpSource, RequestRejected
from dataferry.schema._errors import DataferryError, StoreUnavailable
from server_kit import live_server, run, serve


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def static_server(root) -> Iterator[str]:
    """``python -m http.server`` serving ``root`` on loopback, in a thread:
    HTML 404 for every path it lacks, HTML 501 for POST."""
    handler = functools.partial(_Quiet, directory=str(root))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}"
        finally:
            httpd.shutdown()
            thread.join(5)


_PAGE = "<!DOCTYPE html>\n<html>\n<head><title>Welcome</title></head>\n<body>\n<h1>It works!</h1>\n</body>\n</html>\n"


def html_app() -> web.Application:
    """A web app that answers every GET and POST with a 200 HTML page."""

    async def page(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text=_PAGE, content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", page)
    return app


def _one_line(exc: BaseException, url: str, status: str, ctype: str, *, not_a_service: bool = True) -> str:
    msg = str(exc)
    assert "\n" not in msg and "<" not in msg and "It works" not in msg, msg
    assert url in msg and status in msg and ctype in msg and "expected" in msg, msg
    assert ("not a dataferry data service" in msg) == not_a_service, msg
    return msg


async def _each_call(url: str) -> list[BaseException]:
    """What each HttpSource call raises against ``url``."""
    out = []
    async with await HttpSource.open(url) as src:
        for call in (src.list_datasets(), src.get_dataset("d"), src.list_splits("d"), src.read_split("d", "all"),
                     _drain(src.fetch("d", [1, 2]))):
            with pytest.raises(DataferryError) as info:
                await call
            out.append(info.value)
    return out


async def _drain(agen) -> list:
    return [r async for r in agen]


def test_a_static_file_server_answering_html_404(tmp_path):
    (tmp_path / "index.html").write_text(_PAGE)
    with static_server(tmp_path) as url:
        errors = run(_each_call(url))
        for exc in errors[:4]:  # GETs: 404 text/html
            assert isinstance(exc, RequestRejected) and exc.status == 404
            _one_line(exc, url, "HTTP 404", "text/html")
        # POST: http.server answers 501 Unsupported method, as HTML
        assert isinstance(errors[4], RequestRejected) and errors[4].status == 501
        _one_line(errors[4], url, "HTTP 501", "text/html")
        assert "/v1/datasets/d/splits/all" in str(errors[3])  # the request that got the page

        with Loader(url, "d", batch_size=4) as loader:
            with pytest.raises(RequestRejected) as info:
                len(loader)
        _one_line(info.value, url, "HTTP 404", "text/html")


def test_a_web_app_answering_html_200():
    # a plain aiohttp app (web.AppRunner), in a loop thread: the Loader blocks this one
    with live_server(html_app, runner=web.AppRunner) as srv:
        url = srv.base
        errors = run(_each_call(url))
        for exc in errors:
            assert isinstance(exc, RequestRejected) and exc.status == 200
            _one_line(exc, url, "HTTP 200", "text/html")
        assert "application/x-dataferry-idlist" in str(errors[3])  # what a split read expects
        assert "application/json" in str(errors[0])

        with Loader(url, "d", batch_size=4) as loader:
            with pytest.raises(RequestRejected) as info:
                next(iter(loader))
        _one_line(info.value, url, "HTTP 200", "text/html")


def test_a_gateway_error_page_stays_retryable():
    """A proxy's HTML 502 in front of a restarting service is transient: StoreUnavailable, still one line."""

    async def bad_gateway(request: web.Request) -> web.Response:
        return web.Response(status=502, text=_PAGE, content_type="text/html")

    app = web.Application()
    app.router.add_get("/{tail:.*}", bad_gateway)

    async def go():
        async with serve(app, runner=web.AppRunner) as url, await HttpSource.open(url) as src:
            with pytest.raises(StoreUnavailable) as info:
                await src.read_split("d", "all")
            _one_line(info.value, url, "HTTP 502", "text/html", not_a_service=False)

    run(go())
