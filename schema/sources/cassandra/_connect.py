"""Connecting to Cassandra/ScyllaDB, and translating the driver's errors.

Shared by the store (``_store.py``) and ``schema apply`` (``_ddl.py``).
Contract: :func:`open_cluster` returns a connected ``Cluster`` speaking native
protocol v4 (Cassandra 2.2 to 5.0, ScyllaDB), or raises StoreUnavailable
naming the hosts; :func:`shutdown` ends it with nothing left running;
:func:`translate` maps a driver error to the dataferry error tree. It differs
from a plain ``Cluster`` in the driver's patches (``_driver_patches.py``: fewer
set-up round trips, whole frames read in place, a libev loop that ends with its
last connection) and no schema metadata. Why each: README.md, The Cassandra path.
"""

from __future__ import annotations

import ssl
import weakref
from collections.abc import Sequence

from ..._errors import AccessDenied, StoreError, StoreTimeout, StoreUnavailable, TLSFailed
from ..._url import CassandraOptions, redact_url
from .._tls import client_context
from ._driver_patches import (
    PROTOCOL_VERSION, _answers_early, _cluster_class, _connection_class, _mend_libev_timer, _warm_up, release_warm,
)

__all__ = ["connect", "open_cluster", "shutdown", "translate", "where"]


def where(opts: CassandraOptions) -> str:
    """``host1,host2:port/keyspace``: names the store in messages, never the password."""
    return f"{','.join(opts.hosts)}:{opts.port}/{opts.keyspace}"


def _ssl_context(opts: CassandraOptions) -> ssl.SSLContext | None:
    if not (opts.tls or opts.tls_ca or opts.tls_cert):
        return None
    return client_context(opts.tls_ca, verify=opts.tls_verify, cert=opts.tls_cert, key=opts.tls_key,
                          what=f"cassandra TLS files (tls_ca={opts.tls_ca}, tls_cert={opts.tls_cert})")


def shutdown(cluster) -> None:
    """Blocking: ``cluster.shutdown()``, then close the connections it left open (opened ahead
    and taken by no pool, or added to a pool that was shutting down)."""
    cluster.shutdown()
    release_warm(cluster)
    for conn in list(getattr(cluster.connection_class, "opened", ())):
        if not conn.is_closed:
            conn.close()


def _routing(child):
    from cassandra.policies import TokenAwarePolicy

    class _Routing(TokenAwarePolicy):
        """Token-aware routing (the replicas first, in ring order), skipped while the cluster has a
        single node."""

        def __init__(self, child_policy) -> None:
            super().__init__(child_policy)
            self._child = child_policy
            self._hosts: set = set()

        def populate(self, cluster, hosts):
            self._hosts = set(hosts)
            super().populate(cluster, hosts)

        def on_add(self, host, *args, **kwargs):
            self._hosts.add(host)
            return super().on_add(host, *args, **kwargs)

        def on_remove(self, host, *args, **kwargs):
            self._hosts.discard(host)
            return super().on_remove(host, *args, **kwargs)

        def make_query_plan(self, working_keyspace=None, query=None):
            if len(self._hosts) <= 1:
                return self._child.make_query_plan(working_keyspace, query)
            return super().make_query_plan(working_keyspace, query)

    return _Routing(child)


#: times a request the server timed out or could not place is sent again (to the next host of its plan)
_SERVER_RETRIES = 2


def _retry_policy():
    """The driver's retry policy for dataferry's requests, all idempotent (reads, inserts of whole
    rows whose ids are content hashes, deletes): a coordinator's read or write timeout, or an
    Unavailable (it thought too few replicas alive, as while a node restarts), is sent again to
    the next host, ``_SERVER_RETRIES`` times. The driver's default rethrows a write timeout, and
    an ingest on a busy cluster failed on one."""
    from cassandra.policies import RetryPolicy

    class _IdempotentRetry(RetryPolicy):
        def on_read_timeout(self, query, consistency, required_responses, received_responses, data_retrieved,
                            retry_num):
            return (self.RETRY_NEXT_HOST, None) if retry_num < _SERVER_RETRIES else (self.RETHROW, None)

        def on_write_timeout(self, query, consistency, write_type, required_responses, received_responses,
                             retry_num):
            return (self.RETRY_NEXT_HOST, None) if retry_num < _SERVER_RETRIES else (self.RETHROW, None)

        def on_unavailable(self, query, consistency, required_replicas, alive_replicas, retry_num):
            return (self.RETRY_NEXT_HOST, None) if retry_num < _SERVER_RETRIES else (self.RETHROW, None)

    return _IdempotentRetry()


