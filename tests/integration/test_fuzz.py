"""Hypothesis-generated requests for every public route, the console's forms and the
backend's internal API: never a 5xx, never a hang, the server serves normally afterwards,
and a refused request writes no row (issue 13's standing fuzz suite).

Bodies mix the real field names with hostile values: numbers far past int64, floats at
the edges, NUL and other control characters, deep nesting, wrong types."""

from __future__ import annotations

import asyncio
import json
import string
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar import Litestar
from litestar.testing import TestClient
from sqlalchemy import create_engine as sync_engine
from sqlalchemy import text

from backend.builtin import BUILTIN_MODEL_DIR
from backend.engine.async_engine import AsyncEngine
from backend.server import create_backend_app
from backend.wire import SECRET_HEADER
from gateway.app import create_app, engine_config
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants import db
from tenants.models import KeyRole
from tenants.services import ApiKeyService, TenantService
from tests.conftest import migrated_postgres, migrated_sqlite
from tests.support.hostile_grammars import (
    compact_lark_chain,
    compact_ref_chain,
    gbnf_chain,
    lark_chain,
    optional_properties,
    ref_chain,
)

pytestmark = pytest.mark.slow
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same cases every run: a failure here is reproducible
)
# Tables a refused request must leave alone (the audit log records refusals on purpose).
GUARDED = ("tenants", "plans", "api_keys", "price_versions", "console_admins")

HUGE_INTS = st.sampled_from([2**63, 2**64 - 1, 2**70, 10**30, -(2**63) - 1, -1, 0])
EDGE_FLOATS = st.sampled_from([1e308, -1e308, 5e-324, 0.0, -0.0, 2.0000001, 1e-300])
NASTY_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\x00", "a\x00b", "\n\r\x1b[2J", "\u202e", "\ud7ff", "🙂" * 10, "%00"]),
    st.text(alphabet=string.printable, min_size=200, max_size=300),
)
LEAF = st.one_of(st.none(), st.booleans(), HUGE_INTS, st.integers(-5, 40), EDGE_FLOATS, NASTY_TEXT)
JSON = st.recursive(
    LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(NASTY_TEXT, inner, max_size=4)
    ),
    max_leaves=12,
)
SAMPLING_FIELDS = [
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stop",
    "seed", "ignore_eos", "min_tokens", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "priority", "ttft_deadline_ms", "stream", "stream_options",
    "logprobs", "top_logprobs", "echo", "user", "logit_bias", "tools", "response_format",
]  # fmt: skip


# The typed 5xx a client may cause on purpose: a ttft_deadline_ms it set, a full queue.
CLIENT_CAUSED = ('"code":"deadline_exceeded"', '"code":"overloaded"')


def assert_no_server_error(status: int, body: str, where: object) -> None:
    assert status < 500 or (
        status in (503, 504)
        and body.startswith('{"error"')
        and any(c in body for c in CLIENT_CAUSED)
    ), (where, status, body)


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def as_bytes(value: Any) -> bytes:
    return json.dumps(value, allow_nan=False).encode("utf-8", "surrogatepass")


