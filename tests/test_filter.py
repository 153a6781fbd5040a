"""Metadata filters and derived splits (issue 14, item 1).

The parser (property tests against a reference evaluator, errors with
positions), then the same filter over the same data on SQLite, on the real
Cassandra 5.0 and through the real data service on loopback: the same ids
everywhere. Then reuse, the resume refusal, and stratified splits of a
derived split. Last, Cassandra's token-range scans against its reads by id
(two datasets in one keyspace, ids without metadata, a subset parent, a page
that fails and is asked again). The service's derive jobs: test_derive_jobs.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import fnmatch
import json
import sqlite3
import types
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataferry.schema import ConfigError, DatasetInfo, IdList, Sample, SampleMeta, SampleRecord, open_store, sample_id
from dataferry.schema.cli import main as cli
from dataferry.schema._errors import SplitNotFound, StoreError
from dataferry.schema._filter import FilterError, compile_filter, glob_match, parse_filter
from dataferry.schema._splits import content_hash, derive_split

LABELS = ("cat", "dog", "eel", "fox")
FORMATS = ("JPEG", "PNG", "WEBP")


def run(coro):
    return asyncio.run(coro)


def metas(dataset: str, n: int, seed: int = 0) -> list[SampleMeta]:
    """``n`` varied metadata rows: every field takes several values, some tags missing."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        label = int(rng.integers(0, len(LABELS)))
        path = f"{LABELS[label]}/{'sub/' * int(rng.integers(0, 3))}{k}.{('jpg', 'png')[k % 2]}"
        tags = {} if k % 3 == 0 else {"source": ("web", "lab", "it's")[k % 7 % 3], "year": str(2018 + k % 5)}
        out.append(SampleMeta(
            sample_id(dataset, path), label, path, FORMATS[int(rng.integers(0, 3))],
            int(rng.integers(16, 2048)), int(rng.integers(16, 2048)), int(rng.integers(500, 200_000)), "0" * 64, tags,
        ))
    return out


async def fill(store, dataset: str, rows: list[SampleMeta]) -> None:
    recs = [SampleRecord(Sample(m.id, m.label, b"x" * 8), m) for m in rows]
    for k in range(0, len(recs), 500):
        await store.put_samples(dataset, recs[k : k + 500])
    await store.put_dataset(DatasetInfo(dataset, LABELS, len(rows), dt.datetime(2024, 5, 1, tzinfo=dt.timezone.utc)))
    await store.put_split(dataset, "all", IdList([m.id for m in rows], [m.label for m in rows]))


# A reference evaluator written independently of the parser: plain Python over one row.
FILTERS = {
    'width >= 1024': lambda m: m.width >= 1024,
    '256 <= width <= 1024 and height < 512': lambda m: 256 <= m.width <= 1024 and m.height < 512,
    'label_name in ("cat", "eel") or format = "png"': lambda m: LABELS[m.label] in ("cat", "eel") or m.format == "PNG",
    'not (size between 1000 and 100000)': lambda m: not 1000 <= m.size <= 100_000,
    'path glob "dog/**/*.jpg"': lambda m: m.path.startswith("dog/") and m.path.endswith(".jpg"),
    'path glob "*/sub/*"': lambda m: m.path.count("/") == 2 and m.path.split("/")[1] == "sub",
    "tags.source = 'it''s' and tags.year >= \"2020\"": lambda m: m.tags.get("source") == "it's" and m.tags.get("year", "") >= "2020",
    'tags.source != "web"': lambda m: m.tags.get("source") != "web",
    'not tags.source exists and label != 0': lambda m: "source" not in m.tags and m.label != 0,
    'label not in (1, 2) and format glob "?PEG"': lambda m: m.label not in (1, 2) and m.format == "JPEG",
}


# --- the parser ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text", list(FILTERS))
def test_each_filter_matches_the_reference_evaluator(text):
    keep = compile_filter(parse_filter(text), LABELS)
    rows = metas("d", 400)
    got = [m.id for m in rows if keep(m)]
    assert got == [m.id for m in rows if FILTERS[text](m)]
    assert 0 < len(got) < len(rows)  # each filter is a real test on this data


NUMBER_FIELDS = ("width", "height", "size", "label")
ops = st.sampled_from(["=", "!=", "<", "<=", ">", ">="])