def open_cluster(opts: CassandraOptions, *, prepare: Sequence[str] = (), ask: Sequence[str] = (), **cluster_args):
    """Blocking: ``(cluster, session, early)`` connected to ``opts``'s hosts; no keyspace is set
    or checked. Raise StoreUnavailable naming the hosts when none answers.

    ``prepare``: CQL statements to prepare, and ``ask``: queries to run (at ONE), on the
    first pool connection while the control connection is still being set up; ``early``
    maps each one done so to its ``PreparedStatement`` (or the error the server answered:
    a missing keyspace or table) or to its rows. Those left out are the caller's to do.
    End with :func:`shutdown`, not ``cluster.shutdown()`` alone.

    Round trips: the control connection's (connect, STARTUP with OPTIONS beside it, then
    REGISTER with the peers and local queries); beside it, a pool connection to each
    contact point (connect, STARTUP) and the first one's PREPAREs and queries.
    """
    from cassandra import ConsistencyLevel
    from cassandra.auth import PlainTextAuthProvider
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import DCAwareRoundRobinPolicy, RoundRobinPolicy
    from cassandra.query import tuple_factory

    child = DCAwareRoundRobinPolicy(opts.local_dc) if opts.local_dc else RoundRobinPolicy()
    profile = ExecutionProfile(
        load_balancing_policy=_routing(child),
        consistency_level=ConsistencyLevel.name_to_value[opts.consistency or "ONE"],
        request_timeout=opts.request_timeout,
        row_factory=tuple_factory,
        retry_policy=_retry_policy(),
    )
    if opts.username:
        cluster_args["auth_provider"] = PlainTextAuthProvider(opts.username, opts.password or "")
    cluster = _cluster_class()(
        list(opts.hosts),
        port=opts.port,
        protocol_version=PROTOCOL_VERSION,
        execution_profiles={EXEC_PROFILE_DEFAULT: profile},
        connect_timeout=opts.connect_timeout,
        control_connection_timeout=opts.connect_timeout,
        ssl_context=_ssl_context(opts),
        compression=False,  # encoded images do not compress
        schema_metadata_enabled=False,  # we need the keyspace only; loaded by the caller
        connection_class=_connection_class(Cluster.connection_class),
        **cluster_args,
    )
    cluster.connection_class.control = weakref.ref(cluster.control_connection)
    _mend_libev_timer(cluster.connection_class)
    _warm_up(cluster, prepare, ask)
    try:
        session = cluster.connect()
    except Exception as exc:
        shutdown(cluster)
        err = translate(exc, f"cannot connect to cassandra store {where(opts)}")
        raise err from (None if err is exc else exc)
    return cluster, session, _answers_early(cluster, prepare, ask)


def connect(opts: CassandraOptions, **cluster_args):
    """Blocking: ``(cluster, session, keyspace_exists)`` for ``opts``; no keyspace is set.

    :func:`open_cluster`, then the keyspace is looked up and, when it exists, loaded
    (for token-aware routing). End with :func:`shutdown`. Raise StoreUnavailable
    naming the hosts when none answers. Used by ``schema apply``.
    """
    cluster, session, _ = open_cluster(opts, **cluster_args)
    try:
        rows = session.execute("SELECT keyspace_name FROM system_schema.keyspaces WHERE keyspace_name=%s",
                               (opts.keyspace,))
        exists = bool(list(rows))
        if exists:  # replica placement for token-aware routing needs the keyspace's replication
            cluster.refresh_keyspace_metadata(opts.keyspace)
        release_warm(cluster)
    except Exception as exc:
        shutdown(cluster)
        err = translate(exc, f"cannot connect to cassandra store {where(opts)}")
        raise err from (None if err is exc else exc)
    return cluster, session, exists


def _is_connection_error(exc: BaseException) -> bool:
    from cassandra import AuthenticationFailed, Unavailable
    from cassandra.cluster import NoHostAvailable
    from cassandra.connection import ConnectionException

    return isinstance(exc, (NoHostAvailable, ConnectionException, AuthenticationFailed, Unavailable, OSError))


def _permanent(exc: BaseException) -> tuple[type[StoreError], str] | None:
    """``(AccessDenied or TLSFailed, the reason)`` when every host refused the credentials or
    failed TLS verification: no retry can change that. None otherwise."""
    from cassandra import AuthenticationFailed
    from cassandra.cluster import NoHostAvailable

    causes = list(exc.errors.values()) if isinstance(exc, NoHostAvailable) else [exc]
    if not causes:
        return None
    if all(isinstance(c, AuthenticationFailed) for c in causes):
        return AccessDenied, f"the credentials were refused: {causes[0]}"
    if all(_certificate_failed(c) for c in causes):
        return TLSFailed, f"TLS certificate verification failed: {causes[0]}; pass the CA with ?tls_ca=PATH"
    return None


def _certificate_failed(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:  # the driver wraps the ssl error
        seen.add(id(exc))
        if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _missing_schema(exc: BaseException) -> bool:
    """Whether the server said a keyspace or table does not exist (Cassandra 5: "table x does not
    exist"; 3 and 4: "unconfigured table x")."""
    text = str(exc).lower()
    return (("keyspace" in text or "table" in text) and "not exist" in text) or "unconfigured" in text


def translate(exc: BaseException, message: str, *, url: str | None = None) -> BaseException:
    """The dataferry error for a driver error, ``message`` first; ``exc`` itself if it is not one.

    ``url`` (redacted here) adds the ``schema apply`` hint to missing-table errors.
    """
    from cassandra import DriverException, OperationTimedOut, Timeout

    if isinstance(exc, (OperationTimedOut, Timeout)):
        return StoreTimeout(f"{message}: timed out: {exc}")
    permanent = _permanent(exc)
    if permanent is not None:
        kind, why = permanent
        return kind(f"{message}: {why}")
    if _is_connection_error(exc):
        return StoreUnavailable(f"{message}: store unreachable: {exc}")
    if isinstance(exc, DriverException):
        if url is not None and _missing_schema(exc):
            return StoreUnavailable(f"{message}: {exc}; run: dataferry schema apply --store {redact_url(url)}")
        return StoreError(f"{message}: {exc}")
    return exc  # not the store's fault (e.g. a bad bind value): let it through as it is
