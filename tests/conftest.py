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
import collections
import itertools
import json
import os
import tempfile
import uuid
from pathlib import Path

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


# --- two workers, on request: ``pytest -n 2`` (pytest-xdist, in the dev extra) ---------------------
# Every test that runs Cassandra goes to one worker, as one unit in file order: the session's node
# and the 3-node cluster start once, never twice side by side on the same two cores; each other
# test file is a unit of its own (its module fixtures set up once), the largest units first.
# xdist's own ``--dist loadgroup`` cannot do it here: it renames a test by ``item._nodeid``, which
# pytest 9.2 no longer reads, so the groups are passed by a file: each worker writes the ids of the
# Cassandra tests it collected, the controller's scheduler reads them (the workers' collections
# are identical, and complete, before it schedules anything).
# Not the default: the whole suite took 581-657 s this way against 973-1,151 s in one process (2
# cores, 2026-11-27), but each of two runs had two tests red that pass alone or in one process
# (timing bounds written for one process beside the JVMs, and an Unavailable that the driver
# reported as "no host" under load); the README's command runs one process.

#: fixtures that start or use a Cassandra JVM
_CASSANDRA_FIXTURES = frozenset({"dev_cassandra", "cassandra_server", "cassandra_url", "cluster", "nodes"})
_GROUPS = "dataferry_cassandra_tests"


def _uses_cassandra(item) -> bool:
    return (item.get_closest_marker("cassandra") is not None
            or bool(set(getattr(item, "fixturenames", ())) & _CASSANDRA_FIXTURES)
            or "DevCassandra" in getattr(getattr(item, "module", None), "__dict__", {}))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """The controller: where the workers write the Cassandra tests' ids."""
    config = node.config
    path = getattr(config, "_dataferry_groups", None)
    if path is None:
        folder = tempfile.mkdtemp(prefix="dataferry-xdist-")
        path = config._dataferry_groups = str(Path(folder) / "cassandra.json")
        config.add_cleanup(lambda: (Path(path).unlink(missing_ok=True), os.rmdir(folder)))
    node.workerinput[_GROUPS] = path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # schemathesis names its items ``test_fuzz[GET /v1/datasets]`` after pytest 9.2 made their ids
    # (all ``test_fuzz``): xdist's scheduler keys tests by id, so the name goes into the id
    counts = collections.Counter(item.nodeid for item in items)
    for item in items:
        if counts[item.nodeid] > 1 and not item.nodeid.endswith(item.name) and hasattr(item, "_id"):
            item._id = item.parent.id.child(item.name)
    path = getattr(config, "workerinput", {}).get(_GROUPS)
    if path is None:
        return
    ids = [item.nodeid for item in items if _uses_cassandra(item)]
    tmp = f"{path}.{os.getpid()}"
    Path(tmp).write_text(json.dumps(ids))
    os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class CassandraTogether(LoadScopeScheduling):
        """Scopes: ``cassandra`` for the tests the workers named, else the test's file."""

        def _split_scope(self, nodeid: str) -> str:
            names = getattr(self, "_cassandra", None)
            if names is None:
                names = self._cassandra = frozenset(json.loads(Path(config._dataferry_groups).read_text()))
            return "cassandra" if nodeid in names else nodeid.split("::", 1)[0]

    return CassandraTogether(config, log)
