"""Every health probe in ``deploy/`` run against the real server on loopback
(the real app, a real SQLite store, a bearer token configured):

* the compose servers' healthcheck (readiness: ``/readyz`` asks the store),
* the image's ``HEALTHCHECK`` (liveness: ``/healthz`` does not),
* HAProxy's ``http-check`` request and expected status (readiness).

Each probe is the command or request from the file, with only the port moved
to the test server's. The readiness probes must fail once the store stops
answering; liveness must not.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys

import aiohttp
import pytest
from _deploy_kit import STACKS, cli_args, compose_model, final_stage, haproxy_sections, haproxy_setting
from server_kit import BrokenStore, run, serve

from dataferry.schema import open_store
from dataferry.server import ServerOptions, make_app

TOKEN = "probe-" + "t" * 24


async def _with_server(tmp_path, probe) -> tuple[object, object]:
    """``probe(base_url)`` on a ready server, then again once the store's catalog fails."""
    async with await open_store(f"sqlite://{tmp_path / 'p.db'}") as inner:
        store = BrokenStore(inner)
        async with serve(make_app(store, ServerOptions(token=TOKEN))) as base:
            ready = await probe(base)
            store.catalog = "fail"
            unready = await probe(base)
    return ready, unready


def _moved(text: str, port: int, base: str) -> str:
    """``text`` with its one ``http://127.0.0.1:<port>`` pointed at the test server."""
    old = f"http://127.0.0.1:{port}/"
    assert text.count(old) == 1, f"expected one {old} in {text!r}"
    return text.replace(old, base + "/")


async def _exit_status(argv: list[str], env: dict[str, str]) -> int:
    # no proxy variables: the probe's urllib must go straight to loopback
    proc = await asyncio.create_subprocess_exec(*argv, env={"PATH": os.environ["PATH"], **env},
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(proc.wait(), 20)


def _python_probe(test: list[str]) -> str:
    """The code of a ``["CMD", "python", "-c", code]`` healthcheck (the image has no curl)."""
    assert test[:3] == ["CMD", "python", "-c"] and len(test) == 4, test
    return test[3]


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_the_compose_servers_probe_readiness(tmp_path, stack):
    svc = compose_model(stack)["services"]["server-1"]
    code = _python_probe(svc["healthcheck"]["test"])
    port = cli_args(svc["command"]).port  # the port the server listens on

    async def probe(base):
        return await _exit_status([sys.executable, "-c", _moved(code, port, base)], {})

    ready, unready = run(_with_server(tmp_path, probe))
    assert ready == 0, "the compose healthcheck fails on a ready server"
    assert unready != 0, "the compose healthcheck passes while the store is down"


def test_the_image_probes_liveness(tmp_path):
    (healthcheck,) = final_stage("HEALTHCHECK")
    argv = json.loads(healthcheck.partition(" CMD ")[2])
    assert argv[:2] == ["python", "-c"]
    url = re.search(r"DATAFERRY_HEALTHCHECK_URL=(\S+)", " ".join(final_stage("ENV"))).group(1)
    (expose,) = final_stage("EXPOSE")

    async def probe(base):
        return await _exit_status([sys.executable, *argv[1:]], {"DATAFERRY_HEALTHCHECK_URL": _moved(url, expose, base)})

    ready, unready = run(_with_server(tmp_path, probe))
    assert ready == 0, "the image's HEALTHCHECK fails on a serving server"
    assert unready == 0, "the image's HEALTHCHECK is liveness: a store outage must not restart the container"


def test_haproxys_check_asks_readiness(tmp_path):
    backend = haproxy_sections()["backend dataferry"]
    words = haproxy_setting(backend, "http-check send").split()  # meth GET uri /readyz ... hdr Host dataferry
    request, headers = {}, {}
    while words:
        keyword = words.pop(0)
        if keyword == "hdr":
            name, value = words.pop(0), words.pop(0)
            headers[name] = value
        else:
            assert keyword in ("meth", "uri", "ver"), f"http-check send: {keyword}?"
            request[keyword] = words.pop(0)
    kind, expected = haproxy_setting(backend, "http-check expect").split()
    assert kind == "status"

    async def probe(base):
        async with aiohttp.ClientSession() as session:
            async with session.request(request["meth"], base + request["uri"], headers=headers) as resp:
                return resp.status

    ready, unready = run(_with_server(tmp_path, probe))
    assert ready == int(expected), f"HAProxy would mark a ready replica down ({ready})"
    assert unready != int(expected), "HAProxy would keep a replica whose store is down"
