"""What cannot heal on the CQL path fails at once, on real Cassandra 5.0.

* a node with password authentication refuses a wrong password: ``AccessDenied``
  within 5 s, from ``open_store`` and from a Loader (whose ``Retry`` would wait
  300 s for a retryable error), with no password in the message or the log;
* the right password works (the control);
* ``tls=1`` without the node's CA: ``TLSFailed`` within 5 s, naming the cause.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

import pytest

from conftest import _no_cassandra
from dataferry.client import Loader
from dataferry.schema import AccessDenied, PermanentStoreError, TLSFailed, open_store, parse_store_url
from dataferry.schema._ddl import apply_schema
from server_kit import seed_url

pytestmark = pytest.mark.cassandra

SECRET = "n0t-the-Passw0rd"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A node that requires a password (the default superuser, cassandra/cassandra); a keyspace on it."""
    if os.environ.get("DATAFERRY_TEST_CASSANDRA"):
        pytest.skip("needs a node of its own with password authentication")
    from dataferry.bench._devcassandra import DevCassandra

    node = DevCassandra(str(tmp_path_factory.mktemp("auth")), auth=True)
    try:
        node.start()
    except Exception as exc:  # noqa: BLE001 - reported through skip/fail
        node.stop()
        _no_cassandra(f"node with auth: {type(exc).__name__}: {exc}")
    keyspace = f"a{uuid.uuid4().hex[:10]}"
    try:
        asyncio.run(apply_schema(parse_store_url(f"cassandra://cassandra:cassandra@127.0.0.1:{node.port}/{keyspace}")))
        yield node.port, keyspace
    finally:
        node.stop()


def _open(url: str):
    async def go():
        async with await open_store(url, create=False):
            pass

    asyncio.run(go())


def test_a_wrong_password_is_refused_at_once_and_never_printed(guarded, caplog):
    port, keyspace = guarded
    url = f"cassandra://cassandra:{SECRET}@127.0.0.1:{port}/{keyspace}"
    caplog.set_level(logging.DEBUG)
    t0 = time.monotonic()
    with pytest.raises(AccessDenied) as err:
        _open(url)
    assert time.monotonic() - t0 < 5
    assert "credentials were refused" in str(err.value) and isinstance(err.value, PermanentStoreError)

    t0 = time.monotonic()
    with pytest.raises(AccessDenied):
        with Loader(url, "d", batch_size=8) as loader:
            next(iter(loader))
    assert time.monotonic() - t0 < 5
    assert SECRET not in str(err.value) and SECRET not in caplog.text


def test_the_right_password_reads(guarded):
    from server_kit import make_samples

    port, keyspace = guarded
    url = f"cassandra://cassandra:cassandra@127.0.0.1:{port}/{keyspace}"
    samples = make_samples(20, size=100)
    seed_url(url, "d", samples)
    with Loader(url, "d", batch_size=8) as loader:
        assert sorted(i for b in loader for i in b.ids.tolist()) == sorted(s.id for s in samples)


def test_tls_without_the_nodes_ca_fails_at_once(cassandra_url, dev_cassandra):
    url = cassandra_url + "?tls=1"  # the node's certificate is self-signed: the system's CAs refuse it
    t0 = time.monotonic()
    with pytest.raises(TLSFailed) as err:
        _open(url)
    assert time.monotonic() - t0 < 5
    assert "certificate" in str(err.value).lower() and "tls_ca" in str(err.value)
    _open(f"{url}&tls_ca={dev_cassandra.ca_path}")  # the control: with its CA it connects
