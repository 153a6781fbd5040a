"""Shared fixtures: a real Cassandra server for the session, and a store URL
parametrized over both backends so behavioural tests run on each.

Cassandra comes from, in order:

* ``DATAFERRY_TEST_CASSANDRA=host:port``: an existing cluster (Cassandra 4/5,
  ScyllaDB); the tests create and use their own keyspace there;
* otherwise a throwaway Apache Cassandra 5.0 node (``bench/_devcassandra.py``:
  fetched from Maven Central once, run with ``java``), once per session, that
  takes plain and TLS connections on one port.

The node-failure tests run on a 3-node Cassandra 5.0 cluster of their own
(``cassandra_cluster``, in ``test_cassandra_cluster.py``), never an external one.
When Cassandra cannot start the Cassandra tests skip, unless
``DATAFERRY_REQUIRE_CASSANDRA=1`` (set by ``.ci/run``), which makes that a
failure.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid

import pytest

_REQUIRE = os.environ.get("DATAFERRY_REQUIRE_CASSANDRA") == "1"


def _no_cassandra(reason: str):
    if _REQUIRE:
        pytest.fail(f"Cassandra required (DATAFERRY_REQUIRE_CASSANDRA=1) but unavailable: {reason}", pytrace=False)
    pytest.skip(f"no Cassandra: {reason}")


@pytest.fixture(scope="session")
def dev_cassandra(tmp_path_factory):
    """The session's own one-node Cassandra 5.0 (``DevCassandra``, TLS optional on its port);
    skipped when ``DATAFERRY_TEST_CASSANDRA`` names an external one."""
    if os.environ.get("DATAFERRY_TEST_CASSANDRA"):
        pytest.skip("DATAFERRY_TEST_CASSANDRA names an external Cassandra")
    from dataferry.bench._devcassandra import DevCassandra

    server = DevCassandra(str(tmp_path_factory.mktemp("cassandra")), tls=True)
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - reported through skip/fail
        server.stop()
        _no_cassandra(f"{type(exc).__name__}: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def cassandra_server(request):
    """``(host, port)`` of a live Cassandra for the whole session."""
    external = os.environ.get("DATAFERRY_TEST_CASSANDRA")
    if external:
        host, _, port = external.rpartition(":")
        return (host or "127.0.0.1", int(port or 9042))
    server = request.getfixturevalue("dev_cassandra")
    return (server.host, server.port)


@pytest.fixture(scope="session")
def cassandra_url(cassandra_server) -> str:
    """URL of a keyspace created for this session, with the schema applied."""
    from dataferry.schema import parse_store_url
    from dataferry.schema._ddl import apply_schema

    host, port = cassandra_server
    url = f"cassandra://{host}:{port}/dft_{uuid.uuid4().hex[:12]}"
    asyncio.run(apply_schema(parse_store_url(url)))
    return url


@pytest.fixture(params=["sqlite", pytest.param("cassandra", marks=pytest.mark.cassandra)])
def store_url(request, tmp_path) -> str:
    """A store URL on each backend. SQLite gets a fresh file per test; the
    Cassandra keyspace is shared by the session, so use ``dataset_name``."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'store.db'}"
    return request.getfixturevalue("cassandra_url")


_counter = itertools.count()


@pytest.fixture
def dataset_name() -> str:
    """A dataset name unique within the session (stores may be shared)."""
    return f"ds{next(_counter)}_{uuid.uuid4().hex[:8]}"
