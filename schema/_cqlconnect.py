"""Connecting to Cassandra/ScyllaDB, and translating the driver's errors.

Shared by the store (``_cassandra.py``) and ``schema apply`` (``_ddl.py``).
One ``Cluster`` configuration works from Cassandra 1.2 (native protocol v1) to
Cassandra 5 and ScyllaDB:

* every request carries the configured consistency (default ONE) through the
  default execution profile: the driver's own default, LOCAL_ONE, does not
  exist in v1 and a 1.2 server drops the connection on it;
* the protocol version is negotiated from v5 down (the driver logs one
  "Downgrading core protocol version" line per step; ``protocol_version=N`` in
  the store URL skips that);
* schema metadata is off (no refresh storms on schema changes, no schema scan
  per worker); only the store's keyspace is loaded, for token-aware routing;
* the driver's libev IO loop stops its timer once no timer is pending
  (:func:`_mend_libev_timer`), so that it ends with the last connection instead
  of spinning a core after ``Cluster.shutdown()``.
"""

from __future__ import annotations

import math
import ssl
import time

from ._errors import ConfigError, StoreError, StoreTimeout, StoreUnavailable
from ._url import CassandraOptions, redact_url

__all__ = ["connect", "translate", "where"]


def where(opts: CassandraOptions) -> str:
    """``host1,host2:port/keyspace``: names the store in messages, never the password."""
    return f"{','.join(opts.hosts)}:{opts.port}/{opts.keyspace}"


def _ssl_context(opts: CassandraOptions) -> ssl.SSLContext | None:
    if not (opts.tls or opts.tls_ca or opts.tls_cert):
        return None
    try:
        ctx = ssl.create_default_context(cafile=opts.tls_ca)
        if opts.tls_cert:
            ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cassandra TLS files (tls_ca={opts.tls_ca}, tls_cert={opts.tls_cert}): {exc}") from exc
    if not opts.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _auth_provider(cluster, username: str, password: str | None):
    from cassandra.auth import PlainTextAuthProvider

    class _Auth(PlainTextAuthProvider):
        # Protocol v1 (Cassandra 1.2) sends a credentials map, not SASL.
        def new_authenticator(self, host):
            if cluster.protocol_version == 1:
                return {"username": self.username, "password": self.password}
            return super().new_authenticator(host)

    return _Auth(username, password or "")


def _update_timer(self) -> None:
    """``LibevLoop._update_timer`` that also stops the timer when no timer is pending.

    The loop runs it before every wait, on its own thread. The driver's version
    (3.x, 3.30.1 included) only ever (re)starts the timer watcher, and starts it
    as a repeating one (``ev_timer_again`` with the time left to the next
    deadline as its interval); with nothing left to wait for it leaves it
    running. So the IO thread never ends, and once the last pending deadline has
    passed it wakes forever at the last interval set, which for requests
    orphaned by ``Cluster.shutdown()`` (they time out a request timeout later)
    is the gap between the last two deadlines: microseconds, a core spinning.
    """
    next_end = None if self._shutdown else self._timers.service_timeouts()
    if next_end:
        self._loop_timer.start(next_end - time.time())  # the watcher takes negative values as "now"
    else:
        self._loop_timer.stop()  # no watcher left once the connections are closed: the loop ends


def _mend_libev_timer(connection_class) -> None:
    """Install :func:`_update_timer` on the driver's libev loop (process-wide, once) if it is in use."""
    try:
        from cassandra.io.libevreactor import LibevConnection, LibevLoop
    except Exception:  # noqa: BLE001 - DependencyException or ImportError: libev is not built here
        return
    original = LibevLoop._update_timer
    if original is _update_timer or not issubclass(connection_class, LibevConnection):
        return
    if not {"_shutdown", "_timers", "service_timeouts", "_loop_timer"} <= set(original.__code__.co_names):
        return  # not the loop this was written for: leave it alone (tests/test_cql_shutdown.py will tell)
    LibevLoop._update_timer = _update_timer


