"""The CQL the Cassandra store speaks: its statements (``{ks}``: the keyspace), those
prepared while it opens, the consistency it picks from the keyspace's replication,
and how it recognises the server's answers about a missing keyspace or column."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["STATEMENTS", "EAGER", "REPLICATION", "default_consistency", "no_keyspace", "no_checksum_column"]

# name -> CQL with {ks}
STATEMENTS = {
    "fetch": "SELECT label, data, target, xxh3 FROM {ks}.samples WHERE dataset=? AND id=?",
    # a keyspace made before samples kept their checksum (until `schema apply` adds the column)
    "fetch_v0": "SELECT label, data, target FROM {ks}.samples WHERE dataset=? AND id=?",
    "meta": "SELECT label, path, format, width, height, size, checksum, tags FROM {ks}.sample_meta "
            "WHERE dataset=? AND id=?",
    "exists": "SELECT id FROM {ks}.sample_meta WHERE dataset=? AND id=?",
    # No null binds: a null written is a tombstone per row; a sample without target names fewer columns.
    "put_sample": "INSERT INTO {ks}.samples (dataset, id, label, data, xxh3) VALUES (?,?,?,?,?)",
    "put_sample_target": "INSERT INTO {ks}.samples (dataset, id, label, data, target, xxh3) VALUES (?,?,?,?,?,?)",
    "put_meta": "INSERT INTO {ks}.sample_meta (dataset, id, label, path, format, width, height, size, checksum, "
                "tags) VALUES (?,?,?,?,?,?,?,?,?,?)",
    "datasets": "SELECT name, label_names, num_samples, created FROM {ks}.datasets",
    "dataset": "SELECT name, label_names, num_samples, created FROM {ks}.datasets WHERE name=?",
    "put_dataset": "INSERT INTO {ks}.datasets (name, label_names, num_samples, created) VALUES (?,?,?,?)",
    "splits": "SELECT split, num_ids FROM {ks}.splits WHERE dataset=?",
    "split": "SELECT num_ids, num_chunks FROM {ks}.splits WHERE dataset=? AND split=?",
    "put_split": "INSERT INTO {ks}.splits (dataset, split, num_ids, num_chunks) VALUES (?,?,?,?)",
    "del_split": "DELETE FROM {ks}.splits WHERE dataset=? AND split=?",
    "chunk": "SELECT ids, labels FROM {ks}.split_chunks WHERE dataset=? AND split=? AND chunk=?",
    "put_chunk": "INSERT INTO {ks}.split_chunks (dataset, split, chunk, ids, labels) VALUES (?,?,?,?,?)",
    "del_chunk": "DELETE FROM {ks}.split_chunks WHERE dataset=? AND split=? AND chunk=?",
    # derived_splits: prepared on first use like the rest, so a keyspace made before that
    # table existed still opens, and says how to add it when used (_has_derived)
    "derived": "SELECT parent, filter_text, created, num_ids, content_hash, parent_hash FROM {ks}.derived_splits "
               "WHERE dataset=? AND split=?",
    "put_derived": "INSERT INTO {ks}.derived_splits (dataset, split, parent, filter_text, created, num_ids, "
                   "content_hash, parent_hash) VALUES (?,?,?,?,?,?,?,?)",
}

#: Prepared while the store opens, in parallel: what a Loader needs before its first batch
#: (the split's id list, the samples), and what says whether the keyspace and tables exist.
EAGER = ("fetch", "split", "chunk", "dataset")


#: the keyspace's replication, asked while the store opens (for the default consistency)
REPLICATION = "SELECT replication FROM system_schema.keyspaces WHERE keyspace_name='{ks}'"


def default_consistency(replication: Mapping[str, str] | None, local_dc: str | None = None) -> str:
    """``LOCAL_QUORUM`` when the keyspace keeps 3 or more replicas (in ``local_dc``, or in every
    data centre when none is named), else ``ONE``.

    With 3 replicas, a quorum survives a node down, and a read at quorum meets a write at quorum
    on at least one replica: a replica back from an outage, before hints replay, cannot make a
    sample look missing. With 1 or 2, a quorum would stop at one node down: ONE keeps serving.
    """
    if not replication:
        return "ONE"
    cls = replication.get("class", "").rsplit(".", 1)[-1]
    if cls == "SimpleStrategy":
        factors = [replication.get("replication_factor", "1")]
    elif local_dc is not None:
        factors = [replication.get(local_dc, "0")]
    else:
        factors = [v for k, v in replication.items() if k not in ("class", "replication_factor")]
    try:
        smallest = min(int(str(f).split("/")[0]) for f in factors) if factors else 1
    except ValueError:  # not a replication map this knows: the level that works everywhere
        return "ONE"
    return "LOCAL_QUORUM" if smallest >= 3 else "ONE"


def no_keyspace(exc: BaseException, keyspace: str) -> bool:
    """Whether the server said that ``keyspace`` does not exist (preparing a statement in it)."""
    text = str(exc).lower()
    return keyspace.lower() in text and "keyspace" in text and "not exist" in text


def no_checksum_column(exc: BaseException) -> bool:
    """Whether preparing "fetch" failed because ``samples`` has no xxh3 column (an older keyspace)."""
    text = str(exc).lower()
    return "xxh3" in text and ("undefined column" in text or "unknown" in text or "no column" in text)
