"""The Loader takes what a training script has: a data service URL, a dataset, a token
(or the token file) and the CA bundle for its certificate, with no HttpSource factory.
A real service on loopback, over TLS with a self-signed certificate, requiring a token."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator

import pytest

from dataferry.client import HttpOptions, Loader, TokenRefused
from dataferry.schema import ConfigError, LoopThread, TLSFailed
from dataferry.server import ServerOptions, make_app
from server_kit import make_samples, seeded_db, self_signed, serve

TOKEN = "loader-secret-5d2e7a"


@pytest.fixture(scope="module")
def tls_service(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(URL, CA file) of a data service on loopback over TLS that requires TOKEN."""
    folder = tmp_path_factory.mktemp("svc")
    db = seeded_db(folder / "d.db", "d", make_samples(100, size=1000))
    cert, key = self_signed(folder)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    loop, stack = LoopThread("test-service"), contextlib.AsyncExitStack()

    async def enter():
        return await stack.enter_async_context(serve(make_app(db, ServerOptions(token=TOKEN)), ssl_context=ctx))

    try:
        yield loop.call(enter(), timeout=30), cert
    finally:
        try:
            loop.call(stack.aclose(), timeout=30)
        finally:
            loop.stop()


def _ids(loader: Loader) -> list[int]:
    return sorted(i for batch in loader for i in batch.ids.tolist())


def test_a_token_file_and_a_ca_file_read_a_tls_service(tls_service, tmp_path):
    url, ca = tls_service
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# the client's copy\n{TOKEN}\n")
    with Loader(url, "d", batch_size=16, token_file=str(tokens), ca_file=ca) as loader:
        assert len(_ids(loader)) == 100


def test_a_literal_token_and_http_options(tls_service):
    url, ca = tls_service
    with Loader(url, "d", batch_size=16, token=TOKEN, ca_file=ca, http=HttpOptions(connections=4)) as loader:
        assert len(_ids(loader)) == 100
    with Loader(url, "d", batch_size=16, token=TOKEN, http=HttpOptions(ca_file=ca)) as loader:
        assert len(_ids(loader)) == 100


def test_without_the_ca_file_or_the_token_it_fails_at_once(tls_service):
    url, ca = tls_service
    with pytest.raises(TLSFailed):
        with Loader(url, "d", batch_size=16, token=TOKEN) as loader:
            next(iter(loader))
    with pytest.raises(TokenRefused):
        with Loader(url, "d", batch_size=16, token="not-the-token", ca_file=ca) as loader:
            next(iter(loader))


def test_service_options_are_checked_before_anything_opens():
    with pytest.raises(ConfigError, match="token= or token_file="):
        Loader("https://127.0.0.1:1", "d", token="a", token_file="/x")
    with pytest.raises(ConfigError, match="ca_file=.*plain HTTP"):
        Loader("http://127.0.0.1:1", "d", ca_file="/x")
    with pytest.raises(ConfigError, match="token=, ca_file= are for a data service URL"):
        Loader("sqlite:///nonexistent.db", "d", token="a", ca_file="/x")