@st.composite
def expressions(draw, depth=0):
    """(filter text, reference predicate) pairs, nested with and/or/not and parentheses."""
    if depth < 3 and draw(st.booleans()):
        kind = draw(st.sampled_from(["and", "or", "not"]))
        a_text, a_fn = draw(expressions(depth + 1))
        if kind == "not":
            return f"NOT ({a_text})", (lambda m: not a_fn(m))
        b_text, b_fn = draw(expressions(depth + 1))
        if kind == "and":
            return f"({a_text}) and ({b_text})", (lambda m: a_fn(m) and b_fn(m))
        return f"({a_text})   Or ({b_text})", (lambda m: a_fn(m) or b_fn(m))
    field = draw(st.sampled_from(NUMBER_FIELDS))
    v = draw(st.integers(0, 2100))
    op = draw(ops)
    import operator

    fn = {"=": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}[op]
    if draw(st.booleans()):
        return f"{field} {op} {v}", (lambda m: fn(getattr(m, field), v))
    flipped = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}.get(op, op)
    return f"{v} {flipped} {field}", (lambda m: fn(getattr(m, field), v))


ROWS = metas("prop", 200, seed=3)


@settings(max_examples=150, deadline=None)
@given(expressions())
def test_nested_expressions_agree_with_python(expr):
    text, fn = expr
    flt = parse_filter(text)
    keep = compile_filter(flt, LABELS)
    assert [keep(m) for m in ROWS] == [bool(fn(m)) for m in ROWS]
    again = parse_filter(flt.canonical)  # the canonical text parses back to the same filter
    assert again.canonical == flt.canonical
    assert [compile_filter(again, LABELS)(m) for m in ROWS] == [bool(fn(m)) for m in ROWS]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_any_text_parses_or_fails_with_a_position_inside_it(text):
    try:
        parse_filter(text)
    except FilterError as exc:
        assert 1 <= exc.position <= len(text) + 1
        assert str(exc).startswith("filter: ") and f"at position {exc.position}" in str(exc)
        assert "\n" not in str(exc)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab/*?", max_size=8), st.text(alphabet="ab/", max_size=10))
def test_glob_agrees_with_fnmatch_per_segment(pattern, path):
    """Without '**', a glob is fnmatch applied segment by segment."""
    if not pattern or "**" in pattern:
        return
    pats, parts = pattern.split("/"), path.split("/")
    want = len(pats) == len(parts) and all(fnmatch.fnmatchcase(p, q) for q, p in zip(pats, parts))
    assert glob_match(pattern, path) == want


def test_double_star_spans_segments():
    assert glob_match("a/**/b", "a/b") and glob_match("a/**/b", "a/x/y/b") and not glob_match("a/**/b", "a/x/c")
    assert glob_match("**", "x/y/z") and glob_match("**/*.jpg", "a.jpg") and not glob_match("*.jpg", "a/b.jpg")
    assert glob_match("[a-c]?[!x]", "bqz") and not glob_match("[a-c]?[!x]", "bqx")


def test_a_pathological_glob_stays_fast():
    import time

    t0 = time.perf_counter()
    assert not glob_match("*a*a*a*a*a*a*a*a*b", "a" * 3000)
    assert time.perf_counter() - t0 < 5  # backtracking regex would not finish; this is O(n * m)


@pytest.mark.parametrize(
    "text, position, reason",
    [
        ("width >= ", 10, "expected a value for width, found the end of the filter"),
        ('width >= "big"', 10, 'width is a number, got the text "big"'),
        ('label = "cat"', 9, "use label_name for the class name"),
        ("path = 3", 8, "path is text, got the number 3"),
        ("colour = 'red'", 1, "unknown field 'colour'"),
        ("(width = 1", 11, "expected ')'"),
        ("width = 1 height = 2", 11, "unexpected 'height' (join tests with 'and' or 'or')"),
        ("width = 1 and", 14, "expected a field name, '(' or 'not', found the end of the filter"),
        ("width @ 3", 7, "unexpected character '@'"),
        ('path glob "[ab"', 11, "bad glob pattern"),
        ("path = 'open", 8, "string is not closed"),
        ("width between 1 or 2", 17, "expected 'and' between the two ends of the range"),
        ("5 > width > 3", 11, "a chained range goes low to high"),
        ("width not = 3", 11, "expected 'in', 'between' or 'glob' after 'not'"),
        ("path exists", 1, "'exists' is for tags.KEY"),
        ("label in (1, 2", 15, "expected ',' or ')' in the 'in' list"),
        ("   ", 4, "the filter is empty"),
    ],
)
def test_a_bad_filter_is_one_line_with_its_position(text, position, reason):
    with pytest.raises(FilterError) as info:
        parse_filter(text)
    exc = info.value
    assert isinstance(exc, ConfigError)
    assert exc.position == position, str(exc)
    assert reason in str(exc) and str(exc).endswith(f"at position {position}")
    assert "\n" not in str(exc)
    line, caret = exc.caret.splitlines()
    assert caret.index("^") - 2 == position - 1 and len(line) >= 2 + len(text.rstrip())


