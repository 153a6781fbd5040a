"""Store URLs and the frozen option objects they parse into.

* ``sqlite:///abs/path/file.db``, ``sqlite:relative/file.db`` or a bare path
  ending in ``.db``/``.sqlite``: the embedded store (:class:`SqliteOptions`).
  The default is ``sqlite:dataferry.db`` in the working directory.
* ``cassandra://[user[:password]@]host1[:port],host2[:port]/keyspace?opt=v&...``
  (also ``scylla://``): a Cassandra or ScyllaDB cluster
  (:class:`CassandraOptions`). Query options are the field names of
  :class:`CassandraOptions`, e.g. ``consistency=QUORUM&tls=1&concurrency=512``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from urllib.parse import parse_qsl, unquote

from ._errors import ConfigError

__all__ = ["SqliteOptions", "CassandraOptions", "parse_store_url", "DEFAULT_STORE_URL", "redact_url"]

DEFAULT_STORE_URL = "sqlite:dataferry.db"

_CONSISTENCIES = ("ONE", "TWO", "THREE", "QUORUM", "ALL", "LOCAL_QUORUM", "EACH_QUORUM", "LOCAL_ONE")


@dataclass(frozen=True, slots=True)
class SqliteOptions:
    path: str
    #: reader threads, each with its own connection (WAL allows them all at once);
    #: more overlap disk reads of data not in the OS page cache, but each keeps
    #: its own malloc arena of freed sample bytes (see ``_sqlite``'s docstring)
    readers: int = 1
    #: ids read per SELECT ... IN (...)
    ids_per_query: int = 64
    #: seconds a writer waits on a lock held by another process
    busy_timeout: float = 30.0
    #: bytes of the file each reader reads through mmap (``PRAGMA mmap_size``;
    #: SQLite caps it, at 2 GiB by default), 0 for none; None: the opener's
    #: choice: none for a store opened directly (a loader: the mapped pages
    #: would count in its RSS), as much as SQLite allows under ``dataferry serve``
    mmap_size: int | None = None

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("sqlite store needs a file path")
        if self.readers < 1 or self.ids_per_query < 1 or self.busy_timeout <= 0:
            raise ConfigError(f"sqlite options out of range: {self}")
        if self.mmap_size is not None and self.mmap_size < 0:
            raise ConfigError(f"sqlite option mmap_size={self.mmap_size} is negative; 0 turns mmap off")


@dataclass(frozen=True, slots=True)
class CassandraOptions:
    hosts: tuple[str, ...] = ("127.0.0.1",)
    port: int = 9042
    keyspace: str = "dataferry"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    #: every request's consistency; None: LOCAL_QUORUM when the keyspace keeps 3 or more replicas
    #: (in the local data centre), else ONE (see ``_cassandra.default_consistency``)
    consistency: str | None = None
    #: native protocol v4 is the only one spoken (Cassandra 2.2 to 5.0, ScyllaDB); kept so that a
    #: URL naming it still parses
    protocol_version: int | None = None
    local_dc: str | None = None
    #: requests in flight per store (reads and writes): reads in flight over a link of RTT r carry at
    #: most concurrency / r samples per second (256 at 100 ms: under 2,560/s; raise it for a long
    #: link), and the nodes hold up to this many answers at once for each store (1024 answers of
    #: 1 MB overran a 512 MB node's direct memory)
    concurrency: int = 256
    #: TCP connections per node that sample reads share (protocol v4 multiplexes requests on one,
    #: but one connection carries at most its TCP window per round trip)
    connections: int = 2
    #: seconds per request
    request_timeout: float = 10.0
    connect_timeout: float = 10.0
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_verify: bool = True
    #: used by ``schema apply``: "SimpleStrategy:RF" or "NetworkTopologyStrategy:dc1=3,dc2=3"
    replication: str = "SimpleStrategy:1"

    def __post_init__(self) -> None:
        if not self.hosts or not all(self.hosts):
            raise ConfigError("cassandra store needs at least one host")
        if not (0 < self.port < 65536):
            raise ConfigError(f"cassandra port out of range: {self.port}")
        if self.consistency is not None:
            if self.consistency.upper() not in _CONSISTENCIES:
                raise ConfigError(f"unknown consistency {self.consistency!r}; one of {', '.join(_CONSISTENCIES)}")
            object.__setattr__(self, "consistency", self.consistency.upper())
        if self.concurrency < 1 or self.request_timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError("cassandra concurrency and timeouts must be positive")
        if not 1 <= self.connections <= 64:
            raise ConfigError(f"cassandra connections={self.connections}: 1 to 64 per node")
        if self.protocol_version not in (None, 4):
            raise ConfigError(
                f"protocol_version={self.protocol_version}: dataferry speaks native protocol v4 only (Cassandra "
                "2.2 to 5.0 and ScyllaDB all do; v5 adds nothing it uses); leave the option out"
            )
        from ._model import check_name  # keyspace names follow the same rule, minus '.' and '-'

        check_name("keyspace", self.keyspace)
        if not self.keyspace.replace("_", "").isalnum():
            raise ConfigError(f"invalid keyspace {self.keyspace!r}: letters, digits and '_' only")
        self.replication_map()  # validate

    def replication_map(self) -> dict[str, str]:
        """The CQL replication map for ``schema apply``."""
        cls, _, arg = self.replication.partition(":")
        if cls == "SimpleStrategy" and arg.isdigit() and int(arg) > 0:
            return {"class": "SimpleStrategy", "replication_factor": arg}
        if cls == "NetworkTopologyStrategy" and arg:
            out = {"class": "NetworkTopologyStrategy"}
            for part in arg.split(","):
                dc, _, rf = part.partition("=")
                if not dc or not rf.isdigit():
                    break
                out[dc] = rf
            else:
                return out
        raise ConfigError(
            f"invalid replication {self.replication!r}: use 'SimpleStrategy:RF' or "
            "'NetworkTopologyStrategy:dc1=RF,dc2=RF'"
        )


def _coerce(name: str, value: str, typ: str):
    try:
        if "bool" in typ:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if "int" in typ:
            return int(value)
        if "float" in typ:
            return float(value)
        return value
    except ValueError:
        raise ConfigError(f"store URL option {name}={value!r} is not a valid {typ}") from None


def _options(cls, query: str, **fixed):
    known = {f.name: str(f.type) for f in fields(cls)}
    kwargs = dict(fixed)
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in known or name in fixed:
            raise ConfigError(f"unknown store URL option {name!r}; known: {', '.join(sorted(set(known) - set(fixed)))}")
        kwargs[name] = _coerce(name, value, known[name])
    return cls(**kwargs)


def parse_store_url(url: str) -> SqliteOptions | CassandraOptions:
    """Parse a store URL (see module docs). Raise ConfigError naming the fault."""
    if not isinstance(url, str) or not url:
        raise ConfigError("empty store URL")
    scheme, sep, rest = url.partition(":")
    if not sep or "/" in scheme or scheme in ("", ".") or os.path.sep in scheme:
        if url.endswith((".db", ".sqlite", ".sqlite3")):
            return SqliteOptions(path=url)
        raise ConfigError(f"store URL {url!r} has no scheme; use sqlite:PATH or cassandra://HOSTS/KEYSPACE")
    scheme = scheme.lower()
    rest, _, query = rest.partition("?")
    if scheme == "sqlite":
        if rest.startswith("//"):
            netloc, _, path = rest[2:].partition("/")
            if netloc not in ("", "localhost"):
                raise ConfigError(f"sqlite URL {url!r} names host {netloc!r}; use sqlite:///abs/path or sqlite:rel/path")
            path = "/" + path
        else:
            path = rest
        return _options(SqliteOptions, query, path=unquote(path))
    if scheme in ("cassandra", "scylla", "scylladb"):
        if not rest.startswith("//"):
            raise ConfigError(f"cassandra URL {url!r} must look like cassandra://host1,host2:9042/keyspace")
        netloc, _, path = rest[2:].partition("/")
        creds, at, hostpart = netloc.rpartition("@")
        username = password = None
        if at:
            user, _, pw = creds.partition(":")
            username, password = unquote(user) or None, unquote(pw) or None
        hosts: list[str] = []
        port = None
        for item in hostpart.split(","):
            host, _, p = item.strip().rpartition(":") if item.count(":") == 1 else ("", "", "")
            if not host:
                host, p = item.strip(), ""
            if p:
                if not p.isdigit():
                    raise ConfigError(f"cassandra URL {url!r}: bad port {p!r}")
                if port is not None and int(p) != port:
                    raise ConfigError(f"cassandra URL {url!r}: all hosts must share one port")
                port = int(p)
            hosts.append(host.strip("[]"))
        fixed = {"hosts": tuple(hosts), "username": username, "password": password}
        if port is not None:
            fixed["port"] = port
        if path.strip("/"):
            fixed["keyspace"] = path.strip("/")
        return _options(CassandraOptions, query, **fixed)
    raise ConfigError(f"unknown store URL scheme {scheme!r} in {url!r}; use sqlite: or cassandra://")


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, for logs and errors."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    creds, _, tail = rest.partition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{tail}" if ":" in creds else url