def connect(opts: CassandraOptions, **cluster_args):
    """Blocking: ``(cluster, session, keyspace_exists)`` for ``opts``; no keyspace is set.

    Raise StoreUnavailable naming the hosts when none answers. Used by the store
    and by ``schema apply``.
    """
    from cassandra import ConsistencyLevel, ProtocolVersion
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import DCAwareRoundRobinPolicy, RoundRobinPolicy, TokenAwarePolicy
    from cassandra.query import tuple_factory

    child = DCAwareRoundRobinPolicy(opts.local_dc) if opts.local_dc else RoundRobinPolicy()
    profile = ExecutionProfile(
        load_balancing_policy=TokenAwarePolicy(child),
        consistency_level=ConsistencyLevel.name_to_value[opts.consistency],
        request_timeout=opts.request_timeout,
        row_factory=tuple_factory,
    )
    if opts.protocol_version is not None:
        cluster_args["protocol_version"] = opts.protocol_version  # explicit: no negotiation
    cluster = Cluster(
        list(opts.hosts),
        port=opts.port,
        execution_profiles={EXEC_PROFILE_DEFAULT: profile},
        connect_timeout=opts.connect_timeout,
        control_connection_timeout=opts.connect_timeout,
        ssl_context=_ssl_context(opts),
        compression=False,  # encoded images do not compress
        schema_metadata_enabled=False,  # we need the keyspace only; loaded below
        **cluster_args,
    )
    _mend_libev_timer(cluster.connection_class)
    if opts.protocol_version is None:
        cluster.protocol_version = ProtocolVersion.V5  # still negotiated, minus the DSE-only versions
    if opts.username:
        cluster.auth_provider = _auth_provider(cluster, opts.username, opts.password)
    if opts.protocol_version is not None and opts.protocol_version < 3:
        _size_pool(cluster, opts)  # known up front: size the pool before it opens
    try:
        session = cluster.connect()
        exists = opts.keyspace in _keyspaces(session)
        if exists:  # replica placement for token-aware routing needs the keyspace's replication
            cluster.refresh_keyspace_metadata(opts.keyspace)
    except Exception as exc:
        cluster.shutdown()
        err = translate(exc, f"cannot connect to cassandra store {where(opts)}")
        raise err from (None if err is exc else exc)
    if cluster.protocol_version < 3 and exists:
        # grow the pool only for a store that will be used: the connections it
        # opens in the background outlive a shutdown that comes before they do
        # (a missing keyspace is closed at once), keeping the driver's IO loop alive
        _size_pool(cluster, opts)
    return cluster, session, exists


def _size_pool(cluster, opts: CassandraOptions) -> None:
    """v1/v2 allow 128 requests per connection: open enough for ``concurrency``."""
    from cassandra.policies import HostDistance

    n = min(8, max(2, math.ceil(opts.concurrency / 100) + 1))
    cluster.set_max_connections_per_host(HostDistance.LOCAL, n)
    cluster.set_core_connections_per_host(HostDistance.LOCAL, n)


def _keyspaces(session) -> set[str]:
    table = "system_schema.keyspaces" if session.cluster.protocol_version >= 4 else "system.schema_keyspaces"
    try:
        return {row[0] for row in session.execute(f"SELECT keyspace_name FROM {table}")}
    except Exception:  # noqa: BLE001 - ScyllaDB/Cassandra 3 on v3: try the other table
        other = "system.schema_keyspaces" if table.startswith("system_schema") else "system_schema.keyspaces"
        return {row[0] for row in session.execute(f"SELECT keyspace_name FROM {other}")}


def _is_connection_error(exc: BaseException) -> bool:
    from cassandra import AuthenticationFailed, Unavailable
    from cassandra.cluster import NoHostAvailable
    from cassandra.connection import ConnectionException

    return isinstance(exc, (NoHostAvailable, ConnectionException, AuthenticationFailed, Unavailable, OSError))


def _missing_schema(exc: BaseException) -> bool:
    text = str(exc).lower()
    return ("keyspace" in text and "not exist" in text) or "unconfigured" in text


def translate(exc: BaseException, message: str, *, url: str | None = None) -> BaseException:
    """The dataferry error for a driver error, ``message`` first; ``exc`` itself if it is not one.

    ``url`` (redacted here) adds the ``schema apply`` hint to missing-table errors.
    """
    from cassandra import DriverException, OperationTimedOut, Timeout

    if isinstance(exc, (OperationTimedOut, Timeout)):
        return StoreTimeout(f"{message}: timed out: {exc}")
    if _is_connection_error(exc):
        return StoreUnavailable(f"{message}: store unreachable: {exc}")
    if isinstance(exc, DriverException):
        if url is not None and _missing_schema(exc):
            return StoreUnavailable(f"{message}: {exc}; run: dataferry schema apply --store {redact_url(url)}")
        return StoreError(f"{message}: {exc}")
    return exc  # not the store's fault (e.g. a bad bind value): let it through as it is
