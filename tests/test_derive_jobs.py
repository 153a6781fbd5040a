"""Derived splits as jobs of the data service (``server/_derive.py``, ``HttpSource.derive_split``).

The real app on loopback over a real SQLite store, whose metadata pages are
held back by a wrapper at the store seam (which we own), so that a derive
outlives the client's read timeout: the client's timeout is made tiny rather
than the data huge. Then the job's failure, a conflicting filter, joining a
running job, the bounds on jobs, and shutdown with a job running.
"""

from __future__ import annotations

import asyncio
import json
import time
import types
from contextlib import aclosing

import aiohttp
import pytest

from dataferry.client import HttpOptions, HttpSource, RequestRejected
from dataferry.schema import IdList, StoreUnavailable, open_store
from dataferry.server import make_app
from dataferry.server._derive import DERIVE_JOBS, JobLimits
from server_kit import call, live_server
from test_filter import LABELS, WHERE, expected_ids, fill, metas

SPLITS_T = "/v1/datasets/{name}/splits"
JOB_T = "/v1/datasets/{name}/split-jobs/{job}"
N = 1500


class SlowMeta:
    """The real store; ``scan_meta`` yields pages of ``page`` samples, each held back ``delay``
    seconds, and fails with StoreUnavailable before page ``fail_at`` (if set). Counts scans and
    records when one is closed."""

    def __init__(self, inner, *, delay: float, page: int = 100, fail_at: int | None = None) -> None:
        self.inner, self.url = inner, inner.url
        self.delay, self.page, self.fail_at = delay, page, fail_at
        self.scans = 0
        self.events: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def scan_meta(self, dataset, ids, *, fields=None):
        self.scans += 1
        n = 0
        try:
            async with aclosing(self.inner.scan_meta(dataset, ids, fields=fields)) as pages:
                async for whole in pages:
                    for k in range(0, len(whole), self.page):
                        await asyncio.sleep(self.delay)
                        if self.fail_at is not None and n >= self.fail_at:
                            raise StoreUnavailable(f"sqlite store {self.url!r}: the disk went away (test)")
                        n += 1
                        yield whole[k : k + self.page]
        finally:
            self.events.append("scan closed")


@pytest.fixture
def slow_service(tmp_path):
    """A service over ``pets`` (1,500 samples, 15 pages of 100) whose metadata pages take
    ``delay`` seconds each; ``make(delay=..., fail_at=...)`` starts it."""
    url = f"sqlite://{tmp_path / 'svc.db'}"
    asyncio.run(_fill(url))
    running = []

    def make(**kw):
        holder = {}

        async def build():
            store = await open_store(url, create=False)
            holder["store"] = store
            holder["slow"] = SlowMeta(store, **kw)
            return make_app(holder["slow"])

        cm = live_server(build)
        live = cm.__enter__()
        running.append((cm, live, holder))
        return types.SimpleNamespace(base=live.base, app=live.app, loop=live.loop, slow=holder["slow"],
                                     stop=lambda: _stop(running, cm))

    yield make
    for cm, live, holder in reversed(running):
        _stop(running, cm)


def _stop(running, cm) -> None:
    for k, (c, live, holder) in enumerate(running):
        if c is cm:
            del running[k]
            try:
                c.__exit__(None, None, None)  # the server first (its jobs end), then the store
            finally:
                asyncio.run(holder["store"].close())
            return


async def _fill(url):
    async with await open_store(url) as store:
        await fill(store, "pets", metas("pets", N))


def _request(method: str, url: str, template: str, body: dict | None = None, *, prefer: str | None = None,
             total: float = 30):
    async def go():
        async with aiohttp.ClientSession() as s:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            if prefer:
                headers["Prefer"] = prefer
            return await call(s, method, url, template, data=json.dumps(body).encode() if body is not None else None,
                              headers=headers, timeout=aiohttp.ClientTimeout(total=total))

    return asyncio.run(go())


def _derive(base: str, *, read_timeout: float, **kw):
    async def go():
        async with await HttpSource.open(base, options=HttpOptions(read_timeout=read_timeout)) as src:
            return await src.derive_split("pets", kw.pop("where", WHERE), **kw)

    return asyncio.run(go())