def test_deep_nesting_and_huge_filters_are_refused_not_crashing():
    with pytest.raises(FilterError, match="nested more than"):
        parse_filter("(" * 500 + "width = 1" + ")" * 500)
    with pytest.raises(FilterError, match="not " * 0 + "nested more than"):
        parse_filter("not " * 500 + "width = 1")
    with pytest.raises(FilterError, match="number of 5000 characters; the limit is 64 at position 9"):
        parse_filter("width = " + "9" * 5000)  # int() would refuse it with a ValueError (found by the API fuzzer)
    with pytest.raises(FilterError, match="limit is 8192"):
        parse_filter("width = 1 or " * 1000 + "width = 2")


def test_format_is_case_insensitive_and_canonical_text_normalises():
    a, b = parse_filter('format == "jpeg"  AND width<>3'), parse_filter("format = 'JPEG' and width != 3")
    assert a.canonical == b.canonical
    m = SampleMeta(1, 0, "p", "JPEG", 1, 1, 1, "", {})
    assert compile_filter(a, LABELS)(m)


def test_label_name_of_an_unknown_label_is_missing():
    keep = compile_filter(parse_filter('label_name != "cat"'), ("cat",))
    assert keep(SampleMeta(1, 7, "p", "PNG", 1, 1, 1, "", {}))
    assert not compile_filter(parse_filter('label_name glob "*"'), ("cat",))(SampleMeta(1, 7, "p", "PNG", 1, 1, 1, "", {}))


# --- derived splits on each backend ---------------------------------------------------------------
WHERE = 'width >= 512 and (label_name in ("cat", "dog") or tags.source = "lab") and not path glob "*/sub/**"'


def expected_ids(rows: list[SampleMeta]) -> list[int]:
    keep = compile_filter(parse_filter(WHERE), LABELS)
    return sorted(m.id for m in rows if keep(m))


@pytest.fixture(scope="module")
def sqlite_store_url(tmp_path_factory):
    path = tmp_path_factory.mktemp("filter") / "store.db"
    url = f"sqlite://{path}"

    async def go():
        async with await open_store(url) as store:
            await fill(store, "pets", metas("pets", 1500))

    run(go())
    return url


def test_derived_split_on_sqlite_selects_the_reference_ids(sqlite_store_url):
    async def go():
        async with await open_store(sqlite_store_url) as store:
            rec = await derive_split(store, "pets", WHERE, name="big-pets", progress=False)
            stored = await store.read_split("pets", "big-pets")
            again = await derive_split(store, "pets", " " + WHERE.replace("and", "AND"), name="big-pets", progress=False)
            return rec, stored, again, await store.get_derived("pets", "big-pets")

    rec, stored, again, got = run(go())
    want = expected_ids(metas("pets", 1500))
    assert stored.ids.tolist() == want and 100 < len(want) < 1400
    label_of = {m.id: m.label for m in metas("pets", 1500)}
    assert stored.labels.tolist() == [label_of[i] for i in want]
    assert rec.num_ids == len(want) and rec.content_hash == content_hash(stored) and not rec.reused
    assert rec.where == WHERE and rec.parent == "all" and rec.created.tzinfo is not None
    assert again.reused and again.content_hash == rec.content_hash  # same filter, written differently
    assert got == rec


def test_a_changed_filter_or_parent_recomputes(tmp_path):
    url = f"sqlite://{tmp_path / 's.db'}"
    rows = metas("d", 300)

    async def go():
        async with await open_store(url) as store:
            await fill(store, "d", rows)
            a = await derive_split(store, "d", "width > 1000", name="x", progress=False)
            b = await derive_split(store, "d", "width > 1500", name="x", progress=False)
            more = metas("d", 340)  # ingest added samples: the parent changed
            await fill(store, "d", more)
            c = await derive_split(store, "d", "width > 1500", name="x", progress=False)
            return a, b, c, await store.read_split("d", "x")

    a, b, c, stored = run(go())
    assert not b.reused and b.num_ids < a.num_ids
    assert not c.reused and c.num_ids == sum(m.width > 1500 for m in metas("d", 340)) and len(stored) == c.num_ids


