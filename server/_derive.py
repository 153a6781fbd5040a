"""Derived splits over HTTP: ``POST /v1/datasets/{name}/splits`` runs a derive job.

The body is JSON ``{"where": FILTER, "name": NAME?, "from": PARENT?}``; the
filter is parsed before the store is asked anything (400 ``bad_filter`` with
its ``position``). The work (``dataferry.schema.derive_split``: catalog and
metadata only) runs as a job of the app (:class:`DeriveJobs`): a POST starts
or joins the job for the same dataset, name, filter and parent (another
filter: 409 ``split_conflict``); without ``Prefer: respond-async`` it waits
and answers 200 or the job's error; with ``respond-async, wait=N`` a job still
running is 202 with ``Location: /v1/datasets/{name}/split-jobs/{job}``, whose
``GET`` answers the job's document (404 ``job_not_found`` once forgotten).
Bounds are :class:`JobLimits`; unfinished jobs are cancelled at shutdown.
The flow in full: README.md, Derived splits as jobs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import quote

from aiohttp import hdrs, web

from dataferry.schema import (
    ALL_SPLIT,
    ConfigError,
    DerivedSplit,
    FilterError,
    StoreUnavailable,
    check as _check,
    check_name,
    derive_split,
    derived_name,
    parse_filter,
)

from ._errors import JSON_TYPE, http_error, translate
from ._gate import StoreGate
from ._keys import GATE
from ._validate import name_param, no_query, read_body

__all__ = ["create_split", "get_split_job", "JobLimits", "DeriveJobs", "DERIVE_JOBS", "add_derive_jobs"]

log = logging.getLogger("dataferry.server")

_KEYS = {"where", "name", "from"}
_JOB_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True, slots=True)
class JobLimits:
    """How many derive jobs, for how long."""

    #: jobs running at once (the others wait, ``queued``)
    max_running: int = 2
    #: unfinished jobs (queued or running); a new one beyond is 503 busy
    max_jobs: int = 64
    #: seconds a job may run
    timeout: float = 3600.0
    #: seconds a finished job is remembered (its document served)
    keep: float = 600.0
    #: finished jobs remembered at most (the oldest forgotten first)
    max_kept: int = 256
    #: the longest ``Prefer: wait=N`` honoured, seconds
    max_wait: float = 30.0

    def __post_init__(self) -> None:
        _check(min(self.max_running, self.max_jobs, self.max_kept) >= 1, "job counts must be >= 1")
        _check(min(self.timeout, self.keep) > 0 and self.max_wait >= 0, "job times must be > 0")


@dataclass(eq=False)
class _Job:
    id: str
    dataset: str
    name: str
    where: str
    parent: str
    canonical: str
    state: str = "queued"
    done: int = 0
    total: int | None = None
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    record: DerivedSplit | None = None
    failure: tuple[int, dict, dict] | None = None  # status, JSON error body, headers
    task: asyncio.Task | None = None

    def progress(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def doc(self) -> dict:
        out = {
            "job": self.id, "dataset": self.dataset, "name": self.name, "where": self.where, "from": self.parent,
            "state": self.state, "done": self.done, "total": self.total,
            "elapsed_s": round((self.ended or time.monotonic()) - self.started, 3),
        }
        if self.record is not None:
            out["record"] = self.record.to_json()
        if self.failure is not None:
            status, body, _ = self.failure
            out.update(status=status, error=body["error"], detail=body["detail"])
        return out

    def location(self) -> str:
        return f"/v1/datasets/{quote(self.dataset, safe='')}/split-jobs/{self.id}"


class DeriveJobs:
    """The app's derive jobs: started, joined, waited for, forgotten (see module docs)."""

    def __init__(self, limits: JobLimits = JobLimits()) -> None:
        self.limits = limits
        self._jobs: dict[str, _Job] = {}  # id -> job, in start order
        self._running: dict[tuple[str, str], _Job] = {}  # (dataset, name) -> its unfinished job
        self._slots = asyncio.Semaphore(limits.max_running)
        self._closed = False

    def start(self, gate: StoreGate, dataset: str, where: str, name: str | None, parent: str) -> _Job:
        """The job deriving ``name`` (or the one already doing so); raises 409 or 503."""
        if self._closed:
            raise StoreUnavailable("the server is shutting down: no new derive jobs")
        self._forget()
        canonical = parse_filter(where).canonical
        name = name if name is not None else derived_name(canonical, parent)
        key = (dataset, name)
        job = self._running.get(key)
        if job is not None:
            if job.canonical == canonical and job.parent == parent:
                return job
            raise http_error(
                409, "split_conflict",
                f"split {name!r} of dataset {dataset!r} is being derived from another filter or parent "
                f"(job {job.id}); wait for it or choose another name", dataset=dataset,
            )
        if len(self._running) >= self.limits.max_jobs:
            raise http_error(503, "busy", f"{len(self._running)} derive jobs are unfinished; try again later",
                             headers={"Retry-After": "5"})
        job = _Job(uuid.uuid4().hex, dataset, name, where, parent, canonical)
        self._jobs[job.id] = self._running[key] = job
        job.task = asyncio.ensure_future(self._run(gate, job))
        return job

    async def _run(self, gate: StoreGate, job: _Job) -> None:
        try:
            async with self._slots:
                job.state = "running"
                job.record = await gate.call("derive_split", self._derive, gate, job, timeout=self.limits.timeout)
                job.state = "done"
        except asyncio.CancelledError:
            job.failure = _failure(StoreUnavailable(
                f"the derive job for split {job.name!r} of dataset {job.dataset!r} was cancelled: "
                "the server is shutting down"))
            job.state = "failed"
        except Exception as exc:  # noqa: BLE001 - every failure becomes the job's error document
            job.failure = _failure(exc)
            job.state = "failed"
            if job.failure[0] >= 500 and job.failure[1]["error"] == "internal_error":
                log.error("derive job %s for %s/%s failed", job.id, job.dataset, job.name, exc_info=exc)
        finally:
            job.ended = time.monotonic()
            if self._running.get((job.dataset, job.name)) is job:
                del self._running[(job.dataset, job.name)]

    @staticmethod
    async def _derive(gate: StoreGate, job: _Job) -> DerivedSplit:
        return await derive_split(gate.store, job.dataset, job.where, name=job.name, parent=job.parent,
                                  progress=False, on_progress=job.progress)

    def get(self, dataset: str, job_id: str) -> _Job:
        self._forget()
        job = self._jobs.get(job_id)
        if job is None or job.dataset != dataset:
            raise http_error(404, "job_not_found",
                             f"no derive job {job_id!r} for dataset {dataset!r} (unknown, or finished and forgotten)",
                             dataset=dataset)
        return job

    @staticmethod
    async def wait(job: _Job, seconds: float | None) -> None:
        """Until ``job`` ends, or ``seconds`` pass (None: no limit); the job goes on either way."""
        if job.task is not None and not job.task.done() and (seconds is None or seconds > 0):
            await asyncio.wait({job.task}, timeout=seconds)

    def _forget(self) -> None:
        now = time.monotonic()
        ended = [j for j in self._jobs.values() if j.ended is not None]
        ended.sort(key=lambda j: j.ended)
        extra = len(ended) - self.limits.max_kept
        for k, job in enumerate(ended):
            if k < extra or now - job.ended > self.limits.keep:
                del self._jobs[job.id]

    async def close(self) -> None:
        """Cancel the unfinished jobs and wait for them to end; start no more."""
        self._closed = True
        tasks = [j.task for j in self._jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._jobs.clear()
        self._running.clear()


def _failure(exc: BaseException) -> tuple[int, dict, dict]:
    """The status, JSON error body and headers a failed derive answers with."""
    if isinstance(exc, ConfigError):  # the filter parsed before: the name is taken by a split that is not derived
        return 409, {"error": "split_conflict", "detail": str(exc)}, {}
    resp = translate(exc)
    if resp is None:
        return 500, {"error": "internal_error", "detail": "the derive job failed unexpectedly; see the server log"}, {}
    headers = {k: v for k, v in resp.headers.items() if k == "Retry-After"}
    return resp.status, json.loads(resp.text), headers


#: the app's derive jobs (made and closed by :func:`add_derive_jobs`'s cleanup context)
DERIVE_JOBS = web.AppKey("derive_jobs", DeriveJobs)


def add_derive_jobs(app: web.Application, limits: JobLimits = JobLimits()) -> None:
    """Give ``app`` its derive jobs; call after the store's cleanup context is added (the jobs end first)."""

    async def jobs_lifetime(app: web.Application) -> AsyncIterator[None]:
        app[DERIVE_JOBS] = DeriveJobs(limits)
        try:
            yield
        finally:
            await app[DERIVE_JOBS].close()

    async def stop_jobs(app: web.Application) -> None:  # on shutdown: waiting requests answer at once
        if DERIVE_JOBS in app:
            await app[DERIVE_JOBS].close()

    app.cleanup_ctx.append(jobs_lifetime)
    app.on_shutdown.append(stop_jobs)


# --- the handlers ---------------------------------------------------------------------------------
async def create_split(request: web.Request) -> web.Response:
    dataset = name_param(request, "name", "dataset")
    no_query(request)
    gate = request.app[GATE]
    if request.headers.get(hdrs.CONTENT_TYPE, "") == "" or request.content_type != JSON_TYPE:
        raise http_error(415, "unsupported_media_type", f'send Content-Type: {JSON_TYPE} with {{"where": "FILTER"}}')
    where, name, parent = _read(await read_body(request, gate.options))
    await gate.require_dataset(dataset)
    jobs = request.app[DERIVE_JOBS]
    respond_async, wait = _prefer(request, jobs.limits)
    job = jobs.start(gate, dataset, where, name, parent)
    await jobs.wait(job, wait if respond_async else None)
    if job.state in ("queued", "running"):
        return web.json_response(job.doc(), status=202, headers={
            hdrs.LOCATION: job.location(), "Preference-Applied": "respond-async", hdrs.RETRY_AFTER: "1"})
    return _final(job)


async def get_split_job(request: web.Request) -> web.Response:
    dataset = name_param(request, "name", "dataset")
    job_id = request.match_info["job"]
    no_query(request)
    if not _JOB_ID.match(job_id):
        raise http_error(400, "bad_job", f"job ids are 32 lowercase hex digits, not {job_id[:64]!r}")
    jobs = request.app[DERIVE_JOBS]
    job = jobs.get(dataset, job_id)
    _, wait = _prefer(request, jobs.limits)
    await jobs.wait(job, wait)
    return web.json_response(job.doc())


def _final(job: _Job) -> web.Response:
    """A finished job's answer to the POST that waited for it: the record, or its error."""
    if job.record is not None:
        return web.json_response(job.record.to_json())
    status, body, headers = job.failure or (500, {"error": "internal_error", "detail": "no result"}, {})
    raise http_error(status, body["error"], body["detail"], headers=headers,
                     **{k: v for k, v in body.items() if k not in ("error", "detail")})


def _prefer(request: web.Request, limits: JobLimits) -> tuple[bool, float]:
    """``Prefer`` (RFC 7240): whether ``respond-async`` is asked, and the ``wait`` (seconds, capped; 0 if none).
    Preferences this does not know, or cannot read, are ignored."""
    respond_async, wait = False, 0.0
    for value in request.headers.getall("Prefer", ()):
        for pref in value.split(","):
            key, _, arg = pref.strip().partition("=")
            key = key.strip().lower()
            if key == "respond-async":
                respond_async = True
            elif key == "wait":
                try:
                    n = float(arg.strip().strip('"'))
                except ValueError:
                    continue
                if math.isfinite(n) and n >= 0:
                    wait = min(n, limits.max_wait)
    return respond_async, wait


def _read(body: bytes) -> tuple[str, str | None, str]:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise http_error(400, "bad_json", f"the body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("where"), str) or set(doc) - _KEYS:
        raise http_error(
            400, "bad_body",
            'the JSON body must be an object {"where": "FILTER", "name": "NAME" (optional), "from": "SPLIT" (optional)}',
        )
    try:
        parse_filter(doc["where"])
    except FilterError as exc:
        raise http_error(400, "bad_filter", str(exc), position=exc.position) from None
    except ConfigError as exc:
        raise http_error(400, "bad_filter", str(exc)) from None
    name, parent = doc.get("name"), doc.get("from", ALL_SPLIT)
    try:
        if name is not None:
            check_name("split", name)
        check_name("split", parent)
    except ConfigError as exc:
        raise http_error(400, "bad_split_name", str(exc)) from None
    if name == ALL_SPLIT:
        raise http_error(400, "bad_split_name", f"split name {ALL_SPLIT!r} is reserved for the dataset's full id list")
    return doc["where"], name, parent