# --- longer than the client's read timeout ----------------------------------------------------------
def test_a_derive_longer_than_the_read_timeout_succeeds_with_progress(slow_service, capsys):
    svc = slow_service(delay=0.2)  # 15 pages: about 3 s, six times the client's read timeout
    with pytest.raises(asyncio.TimeoutError):  # the control: one request waiting for the record times out
        _request("POST", f"{svc.base}/v1/datasets/pets/splits", SPLITS_T, {"where": WHERE, "name": "big"}, total=0.5)
    t0 = time.monotonic()
    rec = _derive(svc.base, read_timeout=0.5, name="big", progress=True)  # joins the job the control started
    took = time.monotonic() - t0
    want = expected_ids(metas("pets", N))
    assert rec.num_ids == len(want) and rec.name == "big" and not rec.reused
    assert took > 1.0 and svc.slow.scans == 1  # it waited past its read timeout, on the one job
    err = capsys.readouterr().err
    assert "derive pets/all" in err and f"/{N}" in err  # the progress bar, to the parent's size

    async def read():
        async with await HttpSource.open(svc.base) as src:
            return (await src.read_split("pets", "big")).ids.tolist()

    assert asyncio.run(read()) == want


def test_loader_where_over_http_outlives_a_tiny_read_timeout(slow_service):
    from dataferry.client import Loader

    svc = slow_service(delay=0.1)  # about 1.5 s, three times the read timeout
    factory = lambda: HttpSource.open(svc.base, options=HttpOptions(read_timeout=0.5))  # noqa: E731
    with Loader(factory, "pets", where=WHERE, batch_size=256) as loader:
        got = sorted(i for b in iter(loader) for i in b.ids.tolist())
        assert loader.split.startswith("where-") and not loader.derived.reused
    assert got == expected_ids(metas("pets", N))


def test_the_job_is_polled_at_its_location_and_a_reuse_answers_at_once(slow_service):
    svc = slow_service(delay=0.05)
    base = f"{svc.base}/v1/datasets/pets"
    status, headers, body = _request("POST", base + "/splits", SPLITS_T, {"where": WHERE}, prefer="respond-async")
    assert status == 202, body
    doc = json.loads(body)
    assert headers["Location"] == f"/v1/datasets/pets/split-jobs/{doc['job']}"
    assert doc["state"] in ("queued", "running") and doc["name"].startswith("where-") and doc["from"] == "all"
    seen = []
    while doc["state"] not in ("done", "failed"):
        status, _, body = _request("GET", svc.base + headers["Location"], JOB_T, prefer="wait=0.2")
        assert status == 200
        doc = json.loads(body)
        seen.append(doc["done"])
    assert doc["state"] == "done" and doc["record"]["num_ids"] == len(expected_ids(metas("pets", N)))
    assert seen == sorted(seen) and doc["done"] == doc["total"] == N
    status, _, body = _request("POST", base + "/splits", SPLITS_T, {"where": WHERE}, prefer="respond-async, wait=5")
    assert status == 200 and json.loads(body)["reused"] is True  # no job left running: the record


def test_a_job_the_service_forgot_is_posted_again(slow_service):
    """As after a restart, or a poll that reached another worker: the client posts again."""
    svc = slow_service(delay=0.1)
    jobs = svc.app[DERIVE_JOBS]

    def forget():  # the jobs' table of a process that never saw this job (the old one runs on, unseen)
        jobs._jobs.clear()
        jobs._running.clear()

    svc.loop.loop.call_soon_threadsafe(svc.loop.loop.call_later, 0.5, forget)
    rec = _derive(svc.base, read_timeout=0.5, name="again")
    assert rec.num_ids == len(expected_ids(metas("pets", N))) and svc.slow.scans == 2


# --- failures ------------------------------------------------------------------------------------
def test_a_failed_job_is_one_line_naming_the_dataset_and_the_filter(slow_service):
    svc = slow_service(delay=0.1, fail_at=6)
    with pytest.raises(StoreUnavailable) as info:
        _derive(svc.base, read_timeout=0.5, name="broken", where="width >= 512")
    msg = str(info.value)
    assert "\n" not in msg and "'broken' of pets/all where 'width >= 512'" in msg
    assert "failed (503 store_unavailable)" in msg and "the disk went away (test)" in msg
    assert svc.slow.events == ["scan closed"]
    # the job's document says the same, and the split was not written
    job = next(iter(svc.app[DERIVE_JOBS]._jobs.values()))
    status, _, body = _request("GET", f"{svc.base}{job.location()}", JOB_T)
    doc = json.loads(body)
    assert (status, doc["state"], doc["status"], doc["error"]) == (200, "failed", 503, "store_unavailable")
    assert "record" not in doc


def test_a_name_taken_by_an_ordinary_split_fails_the_job_with_409(slow_service):
    svc = slow_service(delay=0)

    async def put_train():
        await svc.slow.put_split("pets", "train", IdList([1, 2], [0, 0]))

    svc.loop.call(put_train())
    with pytest.raises(RequestRejected) as info:
        _derive(svc.base, read_timeout=1, name="train", where="width > 1")
    assert info.value.status == 409 and info.value.error == "split_conflict"
    assert "'train' of pets/all where 'width > 1'" in str(info.value) and "is not a derived split" in str(info.value)