def test_a_bad_filter_fails_before_touching_the_store(tmp_path):
    async def go():
        async with await open_store(f"sqlite://{tmp_path / 'none.db'}") as store:
            await derive_split(store, "nope", "width >>= 3", progress=False)

    with pytest.raises(FilterError, match="at position 8"):
        run(go())


def test_a_derived_name_cannot_take_an_ordinary_split(sqlite_store_url):
    async def go():
        async with await open_store(sqlite_store_url) as store:
            await store.put_split("pets", "train", IdList([1], [0]))
            await derive_split(store, "pets", "width > 3", name="train", progress=False)

    with pytest.raises(ConfigError, match="split 'train' of dataset 'pets' exists and is not a derived split"):
        run(go())
    with pytest.raises(ConfigError, match="reserved"):
        run(_derive(sqlite_store_url, "width > 3", "all"))


async def _derive(url, where, name):
    async with await open_store(url) as store:
        return await derive_split(store, "pets", where, name=name, progress=False)


def test_an_sqlite_file_made_before_derived_splits_gains_the_table(tmp_path):
    path = tmp_path / "old.db"
    url = f"sqlite://{path}"

    async def make():
        async with await open_store(url) as store:
            await fill(store, "d", metas("d", 50))

    run(make())
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE derived_splits")  # as a file from before this change

    async def go():
        async with await open_store(url, create=False) as store:
            assert await store.get_derived("d", "x") is None
            return await derive_split(store, "d", "width > 100", name="x", progress=False)

    rec = run(go())
    assert rec.num_ids == sum(m.width > 100 for m in metas("d", 50))


# --- Cassandra 5.0 -----------------------------------------------------------------------------------
@pytest.mark.cassandra
def test_derived_split_on_cassandra_selects_the_same_ids_as_sqlite(cassandra_url, sqlite_store_url):
    ds = f"pets_{uuid.uuid4().hex[:8]}"
    rows = metas(ds, 1500)

    async def go():
        async with await open_store(cassandra_url) as store:
            await fill(store, ds, rows)
            rec = await derive_split(store, ds, WHERE, name="big-pets", progress=False)
            again = await derive_split(store, ds, WHERE, name="big-pets", progress=False)
            return rec, again, await store.read_split(ds, "big-pets"), await store.get_derived(ds, "big-pets")

    rec, again, stored, got = run(go())
    # the same dataset rows under another name have other ids: compare by path
    path_of = {m.id: m.path for m in rows}
    sqlite_paths = [m.path for m in metas("pets", 1500) if m.id in set(run(_read(sqlite_store_url, "big-pets")))]
    assert sorted(path_of[i] for i in stored.ids.tolist()) == sorted(sqlite_paths)
    assert stored.ids.tolist() == expected_ids(rows)
    assert again.reused and got == rec and rec.content_hash == content_hash(stored)


async def _read(url, split):
    async with await open_store(url) as store:
        try:
            return (await store.read_split("pets", split)).ids.tolist()
        except SplitNotFound:
            await derive_split(store, "pets", WHERE, name=split, progress=False)
            return (await store.read_split("pets", split)).ids.tolist()


@pytest.mark.cassandra
def test_a_keyspace_without_the_derived_table_opens_and_says_how_to_add_it(cassandra_server):
    from dataferry.schema import parse_store_url
    from dataferry.schema._ddl import apply_schema
    from dataferry.schema.sources.cassandra._connect import connect

    host, port = cassandra_server
    url = f"cassandra://{host}:{port}/dfo_{uuid.uuid4().hex[:10]}"
    opts = parse_store_url(url)
    run(apply_schema(opts))
    cluster, session, _ = connect(opts)
    try:
        session.execute(f"DROP TABLE {opts.keyspace}.derived_splits")  # as a keyspace from before this change
    finally:
        cluster.shutdown()

    async def go():
        async with await open_store(url) as store:
            await fill(store, "d", metas("d", 20))
            assert await store.get_derived("d", "x") is None
            await derive_split(store, "d", "width > 1", name="x", progress=False)

    with pytest.raises(StoreError, match=r"derived_splits does not exist .*dataferry schema apply --store"):
        run(go())
    run(apply_schema(opts))  # apply again: the table is added, the data kept

    async def again():
        async with await open_store(url) as store:
            return await derive_split(store, "d", "width > 1", name="x", progress=False)

    assert run(again()).num_ids == 20


