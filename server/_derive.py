"""``POST /v1/datasets/{name}/splits``: a derived split from a metadata filter.

The body is JSON ``{"where": FILTER, "name": NAME?, "from": PARENT?}``. The
filter is parsed here, before the store is asked anything: a bad one is 400
``bad_filter`` with its ``position``. The work is
:func:`dataferry.schema._splits.derive_split`, which reads only the catalog
and metadata (``read_split``, ``read_meta``), never a sample's bytes, and is
bounded by ``hold_timeout`` (a big dataset's metadata takes longer than one
catalog call's ``store_timeout``). The answer is the stored record.
"""

from __future__ import annotations

import json

from aiohttp import hdrs, web

from dataferry.schema import ALL_SPLIT, check_name
from dataferry.schema._errors import ConfigError
from dataferry.schema._filter import FilterError, parse_filter
from dataferry.schema._splits import derive_split

from ._errors import JSON_TYPE, http_error
from ._keys import GATE
from ._validate import name_param, no_query, read_body

__all__ = ["create_split"]

_KEYS = {"where", "name", "from"}


async def create_split(request: web.Request) -> web.Response:
    dataset = name_param(request, "name", "dataset")
    no_query(request)
    gate = request.app[GATE]
    if request.headers.get(hdrs.CONTENT_TYPE, "") == "" or request.content_type != JSON_TYPE:
        raise http_error(415, "unsupported_media_type", f'send Content-Type: {JSON_TYPE} with {{"where": "FILTER"}}')
    where, name, parent = _read(await read_body(request, gate.options))
    await gate.require_dataset(dataset)
    try:
        record = await gate.call(
            "derive_split", _derive, gate.store, dataset, where, name, parent, timeout=gate.options.hold_timeout
        )
    except ConfigError as exc:  # the filter parsed above: the name is taken by a split that is not derived
        raise http_error(409, "split_conflict", str(exc), dataset=dataset) from None
    return web.json_response(record.to_json())


async def _derive(store, dataset: str, where: str, name: str | None, parent: str):
    return await derive_split(store, dataset, where, name=name, parent=parent, progress=False)


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