@st.composite
def sampling_body(draw: st.DrawFn, model: str, prompt_field: str) -> bytes:
    body: dict[str, Any] = {"model": draw(st.sampled_from([model, model, "other", 7]))}
    if prompt_field == "messages":
        content = st.one_of(NASTY_TEXT, JSON)
        role = st.sampled_from(["user", "system", "assistant", "tool", "nobody", None])
        body["messages"] = draw(
            st.one_of(
                st.lists(st.fixed_dictionaries({"role": role, "content": content}), max_size=3),
                JSON,
            )
        )
    else:
        ids = st.lists(st.one_of(st.integers(0, 4095), HUGE_INTS), min_size=1, max_size=8)
        body["prompt"] = draw(st.one_of(NASTY_TEXT, ids, JSON))
    for name in draw(st.lists(st.sampled_from(SAMPLING_FIELDS), max_size=6, unique=True)):
        body[name] = draw(st.one_of(st.integers(0, 8), JSON))
    body["max_tokens"] = body.get("max_tokens", 2) if draw(st.booleans()) else 2
    raw = as_bytes(body)
    return draw(st.sampled_from([raw, raw, raw[: len(raw) // 2], deep(1200).encode()]))


class Server:
    """The gateway on SQLite with one tenant key and one admin key, served in a thread."""

    def __init__(self, client: TestClient[Litestar], url: str, model: str, keys: dict[str, str]):
        self.client, self.model, self.keys = client, model, keys
        self.db = sync_engine(url)
        self.refused: list[str] = []  # request ids of 4xx answers: none may have a ledger row

    def counts(self) -> dict[str, int]:
        """Rows of the tables a request writes synchronously (the ledger is checked by id)."""
        count = "SELECT count(*) FROM {}"
        with self.db.connect() as conn:
            return {t: conn.execute(text(count.format(t))).scalar_one() for t in GUARDED}

    def ledger_has(self, request_id: str) -> bool:
        query = text("SELECT count(*) FROM usage_events WHERE request_id = :id")
        with self.db.connect() as conn:
            return bool(conn.execute(query, {"id": request_id}).scalar_one())

    def send(self, method: str, path: str, role: str = "tenant", **kwargs: Any) -> int:
        before = self.counts()
        headers = {"Authorization": f"Bearer {self.keys[role]}", **kwargs.pop("headers", {})}
        response = self.client.request(method, path, headers=headers, timeout=30, **kwargs)
        status = response.status_code
        assert_no_server_error(status, response.text, (method, path))
        if 400 <= status < 500:
            assert self.counts() == before, (method, path, status)
            self.refused.append(response.headers.get("x-request-id", ""))
        return status

    def still_serves(self) -> None:
        """A normal request succeeds and its ledger row lands (written just after the
        response); by then no refused request has a row either."""
        assert self.client.get("/healthz").status_code == 200
        body = {"model": self.model, "prompt": "The", "max_tokens": 2}
        headers = {"Authorization": f"Bearer {self.keys['tenant']}"}
        response = self.client.post("/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        served = response.headers["x-request-id"]
        deadline = time.monotonic() + 10
        while not self.ledger_has(served):
            assert time.monotonic() < deadline, "the served request's ledger row never landed"
            time.sleep(0.005)
        assert not [rid for rid in self.refused if rid and self.ledger_has(rid)]
        self.refused.clear()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    engine_client: InProcessEngineClient,
) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("fuzz")
    url = migrated_sqlite(folder / "tollgate.db")
    if request.param == "postgresql":  # NUL characters and long strings meet real columns
        url = migrated_postgres()

    async def make_keys() -> dict[str, str]:
        engine = db.create_engine(url)
        async with db.session_factory(engine).begin() as session:
            tenant = await TenantService(session).create("fuzzed")
            ops = await TenantService(session).create("ops")
            keys = {
                "tenant": (await ApiKeyService(session).create(tenant, "t", KeyRole.TENANT)).secret,
                "admin": (await ApiKeyService(session).create(ops, "a", KeyRole.ADMIN)).secret,
            }
        await engine.dispose()
        return keys

    keys = asyncio.run(make_keys())
    settings_ = replace(Settings.from_env({}), database_url=url, data_dir=folder / "data")
    with TestClient(app=create_app(settings_, engine_client=engine_client)) as client:
        yield Server(client, url, engine_client.model_name, keys)


@FUZZ
@given(data=st.data())
def test_chat_completions_survive_hostile_bodies(server: Server, data: st.DataObject) -> None:
    body = data.draw(sampling_body(server.model, "messages"))
    server.send("POST", "/v1/chat/completions", content=body)
    server.still_serves()


@FUZZ
@given(data=st.data())
def test_completions_survive_hostile_bodies(server: Server, data: st.DataObject) -> None:
    body = data.draw(sampling_body(server.model, "prompt"))
    server.send("POST", "/v1/completions", content=body)
    server.still_serves()


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "fuzzed", "schema": schema}}


# Structured-output fields with grammars of hostile shapes and sizes (issue 32): chains
# that overflowed the grammar library's native stack, sizes that held the event loop.
GRAMMAR_SHAPES = [
    ("response_format", lambda n: _schema_format(ref_chain(n))),
    ("guided_json", compact_ref_chain),
    ("guided_json", optional_properties),
    ("guided_grammar", lark_chain),
    ("guided_grammar", compact_lark_chain),
    ("guided_grammar", gbnf_chain),
    ("guided_choice", lambda n: [f"c{i}" for i in range(n)]),
    ("guided_regex", lambda n: "a?" * n),
]


@st.composite
def constrained_body(draw: st.DrawFn, model: str) -> bytes:
    field, make = draw(st.sampled_from(GRAMMAR_SHAPES))
    value = draw(
        st.one_of(
            st.sampled_from([1, 30, 129, 257, 401, 1000, 4000]).map(make),
            JSON,
            st.just(deep(600)),
        )
    )
    messages = [{"role": "user", "content": draw(NASTY_TEXT)}]
    return as_bytes({"model": model, "messages": messages, "max_tokens": 2, field: value})


@FUZZ
@given(data=st.data())
def test_structured_outputs_survive_hostile_grammars(server: Server, data: st.DataObject) -> None:
    """A grammar the limits miss would crash this very process (the engine is in it). The
    engine refuses a grammar after admission, and such a refusal writes a free usage row
    by design (gateway/metering/recorder.py), so no ledger check here: no 5xx, and still serving."""
    body = data.draw(constrained_body(server.model))
    headers = {"Authorization": f"Bearer {server.keys['tenant']}"}
    response = server.client.post("/v1/chat/completions", content=body, headers=headers, timeout=30)
    assert_no_server_error(response.status_code, response.text, "grammar")
    server.still_serves()


ADMIN_WRITES = [
    ("POST", "/admin/api/plans"),
    ("PATCH", "/admin/api/plans/{name}"),
    ("POST", "/admin/api/tenants"),
    ("PATCH", "/admin/api/tenants/{name}"),
    ("POST", "/admin/api/tenants/{name}/keys"),
    ("PATCH", "/admin/api/keys/{name}/limits"),
    ("POST", "/admin/api/keys/{name}/revoke"),
    ("POST", "/admin/api/prices"),
    ("PUT", "/admin/api/billing/customers/{name}"),
    ("POST", "/admin/api/billing/export/requeue"),
    ("POST", "/admin/api/audit/verify"),
]
READS = [
    "/v1/models/{name}",
    "/v1/usage?period={name}",
    "/v1/usage/requests/{name}",
    "/admin/api/tenants/{name}/usage",
    "/admin/api/audit?since={name}",
    "/admin/api/audit?tenant={name}&limit={name}",
    "/admin/api/billing/reports/{name}/{name}",
    "/admin/api/billing/reports/fuzzed/{name}/csv",
]
NAMES = st.one_of(
    st.sampled_from(["fuzzed", "0000-01", "9999-12", "9999-12-31T23:59:59-14:00", "%00", "-1"]),
    st.text(alphabet=string.ascii_letters + string.digits + "-_.:%", max_size=30),
)


@FUZZ
@given(
    route=st.sampled_from(ADMIN_WRITES),
    name=NAMES,
    body=st.one_of(JSON.map(as_bytes), st.just(deep(1200).encode())),
)
def test_admin_writes_survive_hostile_bodies(
    server: Server, route: tuple[str, str], name: str, body: bytes
) -> None:
    method, path = route
    server.send(method, path.format(name=name), role="admin", content=body)
    server.still_serves()


@FUZZ
@given(path=st.sampled_from(READS), name=NAMES, role=st.sampled_from(["tenant", "admin"]))
def test_reads_survive_hostile_parameters(server: Server, path: str, name: str, role: str) -> None:
    server.send("GET", path.format(name=name), role=role)


@FUZZ
@given(
    path=st.sampled_from(["/admin/login", "/admin/tenants", "/admin/plans", "/admin/prices"]),
    form=st.dictionaries(NASTY_TEXT, NASTY_TEXT, max_size=6),
    forwarded=st.one_of(
        st.none(),
        st.text(alphabet=string.ascii_letters + string.digits + ".:,[] %", max_size=300),
        st.just("1.2.3.4, " * 20),
    ),
)
def test_console_forms_survive_hostile_input(
    server: Server, path: str, form: dict[str, str], forwarded: str | None
) -> None:
    headers = {} if forwarded is None else {"X-Forwarded-For": forwarded}
    status = server.send("POST", path, data=form, headers=headers, follow_redirects=False)
    assert status in (200, 303, 400, 401, 403, 404, 413, 429)
    server.still_serves()


@pytest.fixture(scope="module")
def backend() -> Iterator[TestClient[Litestar]]:
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, engine_config(Settings.from_env({})))
    app = create_backend_app(engine, BUILTIN_MODEL_DIR, secret="fuzz-secret")
    with TestClient(app=app) as client:
        client.headers[SECRET_HEADER] = "fuzz-secret"
        yield client


@FUZZ
@given(
    route=st.sampled_from(["/internal/generate", "/internal/abort"]),
    body=st.one_of(
        JSON,
        st.fixed_dictionaries(
            {
                "request_id": NASTY_TEXT,
                "prompt": st.lists(st.one_of(st.integers(0, 4095), HUGE_INTS), max_size=6),
                "params": st.dictionaries(st.sampled_from(SAMPLING_FIELDS), JSON, max_size=4),
                "priority": st.one_of(st.integers(-3, 9), HUGE_INTS),
                "weight": st.one_of(st.integers(-3, 9), HUGE_INTS),
                "timeout_s": st.one_of(st.none(), EDGE_FLOATS),
            }
        ),
    ),
)
def test_the_backend_api_survives_hostile_bodies(
    backend: TestClient[Litestar], route: str, body: Any
) -> None:
    response = backend.post(route, content=as_bytes(body), timeout=30)
    assert_no_server_error(response.status_code, response.text, route)
    for line in response.text.splitlines():  # a streamed refusal is a typed line, not a crash
        decoded = json.loads(line)
        if decoded.get("type") == "error":
            assert decoded.get("kind") != "engine_dead", line
    ok = {"request_id": "probe", "prompt": [1, 2, 3], "params": {"max_tokens": 2}}
    assert backend.post("/internal/generate", json=ok, timeout=30).status_code == 200
    assert backend.get("/healthz").status_code == 200