# --- through the data service ----------------------------------------------------------------------
class CountingFetches:
    """The real store, counting sample reads: deriving must read metadata alone."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.url = inner.url
        self.fetched = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def fetch(self, dataset, ids):
        async for r in self.inner.fetch(dataset, ids):
            self.fetched += 1
            yield r


@pytest.fixture
def service(tmp_path):
    from server_kit import live_server

    from dataferry.server import make_app

    url = f"sqlite://{tmp_path / 'svc.db'}"
    run(_fill_url(url, "pets", metas("pets", 1500)))
    opened = []

    async def build():
        store = await open_store(url, create=False)
        opened.append(store)
        opened.append(CountingFetches(store))
        return make_app(opened[-1])

    with live_server(build) as live:
        yield types.SimpleNamespace(base=live.base, app=live.app, loop=live.loop, store=opened[-1])
        live.loop.call(opened[0].close())


async def _fill_url(url, dataset, rows):
    async with await open_store(url) as store:
        await fill(store, dataset, rows)


def _post(base: str, path: str, body: object, template: str = "/v1/datasets/{name}/splits"):
    import aiohttp
    from server_kit import call

    async def go():
        async with aiohttp.ClientSession() as session:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await call(session, "POST", base + path, template, data=data,
                              headers={"Content-Type": "application/json"}, timeout=aiohttp.ClientTimeout(total=60))

    return run(go())


def test_the_service_derives_the_same_ids_from_metadata_alone(service):
    status, _, body = _post(service.base, "/v1/datasets/pets/splits", {"where": WHERE, "name": "big-pets"})
    assert status == 200, body
    doc = json.loads(body)
    want = expected_ids(metas("pets", 1500))
    assert doc["num_ids"] == len(want) and doc["name"] == "big-pets" and doc["reused"] is False

    from dataferry.client import Loader

    with Loader(service.base, "pets", where=WHERE, batch_size=256) as loader:  # auto-named, made by the service
        assert service.store.fetched == 0  # two splits derived, not one sample's bytes read
        got = sorted(i for b in iter(loader) for i in b.ids.tolist())
        assert loader.split.startswith("where-") and loader.derived.num_ids == len(want)
    assert got == want
    with Loader(service.base, "pets", split="big-pets") as loader:  # read like any split
        assert loader._idlist().ids.tolist() == want
    status, _, body = _post(service.base, "/v1/datasets/pets/splits", {"where": WHERE, "name": "big-pets"})
    assert status == 200 and json.loads(body)["reused"] is True


@pytest.mark.parametrize(
    "body, status, error",
    [
        ({"where": "width >= and"}, 400, "bad_filter"),
        ({"where": "width > 1", "name": "bad name!"}, 400, "bad_split_name"),
        ({"where": "width > 1", "name": "all"}, 400, "bad_split_name"),
        ({"where": 3}, 400, "bad_body"),
        ({"where": "width > 1", "extra": 1}, 400, "bad_body"),
        (b"{not json", 400, "bad_json"),
        ({"where": "width > 1", "from": "nope"}, 404, "split_not_found"),
    ],
)
def test_the_service_rejects_bad_requests_by_name(service, body, status, error):
    got, _, raw = _post(service.base, "/v1/datasets/pets/splits", body)
    doc = json.loads(raw)
    assert (got, doc["error"]) == (status, error), doc
    if error == "bad_filter":
        assert doc["position"] == 10 and doc["detail"] == "filter: expected a value for width, found 'and' at position 10"


def test_the_service_refuses_to_overwrite_an_ordinary_split(service):
    live_store = service.loop.call(_put_train(service))
    assert live_store
    status, _, raw = _post(service.base, "/v1/datasets/pets/splits", {"where": "width > 1", "name": "train"})
    assert status == 409 and json.loads(raw)["error"] == "split_conflict"
    status, _, _ = _post(service.base, "/v1/datasets/nope/splits", {"where": "width > 1"})
    assert status == 404


async def _put_train(live):
    from dataferry.server._keys import GATE

    await live.app[GATE].store.put_split("pets", "train", IdList([1, 2], [0, 0]))
    return True


# --- the Loader: where=, and resuming ------------------------------------------------------------------
def test_loader_where_on_a_store_makes_then_reuses_the_split(sqlite_store_url):
    from dataferry.client import Loader

    with Loader(sqlite_store_url, "pets", where=WHERE, batch_size=128) as loader:
        got = sorted(i for b in iter(loader) for i in b.ids.tolist())
        first = loader.derived
    assert got == expected_ids(metas("pets", 1500))
    with Loader(sqlite_store_url, "pets", where=WHERE.replace("and", "AND")) as loader:
        assert loader.derived.reused and loader.split == first.name and loader.derived.content_hash == first.content_hash
    with pytest.raises(FilterError, match="at position 7"):
        Loader(sqlite_store_url, "pets", where="width ~ 3")


def test_resuming_against_a_changed_derived_split_is_refused(tmp_path):
    from dataferry.client import Loader

    url = f"sqlite://{tmp_path / 'r.db'}"
    run(_fill_url(url, "d", metas("d", 600)))
    where = "width >= 700"
    with Loader(url, "d", where=where, batch_size=32) as loader:
        it = iter(loader)
        next(it)
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["split"].startswith("where-") and len(state["split_hash"]) == 32
    with Loader(url, "d", where=where, batch_size=32) as same:  # unchanged data: resumes
        same.load_state_dict(state)
        rest = sum(len(b) for b in iter(same))
        assert rest == same.derived.num_ids - 32
    run(_fill_url(url, "d", metas("d", 700)))  # new samples, some matching: the same filter gives another split
    with Loader(url, "d", where=where, batch_size=32) as changed:
        assert not changed.derived.reused and changed.split == state["split"]
        with pytest.raises(ConfigError, match=r"split 'where-\w+' of dataset 'd' changed since the state was saved"):
            changed.load_state_dict(state)
    with Loader(url, "d", split="all", batch_size=32) as other:
        with pytest.raises(ConfigError, match="loader state is for split 'where-"):
            other.load_state_dict(state)


# --- the CLI: derived split, its stratified train/val, and a bad filter -----------------------------------
def test_cli_derives_then_splits_the_derived_split_stratified(tmp_path, capsys):
    url = f"sqlite://{tmp_path / 'c.db'}"
    rows = metas("d", 2000)
    run(_fill_url(url, "d", rows))
    code = cli(["split", "--dataset", "d", "--store", url, "--where", "width >= 600", "--name", "wide",
                "--ratios", "wide-train=0.8,wide-val=0.2", "--stratify", "-q"])
    out, err = capsys.readouterr()
    assert code == 0, err
    want = sorted(m.id for m in rows if m.width >= 600)
    assert f"derived split 'wide' of dataset 'd': {len(want)} samples of split 'all' match 'width >= 600'; made" in out

    async def read():
        async with await open_store(url) as store:
            return [await store.read_split("d", s) for s in ("wide", "wide-train", "wide-val")]

    wide, train, val = run(read())
    assert wide.ids.tolist() == want
    assert sorted(train.ids.tolist() + val.ids.tolist()) == want and not set(train.ids.tolist()) & set(val.ids.tolist())
    for lab in range(len(LABELS)):  # stratified: every label 80/20 within one sample
        n = int(np.count_nonzero(wide.labels == lab))
        assert abs(int(np.count_nonzero(train.labels == lab)) - 0.8 * n) < 1

    code = cli(["split", "--dataset", "d", "--store", url, "--where", "width >= 600", "--name", "wide", "-q"])
    assert code == 0 and "; reused (same filter, parent unchanged)" in capsys.readouterr()[0]


def test_cli_bad_filter_is_one_line_and_a_caret(tmp_path, capsys):
    code = cli(["split", "--dataset", "d", "--store", f"sqlite://{tmp_path / 'none.db'}",
                "--where", 'width >= 3 and label_name = cat', "--name", "x"])
    err = capsys.readouterr()[1].splitlines()
    assert code == 2
    assert err[0] == "dataferry: error: filter: expected a value for label_name, found 'cat' at position 29"
    assert err[1] == "  width >= 3 and label_name = cat" and err[2] == "  " + " " * 28 + "^"
    assert not (tmp_path / "none.db").exists()  # nothing opened


# --- Cassandra: token-range scans select what reads by id select -------------------------------------
def _parents(rows_a: list[SampleMeta], strays: list[int]) -> dict[str, IdList]:
    """``all``: every sample of ``a`` plus ids without metadata in ``a`` (``strays``: some are
    ``b``'s ids); ``half``: every other one of those, a subset."""
    ids = [m.id for m in rows_a] + strays
    labels = [m.label for m in rows_a] + [0] * len(strays)
    return {"all": IdList(ids, labels), "half": IdList(ids[::2], labels[::2])}


async def _fill_two(store, a: str, b: str) -> tuple[list[SampleMeta], dict[str, IdList]]:
    rows_a, rows_b = metas(a, 1200, seed=5), metas(b, 700, seed=6)
    await fill(store, a, rows_a)
    await fill(store, b, rows_b)
    strays = [m.id for m in rows_b[:25]] + [sample_id(a, f"never/{k}.jpg") for k in range(25)]
    parents = _parents(rows_a, strays)
    for split, idlist in parents.items():
        await store.put_split(a, split, idlist)
    return rows_a, parents


def _reference(rows: list[SampleMeta], parent: IdList, text: str) -> list[int]:
    by_id = {m.id: m for m in rows}
    return sorted(i for i in parent.ids.tolist() if i in by_id and FILTERS[text](by_id[i]))


@pytest.mark.cassandra
def test_token_range_scans_select_exactly_what_reads_by_id_select(cassandra_url, tmp_path):
    from dataferry.schema.sources.cassandra._scan import ScanOptions, meta_pages
    from dataferry.schema._splits import filter_fields

    a, b = f"scan_a_{uuid.uuid4().hex[:8]}", f"scan_b_{uuid.uuid4().hex[:8]}"  # two datasets, one keyspace
    sqlite_url = f"sqlite://{tmp_path / 'same.db'}"

    async def select(store, dataset, parent, text, *, scan, options=ScanOptions(), fields=None):
        keep = compile_filter(parse_filter(text), LABELS)
        seen, kept = [], []
        pages = meta_pages(store._session, store._opts.keyspace, dataset, parent.ids, fields=fields, timeout=10,
                           error=store._error, by_id=store.read_meta, rows=None, options=options, scan=scan)
        async for page in pages:
            seen += [m.id for m in page]
            kept += [m.id for m in page if keep(m)]
        assert len(seen) == len(set(seen))  # each id once
        return sorted(kept), set(seen)

    async def go():
        out = {}
        async with await open_store(cassandra_url) as store, await open_store(sqlite_url) as lite:
            rows_a, parents = await _fill_two(store, a, b)
            await _fill_two(lite, a, b)
            small = ScanOptions(ranges=7, concurrency=3, page_size=37)  # many pages, ranges cut inside the ring's
            for split, parent in parents.items():
                for text in FILTERS:
                    fields = filter_fields(parse_filter(text))
                    by_id, found = await select(store, a, parent, text, scan=False)
                    scanned, found_scan = await select(store, a, parent, text, scan=True, fields=fields)
                    paged, _ = await select(store, a, parent, text, scan=True, options=small)
                    assert found_scan == found  # the same metadata rows found, the strays in neither
                    out[split, text] = (by_id, scanned, paged)
                rec = await derive_split(store, a, WHERE, name=f"w-{split}", parent=split, progress=False)
                lite_rec = await derive_split(lite, a, WHERE, name=f"w-{split}", parent=split, progress=False)
                got = (await store.read_split(a, rec.name)).ids.tolist()
                assert got == (await lite.read_split(a, lite_rec.name)).ids.tolist()
                assert rec.content_hash == lite_rec.content_hash
                out[split, "derived"] = got
            return rows_a, parents, out

    rows_a, parents, out = run(go())
    strays = set(parents["all"].ids.tolist()[1200:])
    for (split, text), got in out.items():
        if text == "derived":
            keep = compile_filter(parse_filter(WHERE), LABELS)
            by_id = {m.id: m for m in rows_a}
            assert got == sorted(i for i in parents[split].ids.tolist() if i in by_id and keep(by_id[i]))
            continue
        want = _reference(rows_a, parents[split], text)
        assert got[0] == got[1] == got[2] == want, (split, text)
        assert not strays & set(want)
    assert len(parents["half"]) < len(parents["all"]) and out["half", "derived"]


@pytest.mark.cassandra
def test_token_ranges_cover_the_ring_once_and_small_parents_are_read_by_id(cassandra_url):
    from dataferry.schema.sources.cassandra._scan import meta_pages, token_ranges

    async def go():
        async with await open_store(cassandra_url) as store:
            await asyncio.to_thread(store._cluster.refresh_keyspace_metadata, store._opts.keyspace)
            ranges = token_ranges(store._cluster, store._opts.keyspace, 100)
            asked = []

            async def by_id(dataset, ids):
                asked.append(len(ids))
                return await store.read_meta(dataset, ids)

            async def rows():
                return 10**9  # a keyspace far bigger than 3 ids: read them by id

            got = [p async for p in meta_pages(store._session, store._opts.keyspace, "nope", [1, 2, 3], fields=None,
                                               timeout=10, error=store._error, by_id=by_id, rows=rows)]
            return ranges, asked, got

    ranges, asked, got = run(go())
    assert len(ranges) >= 100
    assert ranges[0][0] == -(2**63) and ranges[-1][1] == 2**63 - 1
    assert all(r[1] == s[0] and r[0] < r[1] for r, s in zip(ranges, ranges[1:]))  # contiguous, disjoint
    assert all(r[2] for r in ranges)  # each with its replicas (the session's node)
    assert asked == [3] and got == []


class _Failed:
    """A request answered by an error at once (what the driver does on a timeout)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def add_callbacks(self, callback, errback, callback_args=(), errback_args=()):
        errback(self.exc, *errback_args)


class _FlakyPages:
    """The driver's ResponseFuture, whose next-page request fails once per session (it times out)."""

    def __init__(self, inner, session) -> None:
        self.inner, self.session = inner, session
        self._errback = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add_callbacks(self, callback, errback, callback_args=(), errback_args=()):
        self._errback = lambda exc: errback(exc, *errback_args)
        self.inner.add_callbacks(callback, errback, callback_args=callback_args, errback_args=errback_args)

    def start_fetching_next_page(self):
        if not self.session.next_failed:
            from cassandra import OperationTimedOut

            self.session.next_failed = True
            self._errback(OperationTimedOut("test: the next page timed out"))
            return
        self.inner.start_fetching_next_page()


class FlakySession:
    """The driver's session for a scan: the first request of each range, and one next-page request,
    fail with a timeout (``always``: every request fails)."""

    def __init__(self, inner, *, always: bool = False) -> None:
        self.inner, self.cluster, self.always = inner, inner.cluster, always
        self.first_failed: set = set()
        self.next_failed = False
        self.resumed = 0

    def prepare(self, query):
        return self.inner.prepare(query)

    def execute_async(self, ps, params, **kw):
        from cassandra import OperationTimedOut

        if self.always or (kw.get("paging_state") is None and params[:2] not in self.first_failed):
            self.first_failed.add(params[:2])
            return _Failed(OperationTimedOut("test: the first page timed out"))
        self.resumed += kw.get("paging_state") is not None
        return _FlakyPages(self.inner.execute_async(ps, params, **kw), self)


@pytest.mark.cassandra
def test_a_scan_asks_a_failed_page_again_from_where_it_stopped(cassandra_url):
    from dataferry.schema.sources.cassandra._scan import ScanOptions, meta_pages

    a, b = f"flaky_a_{uuid.uuid4().hex[:8]}", f"flaky_b_{uuid.uuid4().hex[:8]}"

    async def go():
        async with await open_store(cassandra_url) as store:
            rows_a, parents = await _fill_two(store, a, b)
            flaky = FlakySession(store._session)
            options = ScanOptions(ranges=4, concurrency=2, page_size=50, retries=1)
            seen = [m.id async for page in meta_pages(flaky, store._opts.keyspace, a, parents["all"].ids,
                                                      fields=("width",), timeout=10, error=store._error, by_id=None,
                                                      rows=None, options=options, scan=True) for m in page]
            broken = FlakySession(store._session, always=True)
            with pytest.raises(StoreError) as info:
                async for _ in meta_pages(broken, store._opts.keyspace, a, parents["all"].ids, fields=None, timeout=10,
                                          error=store._error, by_id=None, rows=None, options=options, scan=True):
                    pass
            return rows_a, seen, flaky, info.value

    rows_a, seen, flaky, err = run(go())
    assert sorted(seen) == sorted(m.id for m in rows_a)  # every row once: no page lost, none read twice
    assert flaky.next_failed and flaky.resumed >= 1  # a page resumed from its paging state
    assert f"scan metadata of dataset 'flaky_a_" in str(err) and "timed out" in str(err) and "\n" not in str(err)


def test_token_ranges_without_the_ring_cut_it_evenly():
    from dataferry.schema.sources.cassandra._scan import token_ranges

    ranges = token_ranges(types.SimpleNamespace(metadata=None), "ks", 10)
    assert len(ranges) == 10 and ranges[0][0] == -(2**63) and ranges[-1][1] == 2**63 - 1
    assert all(r[1] == s[0] for r, s in zip(ranges, ranges[1:])) and all(r[2] == () for r in ranges)
