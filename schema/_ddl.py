"""``schema apply``: create dataferry's keyspace and tables on Cassandra/ScyllaDB.

The statements come from ``cassandra.cql`` (the readable source of truth); the
keyspace name and the replication map written there are replaced with the
store URL's. Statements are idempotent: an object that already exists is left
as it is, so running ``apply`` again is safe; it does not change the
replication of an existing keyspace. The compression map is written in the
form of Cassandra 3.0+ (``{'enabled': 'false'}``); a server that refuses it
(ScyllaDB, which reports release 3.0.8) is asked again with the older form
(``{'sstable_compression': ''}``). An ``ALTER TABLE ... ADD`` of a column
that exists already (a table created with it) counts as done, so a keyspace
made by an older release gets the columns added since; an ``ALTER TABLE ... WITH`` (a table option
added since, as ``speculative_retry``) runs only on a table that existed before this run (one
created now has the option already). It works with a node down: the DDL and the schema agreement
that follows it involve the nodes that are up.
"""

from __future__ import annotations

import asyncio
import re
from importlib import resources

from ._errors import StoreTimeout
from ._url import CassandraOptions

__all__ = ["apply_schema", "apply_schema_sync", "schema_statements"]

_DEFAULT_KEYSPACE = "dataferry"
_DEFAULT_REPLICATION = "{'class': 'SimpleStrategy', 'replication_factor': '1'}"
MODERN_NO_COMPRESSION = "{'enabled': 'false'}"
LEGACY_NO_COMPRESSION = "{'sstable_compression': ''}"

#: seconds for one DDL statement and for schema agreement after it
_DDL_TIMEOUT = 60.0


def _cql_map(m: dict[str, str]) -> str:
    return "{" + ", ".join(f"'{k}': '{v}'" for k, v in m.items()) + "}"


def schema_statements(opts: CassandraOptions, *, legacy_compression: bool = False) -> list[str]:
    """The statements of ``cassandra.cql`` for ``opts``, in order."""
    text = resources.files(__package__).joinpath("cassandra.cql").read_text(encoding="utf-8")
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    statements = []
    for raw in body.split(";"):
        stmt = raw.strip()
        if not stmt:
            continue
        stmt = re.sub(rf"\b{_DEFAULT_KEYSPACE}\b(?=\.|\s+WITH\b)", opts.keyspace, stmt)
        stmt = stmt.replace(_DEFAULT_REPLICATION, _cql_map(opts.replication_map()))
        if legacy_compression:
            stmt = stmt.replace(MODERN_NO_COMPRESSION, LEGACY_NO_COMPRESSION)
        statements.append(stmt)
    return statements


_ADD_COLUMN = re.compile(r"\s*ALTER\s+TABLE\s+\S+\s+ADD\s", re.IGNORECASE)
_CREATE_TABLE = re.compile(r"\s*CREATE\s+TABLE\s+(\S+)\s*\(", re.IGNORECASE)
_ALTER_OPTIONS = re.compile(r"\s*ALTER\s+TABLE\s+(\S+)\s+WITH\s", re.IGNORECASE)
#: how Cassandra 2.2-5.0 and ScyllaDB refuse to add a column that exists
_EXISTING_COLUMN = re.compile(r"conflicts with an existing column|already exist", re.IGNORECASE)


def _swap_compression(stmt: str) -> str | None:
    if MODERN_NO_COMPRESSION in stmt:
        return stmt.replace(MODERN_NO_COMPRESSION, LEGACY_NO_COMPRESSION)
    if LEGACY_NO_COMPRESSION in stmt:
        return stmt.replace(LEGACY_NO_COMPRESSION, MODERN_NO_COMPRESSION)
    return None


def _execute(session, stmt: str, created: set[str]) -> str:
    """Run one DDL statement; return the form that ran. AlreadyExists counts as done.

    A rejected compression map is retried in the other syntax; if that fails
    too, the first error is raised. ``created``: the tables made by this run (a
    ``CREATE TABLE`` that ran is added to it; an ``ALTER TABLE ... WITH`` of one
    of them is skipped).
    """
    from cassandra import AlreadyExists, RequestValidationException

    alter = _ALTER_OPTIONS.match(stmt)
    if alter is not None and alter.group(1).lower() in created:
        return stmt  # made by this run with the option
    ran = stmt
    try:
        session.execute(stmt, timeout=_DDL_TIMEOUT)
    except AlreadyExists:
        return stmt
    except RequestValidationException as exc:
        if _ADD_COLUMN.match(stmt) and _EXISTING_COLUMN.search(str(exc)):
            return stmt  # the column is there (the table was created with it, or added before)
        ran = _swap_compression(stmt)
        if ran is None:
            raise
        try:
            session.execute(ran, timeout=_DDL_TIMEOUT)
        except AlreadyExists:
            return ran
        except RequestValidationException:
            raise exc from None
    table = _CREATE_TABLE.match(stmt)
    if table is not None:
        created.add(table.group(1).lower())
    return ran


def apply_schema_sync(opts: CassandraOptions) -> list[str]:
    """Blocking form of :func:`apply_schema`."""
    from .sources.cassandra._connect import connect, shutdown, translate, where

    cluster, session, _ = connect(opts, max_schema_agreement_wait=_DDL_TIMEOUT)
    applied: list[str] = []
    created: set[str] = set()
    stmt = ""
    try:
        for stmt in schema_statements(opts):
            applied.append(_execute(session, stmt, created))
            # The driver skips its own wait when schema metadata is off (see connect()).
            if not cluster.control_connection.wait_for_schema_agreement(wait_time=_DDL_TIMEOUT):
                raise StoreTimeout(
                    f"schema apply on cassandra store {where(opts)}: nodes did not agree on the schema within "
                    f"{_DDL_TIMEOUT:g} s after: {stmt}; check that all nodes are up, then run apply again"
                )
    except Exception as exc:
        short = " ".join(stmt.split())[:90]
        err = translate(exc, f"schema apply on cassandra store {where(opts)} failed at [{short}]")
        raise err from (None if err is exc else exc)
    finally:
        shutdown(cluster)
    return applied


async def apply_schema(opts: CassandraOptions) -> list[str]:
    """Create the keyspace and tables; return the statements, in order.

    Objects that already exist are kept (their statement is still listed).
    Raise StoreUnavailable when the cluster cannot be reached, StoreError when
    a statement is rejected.
    """
    return await asyncio.to_thread(apply_schema_sync, opts)
