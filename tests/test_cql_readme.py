"""What ingest wrote reads back with the plain CQL that schema/README.md shows,
byte for byte equal to the source files."""

from __future__ import annotations

import asyncio
import hashlib
import re
from pathlib import Path

import pytest

from dataferry.schema import ingest, open_store, parse_store_url, sample_id
from dataferry.schema.sources.cassandra._connect import connect

from oddfiles import build_odd_tree

pytestmark = pytest.mark.cassandra

README = Path(__file__).resolve().parent.parent / "schema" / "README.md"


def readme_queries() -> list[str]:
    text = README.read_text()
    block = re.search(r"```sql\n(.*?)```", text, re.S).group(1)
    statements = [s.strip() for s in re.sub(r"--[^\n]*", "", block).split(";")]
    return [" ".join(s.split()) for s in statements if s.startswith("SELECT")]


def test_readme_cql_reads_what_ingest_wrote(cassandra_url, dataset_name, tmp_path):
    tree = build_odd_tree(tmp_path / "odd")

    async def go():
        async with await open_store(cassandra_url) as store:
            return await ingest(store, tree.root, dataset_name, progress=False)

    report = asyncio.run(go())
    assert report.ingested == len(tree.valid)

    queries = readme_queries()
    meta_q = next(q for q in queries if "FROM sample_meta" in q)
    data_q = next(q for q in queries if "FROM samples" in q)
    opts = parse_store_url(cassandra_url)
    cluster, session, _ = connect(opts)
    try:
        session.set_keyspace(opts.keyspace)  # the README's "USE dataferry;"
        for rel in tree.valid:
            sid = sample_id(dataset_name, rel)

            def bind(q: str) -> str:
                return q.replace("'flowers'", f"'{dataset_name}'").replace("-5877165168880097022", str(sid))

            meta = session.execute(bind(meta_q)).one()
            row = session.execute(bind(data_q)).one()
            source = tree.path(rel).read_bytes()
            assert row[1] == source, rel  # the encoded bytes, exactly the file's
            assert meta[0] == row[0]  # label
            assert meta[1] == rel and meta[5] == len(source)
            assert meta[6] == hashlib.sha256(source).hexdigest()
        for rel in tree.bad:  # nothing of a rejected file is stored
            sid = sample_id(dataset_name, rel)
            q = data_q.replace("'flowers'", f"'{dataset_name}'").replace("-5877165168880097022", str(sid))
            assert session.execute(q).one() is None, rel
        catalog = [q for q in queries if "FROM datasets" in q or "FROM splits" in q]
        assert any(r[0] == dataset_name for r in session.execute(catalog[0]))
        splits = {r[0]: r[1] for r in session.execute(catalog[1].replace("'flowers'", f"'{dataset_name}'"))}
        assert splits["all"] == len(tree.valid)
    finally:
        cluster.shutdown()