def test_another_filter_for_a_split_being_derived_is_409(slow_service):
    svc = slow_service(delay=0.1)
    url = f"{svc.base}/v1/datasets/pets/splits"
    status, _, body = _request("POST", url, SPLITS_T, {"where": WHERE, "name": "x"}, prefer="respond-async")
    assert status == 202
    first = json.loads(body)["job"]
    status, _, body = _request("POST", url, SPLITS_T, {"where": "width > 3", "name": "x"}, prefer="respond-async")
    doc = json.loads(body)
    assert status == 409 and doc["error"] == "split_conflict" and "being derived from another filter" in doc["detail"]
    again = " " + WHERE.replace(" and ", "  AND ").replace('"lab"', "'lab'")  # the same filter, written otherwise
    status, _, body = _request("POST", url, SPLITS_T, {"where": again, "name": "x"}, prefer="respond-async")
    assert status == 202 and json.loads(body)["job"] == first  # joins the job


def test_unknown_jobs_bad_ids_and_other_datasets(slow_service):
    svc = slow_service(delay=0)
    for path, status, error in [
        ("/v1/datasets/pets/split-jobs/" + "0" * 32, 404, "job_not_found"),
        ("/v1/datasets/pets/split-jobs/XYZ", 400, "bad_job"),
        ("/v1/datasets/b%20d/split-jobs/" + "0" * 32, 400, "bad_dataset_name"),
    ]:
        got, _, body = _request("GET", svc.base + path, JOB_T)
        assert (got, json.loads(body)["error"]) == (status, error), body
    status, _, body = _request("POST", f"{svc.base}/v1/datasets/pets/splits", SPLITS_T, {"where": "width > 1"},
                               prefer="respond-async, wait=5")
    assert status == 200
    job = next(iter(svc.app[DERIVE_JOBS]._jobs))
    got, _, body = _request("GET", f"{svc.base}/v1/datasets/other/split-jobs/{job}", JOB_T)
    assert got == 404 and json.loads(body)["error"] == "job_not_found"


# --- bounds ----------------------------------------------------------------------------------------
def test_finished_jobs_are_forgotten_and_unfinished_ones_bounded(slow_service):
    svc = slow_service(delay=0)
    jobs = svc.app[DERIVE_JOBS]
    jobs.limits = JobLimits(max_kept=2, keep=0.3, max_jobs=1)
    url = f"{svc.base}/v1/datasets/pets/splits"
    for k in range(4):
        status, _, _ = _request("POST", url, SPLITS_T, {"where": f"width > {k}", "name": f"n{k}"},
                                prefer="respond-async, wait=5")
        assert status == 200
    assert len(jobs._jobs) <= 3  # two kept, plus the last one until the next look
    time.sleep(0.4)
    status, _, body = _request("POST", url, SPLITS_T, {"where": "width > 9", "name": "n9"},
                               prefer="respond-async, wait=5")
    assert status == 200 and len(jobs._jobs) == 1  # the older ones forgotten
    old = next(iter(jobs._jobs))
    time.sleep(0.4)
    got, _, body = _request("GET", f"{svc.base}/v1/datasets/pets/split-jobs/{old}", JOB_T)
    assert got == 404 and json.loads(body)["error"] == "job_not_found"

    svc.slow.delay = 0.05  # one unfinished job at most: a second one is refused
    status, _, _ = _request("POST", url, SPLITS_T, {"where": "width > 5", "name": "slow"}, prefer="respond-async")
    assert status == 202
    status, headers, body = _request("POST", url, SPLITS_T, {"where": "width > 6", "name": "other"},
                                     prefer="respond-async")
    assert status == 503 and json.loads(body)["error"] == "busy" and "Retry-After" in headers


def test_shutdown_cancels_a_running_job_before_the_store_closes(slow_service):
    svc = slow_service(delay=0.5)  # 15 pages: 7.5 s
    status, _, body = _request("POST", f"{svc.base}/v1/datasets/pets/splits", SPLITS_T, {"where": WHERE},
                               prefer="respond-async")
    assert status == 202
    job = svc.app[DERIVE_JOBS]._jobs[json.loads(body)["job"]]
    status, _, body = _request("GET", svc.base + job.location(), JOB_T, prefer="wait=0.8")
    assert json.loads(body)["state"] == "running" and json.loads(body)["done"] > 0  # in the middle of the metadata
    t0 = time.monotonic()
    svc.stop()
    assert time.monotonic() - t0 < 5  # not the job's 7.5 s
    assert job.task.done() and job.state == "failed" and "shutting down" in job.doc()["detail"]
    assert svc.slow.events == ["scan closed"] and svc.slow.inner._closed  # ended by the shutdown, not the store
