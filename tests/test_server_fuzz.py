"""Fuzz the data service from its OpenAPI document with schemathesis.

Valid and invalid path parameters, bodies (random bytes, malformed JSON) and
headers for every operation, against one real server (SQLite, with a token)
on loopback. Every response must conform to ``server/openapi.yaml`` (status,
media type, JSON schema) and none may be a 5xx; afterwards the server is still
healthy and still serves a real batch fetch.
"""

from __future__ import annotations

import asyncio
import urllib.request

import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from dataferry.schema.sources.http._source import HttpSource
from dataferry.schema import Sample
from dataferry.server import ServerOptions, make_app
from server_kit import SPEC_PATH, live_server, make_samples, seeded_db

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# the dataset, split and ids the spec's examples name
SAMPLES = [Sample(i + 1, s.label, s.data, s.target) for i, s in enumerate(make_samples(8))]

schema = schemathesis.openapi.from_path(str(SPEC_PATH))
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=60, database="none", deterministic=True
)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """Base URL of one server for the module, in a background loop thread."""
    url = seeded_db(tmp_path_factory.mktemp("fuzz") / "s.db", "imagenet", SAMPLES, {"train": [0, 1, 2]})
    with live_server(lambda: make_app(url, ServerOptions(token=TOKEN))) as srv:
        yield srv.base


@schema.parametrize()
@hypothesis.settings(deadline=None, suppress_health_check=list(hypothesis.HealthCheck), print_blob=False)
def test_fuzz(case, fuzz_server):
    # any bytes are a schema-valid binary body, but only whole int64s are ids;
    # any text is a schema-valid filter, but only the filter grammar's sentences are filters
    binary = case.media_type == "application/octet-stream"
    lenient = binary or case.operation.path == "/v1/datasets/{name}/splits"
    case.call_and_validate(base_url=fuzz_server, headers=AUTH,
                           excluded_checks=[positive_data_acceptance] if lenient else None)


def test_still_healthy_after_fuzzing(fuzz_server):
    async def go():
        async with await HttpSource.open(fuzz_server, token=TOKEN) as src:
            got = [r async for r in src.fetch("imagenet", [s.id for s in SAMPLES])]
            return got, await src.list_datasets()

    with urllib.request.urlopen(fuzz_server + "/healthz", timeout=5) as resp:
        assert resp.status == 200
    req = urllib.request.Request(fuzz_server + "/metrics", headers=AUTH)
    with urllib.request.urlopen(req, timeout=5) as resp:
        counts = [line for line in resp.read().decode().splitlines() if line.startswith("dataferry_server_requests_total")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in counts) > 300  # the fuzzer did send plenty
    assert not [line for line in counts if 'status="5' in line]
    got, infos = asyncio.run(go())
    assert sorted(got, key=lambda s: s.id) == sorted(SAMPLES, key=lambda s: s.id)
    assert [i.name for i in infos] == ["imagenet"]

