"""The handlers: catalog, batch fetch, and ops. ``openapi.yaml`` describes them.

Catalog JSON is small; the split id list is binary and streamed from the
store's arrays in slices (no copy on little-endian hosts); batch fetch is in
``_samples.py``.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from dataferry.schema import IDLIST_TYPE, DatasetInfo, StoreError, idlist_header, idlist_parts

from ._derive import create_split, get_split_job
from ._errors import JSON_TYPE, error_body
from ._keys import GATE, METRICS, REGISTRY
from ._metrics import CONTENT_TYPE as METRICS_TYPE
from ._metrics import exposition
from ._samples import client_gone, stream_samples
from ._validate import name_param, no_query, read_ids

__all__ = ["routes"]

routes = web.RouteTableDef()


def _dataset_json(info: DatasetInfo) -> dict:
    return {
        "name": info.name,
        "num_samples": info.num_samples,
        "num_classes": info.num_classes,
        "label_names": list(info.label_names),
        "created": info.created.isoformat(),
    }


# --- catalog ---------------------------------------------------------------------------
@routes.get("/v1/datasets", allow_head=False)
async def list_datasets(request: web.Request) -> web.Response:
    no_query(request)
    gate = request.app[GATE]
    infos = await gate.call("list_datasets", gate.store.list_datasets)
    return web.json_response({"datasets": [_dataset_json(i) for i in infos]})


@routes.get("/v1/datasets/{name}", allow_head=False)
async def get_dataset(request: web.Request) -> web.Response:
    name = name_param(request, "name", "dataset")
    no_query(request)
    gate = request.app[GATE]
    info, splits = await asyncio.gather(
        gate.call("get_dataset", gate.store.get_dataset, name),
        gate.call("list_splits", gate.store.list_splits, name),
    )
    body = _dataset_json(info)
    body["splits"] = [{"name": s.name, "num_ids": s.num_ids} for s in splits]
    return web.json_response(body)


@routes.get("/v1/datasets/{name}/splits/{split}", allow_head=False)
async def read_split(request: web.Request) -> web.StreamResponse:
    name = name_param(request, "name", "dataset")
    split = name_param(request, "split", "split")
    no_query(request)
    gate = request.app[GATE]
    await gate.require_dataset(name)  # an unknown dataset is named as such, not as a missing split
    idlist = await gate.call("read_split", gate.store.read_split, name, split)
    n = len(idlist)
    resp = web.StreamResponse(headers={"Content-Type": IDLIST_TYPE})
    resp.content_length = 16 + 12 * n
    try:
        await resp.prepare(request)  # in the guard too: the client may have gone while the store was read
        await resp.write(idlist_header(n))
        for part in idlist_parts(idlist):
            await resp.write(part)  # aiohttp awaits drain past 64 KiB: a slow client slows us
        await resp.write_eof()
    except ConnectionError as exc:
        client_gone(request, request.app[METRICS], f"id list of {name!r} split {split!r}", exc)
        return resp
    request.app[METRICS].bytes.inc(16 + 12 * n)
    return resp


# a derived split from a metadata filter, as a job (``_derive.py``)
routes.post("/v1/datasets/{name}/splits")(create_split)
routes.get("/v1/datasets/{name}/split-jobs/{job}", allow_head=False)(get_split_job)


# --- batch fetch -------------------------------------------------------------------------
@routes.post("/v1/datasets/{name}/samples")
async def fetch_samples(request: web.Request) -> web.StreamResponse:
    name = name_param(request, "name", "dataset")
    no_query(request)
    gate = request.app[GATE]
    ids = await read_ids(request, gate.options)
    await gate.require_dataset(name)
    return await stream_samples(request, gate, name, ids)


# --- ops ------------------------------------------------------------------------------------
@routes.get("/healthz", allow_head=False)
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/readyz", allow_head=False)
async def readyz(request: web.Request) -> web.Response:
    gate = request.app[GATE]
    try:
        await gate.call("ready", gate.store.list_datasets, timeout=gate.options.ready_timeout)
    except StoreError as exc:
        return web.Response(status=503, text=error_body("not_ready", str(exc)), content_type=JSON_TYPE)
    return web.json_response({"status": "ready"})


@routes.get("/metrics", allow_head=False)
async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=exposition(request.app[REGISTRY]), headers={"Content-Type": METRICS_TYPE})
