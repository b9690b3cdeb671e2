"""Tollgate in front of OpenAI-compatible upstreams: the vLLM-like server of the tests
(tests/support/vllm_like.py) on loopback, registered as `openai` models, driven through
the gateway's HTTP API by the real `openai` SDK.

The gateways here probe their upstreams only when a test says so (`probe`), so what a
test sees of health and load is what it arranged, not a race with a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from litestar import Litestar
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.builtin import BUILTIN_MODEL_DIR
from gateway.dispatch.routing import affinity_key, pick
from gateway.dispatch.upstream import OpenAIUpstreamClient
from gateway.settings import Settings
from tenants.billing.prices import PriceService
from tenants.models import KeyRole, UsageEvent, utcnow
from tenants.pricing import Price
from tenants.registry import ModelKind, ModelService, ModelSpec, ServedModel, Target
from tenants.services import ApiKeyService, TenantService
from tests.conftest import eventually, migrated_sqlite, read_text_events, serving
from tests.e2e.processes import free_port, running, start
from tests.support.vllm_like import (
    CALL_ARGUMENTS,
    JSON_OUTPUT,
    OUTPUT_TEXT,
    Config,
    logprob_of,
    render_chat,
    tokenize,
)
from tests.support.vllm_like import create_app as vllm_like

pytestmark = pytest.mark.integration

Sessions = async_sessionmaker[AsyncSession]
MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]
BACKEND_SECRET = "backend-secret-for-tests"
MODEL = "llama-up"  # the registry's name; the upstream calls it "vllm-like"
VLLM, SGLANG = "llama-vllm", "llama-sglang"  # models configured to schedule by priority
SHARED = "llama-shared"  # a model whose tenants share the upstream's prefix cache


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: these tests are about the upstream, not the database."""
    return migrated_sqlite(tmp_path / "tollgate.db")


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    base = Settings.from_env({})
    return replace(
        base,
        database_url=database_url,
        data_dir=tmp_path / "data",
        upstream_probe_s=3600.0,  # the tests probe (see `probe`)
        cache_salt_secret="test-salt-secret",
        backend_secret=BACKEND_SECRET,
        upstream_priority_models={VLLM: "lower-first", SGLANG: "higher-first"},
        upstream_shared_cache_models=frozenset({SHARED}),
    )


@dataclass
class Gateway:
    app: Litestar
    url: str
    sessions: Sessions

    def sdk(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def client(self, model: str = MODEL) -> OpenAIUpstreamClient:
        client = self.app.state.runtime.models.get(model)
        assert isinstance(client, OpenAIUpstreamClient)
        return client

    async def register(self, *targets: str, name: str = MODEL, **fields: Any) -> None:
        spec = ModelSpec(
            name,
            ModelKind(fields.pop("kind", "openai")),
            tuple(Target(url) for url in targets),
            upstream_model=fields.pop("upstream_model", "vllm-like"),
            **fields,
        )
        async with self.sessions.begin() as session:
            await ModelService(session).add(spec)
            await PriceService(session).create(name, Price(1, 1, 1), utcnow(), "test")
        runtime = self.app.state.runtime
        runtime.recorder.prices.invalidate()  # a registry model is served only once priced
        await runtime.models.refresh()

    async def key(self, tenant: str) -> str:
        return (await self.tenant(tenant))[0]

    async def admin_key(self) -> str:
        async with self.sessions.begin() as session:
            tenant = await TenantService(session).create("ops")
            key = await ApiKeyService(session).create(tenant, "root", KeyRole.ADMIN)
        return key.secret

    async def tenant(self, name: str) -> tuple[str, str]:
        """A new tenant's API key, and its id."""
        async with self.sessions.begin() as session:
            tenant = await TenantService(session).create(name)
            key = await ApiKeyService(session).create(tenant, "test", KeyRole.TENANT)
        return key.secret, tenant.id

    async def rows(self) -> list[UsageEvent]:
        async with self.sessions() as session:
            return list((await session.execute(select(UsageEvent))).scalars())

    async def settled(self, count: int) -> bool:
        """True once `count` usage rows are written (settling finishes after the answer)."""
        return len(await self.rows()) >= count

    async def row(self, request_id: str) -> UsageEvent | None:
        query = select(UsageEvent).where(UsageEvent.request_id == request_id)
        async with self.sessions() as session:
            return (await session.execute(query)).scalar_one_or_none()

    def metrics(self) -> str:
        exposition: bytes = self.app.state.telemetry.metrics.exposition()
        return exposition.decode()


@pytest.fixture
def gateway(live_server: tuple[Litestar, str], sessions: Sessions) -> Gateway:
    return Gateway(*live_server, sessions)


@contextlib.asynccontextmanager
async def upstream(port: int = 0, **options: Any) -> AsyncIterator[str]:
    async with serving(vllm_like(Config(**options)), port=port) as url:
        yield url


async def recorded(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as http:
        requests: list[dict[str, Any]] = (await http.get(f"{url}/_test/requests")).json()[
            "requests"
        ]
    return requests


async def probe(gateway: Gateway, model: str = MODEL) -> None:
    await gateway.client(model).refresh()


def chat_prompt_tokens(messages: list[Any], tools: list[dict[str, Any]] | None = None) -> int:
    return len(tokenize(render_chat(messages, tools)))


# -- the request path ------------------------------------------------------------------


async def test_chat_whole_and_streamed_bill_the_upstreams_usage(gateway: Gateway) -> None:
    async with upstream(tokens=12) as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))

        whole = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
        assert whole.choices[0].message.content == OUTPUT_TEXT[:12]
        assert whole.model == MODEL
        assert whole.usage is not None
        assert whole.usage.prompt_tokens == chat_prompt_tokens(MESSAGES)
        assert whole.usage.completion_tokens == 12

        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            max_tokens=5,  # type: ignore[arg-type]
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == OUTPUT_TEXT[:5]
        assert chunks[-1].usage is None  # the client did not ask for usage...

        sent = await recorded(url)
        for request in sent:  # ...but the gateway always asks upstream, and streams
            assert request["body"]["model"] == "vllm-like"
            assert request["body"]["messages"] == MESSAGES
            assert request["body"]["stream"] is True
            assert request["body"]["stream_options"] == {"include_usage": True}
        await eventually(lambda: gateway.settled(2))
        rows = sorted(await gateway.rows(), key=lambda r: r.completion_tokens)
        assert [(r.model, r.status, r.completion_tokens) for r in rows] == [
            (MODEL, "completed", 5),
            (MODEL, "completed", 12),
        ]
        assert {r.prompt_tokens for r in rows} == {chat_prompt_tokens(MESSAGES)}


async def test_deltas_that_come_in_one_read_go_on_as_one(gateway: Gateway) -> None:
    """An upstream that sends a whole stream at once: its text deltas reach the client in
    fewer events than tokens, the same text, and the upstream's usage is what is billed."""
    async with upstream(tokens=12, burst=True) as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))
        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        texts = [c.choices[0].delta.content for c in chunks if c.choices]
        assert "".join(text or "" for text in texts) == OUTPUT_TEXT[:12]
        assert 0 < len([text for text in texts if text]) < 12
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

        whole = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
        assert whole.choices[0].message.content == OUTPUT_TEXT[:12]
        assert whole.usage is not None and whole.usage.completion_tokens == 12
        await eventually(lambda: gateway.settled(2))
        assert [row.completion_tokens for row in await gateway.rows()] == [12, 12]


async def test_completions_forward_text_and_token_ids(gateway: Gateway) -> None:
    async with upstream(tokens=8) as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))

        text = await sdk.completions.create(model=MODEL, prompt="Once upon", max_tokens=6)
        assert text.choices[0].text == OUTPUT_TEXT[:6]
        assert text.usage is not None and text.usage.prompt_tokens == len("Once upon")

        stream = await sdk.completions.create(
            model=MODEL, prompt=[5, 6, 7], stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == OUTPUT_TEXT[:8]
        usage = chunks[-1].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 8)

        bodies = [r["body"] for r in await recorded(url)]
        assert [b["prompt"] for b in bodies] == ["Once upon", [5, 6, 7]]
        assert all(b["stream_options"] == {"include_usage": True} for b in bodies)


async def test_a_tokenizer_disagreement_is_counted_and_billed_within_the_reservation(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway counts with the built-in model's tokenizer, the upstream one token per
    character (more): the metric shows by how much, and the ledger bills no more than the
    prompt tokens the gateway counted and reserved."""
    caplog.set_level(logging.INFO, logger="gateway.dispatch.upstream")
    async with upstream(tokens=4) as url:
        await gateway.register(url, tokenizer=str(BUILTIN_MODEL_DIR.resolve()))
        sdk = gateway.sdk(await gateway.key("acme"))
        prompt = "tokenizers rarely agree about this sentence"
        answer = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        await eventually(lambda: gateway.settled(1))
        (row,) = await gateway.rows()
        assert answer.usage is not None and answer.usage.prompt_tokens == row.prompt_tokens
        assert row.prompt_tokens < len(prompt)  # the gateway's own count, as reserved
        metrics = gateway.metrics()
        series = (
            'tollgate_upstream_usage_disagreement_tokens_count{direction="upstream_higher",'
            f'kind="prompt",model="{MODEL}"}} 1.0'
        )
        assert series in metrics
        (line,) = [r for r in caplog.records if hasattr(r, "gateway_tokens")]
        assert (line.usage_kind, line.upstream_tokens) == ("prompt", len(prompt))  # type: ignore[attr-defined]
        assert line.gateway_tokens == row.prompt_tokens  # type: ignore[attr-defined]
        assert prompt not in line.getMessage()  # counts only, never the text


async def test_usage_an_upstream_overclaims_is_billed_at_the_reservation(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """An upstream answering max_tokens 4 with a million completion (and prompt) tokens:
    the ledger bills what was reserved, the disagreement is a metric and a log line, and
    the admin API shows the upstream as suspect."""
    caplog.set_level(logging.WARNING, logger="gateway.dispatch.upstream")
    claimed = 1_000_000
    async with upstream(claimed_completion_tokens=claimed, claimed_prompt_tokens=claimed) as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))
        whole = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )  # type: ignore[call-overload]
        chunks = [chunk async for chunk in stream]
        prompt = chat_prompt_tokens(MESSAGES)
        assert whole.usage is not None
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt, 4)
        usage = chunks[-1].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (prompt, 3)
        await eventually(lambda: gateway.settled(2))
        billed = sorted((r.prompt_tokens, r.completion_tokens) for r in await gateway.rows())
        assert billed == [(prompt, 3), (prompt, 4)]

        samples = {
            (s.name, s.labels["kind"]): s.value
            for family in text_string_to_metric_families(gateway.metrics())
            for s in family.samples
            if s.name.startswith("tollgate_upstream_usage_capped")
            and s.name.endswith("_total")
            and s.labels == {"kind": s.labels["kind"], "model": MODEL, "upstream": url}
        }
        assert samples == {
            ("tollgate_upstream_usage_capped_total", "completion"): 2,
            ("tollgate_upstream_usage_capped_total", "prompt"): 2,
            ("tollgate_upstream_usage_capped_tokens_total", "completion"): 2 * claimed - 7,
            ("tollgate_upstream_usage_capped_tokens_total", "prompt"): 2 * (claimed - prompt),
        }
        lines = [r for r in caplog.records if hasattr(r, "billed_tokens")]
        assert {(r.usage_kind, r.upstream_tokens, r.billed_tokens) for r in lines} == {  # type: ignore[attr-defined]
            ("completion", claimed, 4),
            ("completion", claimed, 3),
            ("prompt", claimed, prompt),
        }
        assert {r.upstream for r in lines} == {url}  # type: ignore[attr-defined]

        admin = await gateway.admin_key()
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            reply = await http.get(
                f"/admin/api/models/{MODEL}", headers={"Authorization": f"Bearer {admin}"}
            )
        assert reply.status_code == 200
        assert reply.json()["upstreams"] == [
            {"url": url, "healthy": True, "suspect": True, "usage_overclaims": 4}
        ]


async def test_usage_past_what_was_streamed_is_billed_at_what_was_streamed(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """An upstream that streams one character and claims the whole max_tokens: billed at
    most a token per byte streamed, plus the stop string and end token it counts but does
    not send; the disagreement is logged as an overclaim."""
    caplog.set_level(logging.WARNING, logger="gateway.dispatch.upstream")
    async with upstream(tokens=1, claimed_completion_tokens=16) as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))
        plain = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16)  # type: ignore[arg-type]
        stopped = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=16,
            stop=["END"],
        )
        assert plain.choices[0].message.content == stopped.choices[0].message.content == "T"
        await eventually(lambda: gateway.settled(2))
        billed = sorted(r.completion_tokens for r in await gateway.rows())
        assert billed == [1 + 1, 1 + len("END") + 1]
        lines = [r for r in caplog.records if hasattr(r, "billed_tokens")]
        assert sorted((r.upstream_tokens, r.billed_tokens) for r in lines) == [(16, 2), (16, 5)]  # type: ignore[attr-defined]


async def test_each_tenant_gets_its_own_cache_salt(gateway: Gateway) -> None:
    async with upstream(tokens=2) as url:
        await gateway.register(url)
        for tenant in ("acme", "globex"):
            sdk = gateway.sdk(await gateway.key(tenant))
            for _ in range(2):
                await sdk.completions.create(model=MODEL, prompt="shared prefix", max_tokens=2)
        salts = [r["body"]["cache_salt"] for r in await recorded(url)]
        assert salts[0] == salts[1] and salts[2] == salts[3]
        assert salts[0] != salts[2]
        assert all(len(salt) == 64 and "acme" not in salt for salt in salts)


async def test_priority_is_sent_only_to_a_model_that_schedules_by_it(
    gateway: Gateway, settings: Settings
) -> None:
    """vLLM refuses a non-zero priority unless started with --scheduling-policy priority:
    an unconfigured model never gets one, so a tenant's priority cannot break it."""
    async with upstream(tokens=2, scheduling_policy="fcfs") as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))
        await sdk.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": 5}
        )
        assert "priority" not in (await recorded(url))[-1]["body"]


async def test_priority_goes_in_each_upstreams_convention(gateway: Gateway) -> None:
    """The gateway runs lower values first, as vLLM does; SGLang runs higher ones first,
    so it gets the negation. An interactive request (priority 0) sends none."""
    async with upstream(tokens=2) as url:
        key = await gateway.key("acme")
        for name in (VLLM, SGLANG):
            await gateway.register(url, name=name)
            for priority in (0, 3):
                await gateway.sdk(key).completions.create(
                    model=name, prompt="hi", max_tokens=2, extra_body={"priority": priority}
                )
        sent = [r["body"].get("priority") for r in await recorded(url)]
        assert sent == [None, 3, None, -3]


async def test_a_model_configured_to_share_its_prefix_cache_gets_no_salt(
    gateway: Gateway,
) -> None:
    async with upstream(tokens=2) as url:
        await gateway.register(url, name=SHARED)
        await gateway.register(url)
        for model in (SHARED, MODEL):
            sdk = gateway.sdk(await gateway.key(f"tenant-{model}"))
            await sdk.completions.create(model=model, prompt="shared prefix", max_tokens=2)
        bodies = [r["body"] for r in await recorded(url)]
        assert "cache_salt" not in bodies[0] and len(bodies[1]["cache_salt"]) == 64


# -- structured outputs and tools: the upstream's own, forwarded as sent ------------------

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# Whole definitions: the gateway counts tools as chat templates take them (a missing
# description or parameters filled in), the upstream as sent; these read the same.
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now.",
        "parameters": {"type": "object", "properties": {}},
    },
}


async def test_response_format_goes_upstream_as_sent(gateway: Gateway) -> None:
    """The upstream enforces the format (the gateway neither constrains nor checks its
    output), and the ledger is what it is for any request."""
    schema_format: Any = {
        "type": "json_schema",
        "json_schema": {
            "name": "animal",
            "schema": {"type": "object", "properties": {"animal": {"type": "string"}}},
            "strict": True,
        },
    }
    async with upstream() as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))

        whole = await sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}
        )
        assert whole.choices[0].message.content == JSON_OUTPUT
        assert whole.choices[0].finish_reason == "stop"
        assert whole.usage is not None and whole.usage.completion_tokens == len(JSON_OUTPUT)

        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=schema_format,
            stream=True,
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
            JSON_OUTPUT
        )

        response = await sdk.responses.create(
            model=MODEL, input="Say something.", text={"format": {"type": "json_object"}}
        )
        assert response.output_text == JSON_OUTPUT  # the Responses API: chat underneath

        sent = [r["body"]["response_format"] for r in await recorded(url)]
        assert sent == [{"type": "json_object"}, schema_format, {"type": "json_object"}]
        await eventually(lambda: gateway.settled(3))
        rows = await gateway.rows()
        assert [(r.status, r.completion_tokens) for r in rows] == [
            ("completed", len(JSON_OUTPUT)),
        ] * 3
        assert {r.prompt_tokens for r in rows} == {chat_prompt_tokens(MESSAGES)}


async def test_vllms_guided_extras_are_still_refused_upstream(gateway: Gateway) -> None:
    async with upstream() as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_body={"guided_regex": "[a-z]+"}
            )
        assert refused.value.body["param"] == "guided_regex"  # type: ignore[index]
        assert await recorded(url) == []


@pytest.mark.parametrize("burst", [False, True], ids=["paced", "in-one-write"])
async def test_streamed_tool_calls_are_relayed_and_billed(gateway: Gateway, burst: bool) -> None:
    """The upstream parses its own output: its `delta.tool_calls` reach the client in
    OpenAI's shape, with finish_reason tool_calls, one by one as sent even when they came
    together; the reservation counted the prompt with the tools (the upstream's
    /tokenize), and the ledger has the upstream's usage."""
    tools: Any = [WEATHER, TIME]
    async with upstream(burst=burst) as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))
        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=tools,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        deltas = [
            call
            for chunk in chunks
            for choice in chunk.choices
            for call in choice.delta.tool_calls or []
        ]
        assert deltas[0].id is not None and deltas[0].type == "function"
        assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
        arguments = "".join((d.function.arguments or "") for d in deltas if d.function)
        assert arguments == CALL_ARGUMENTS
        assert len(deltas) == 1 + len(CALL_ARGUMENTS)  # the name's, then one a token
        assert {d.index for d in deltas} == {0}
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == "tool_calls"
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)
        usage = chunks[-1].usage
        with_tools = chat_prompt_tokens(MESSAGES, tools)
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            with_tools,
            1 + len(CALL_ARGUMENTS),
        )

        (tokenized,) = [r for r in await recorded(url) if r["path"] == "/v1/chat/completions"]
        assert tokenized["body"]["tools"] == tools
        assert "tool_choice" not in tokenized["body"]  # the client sent none
        await eventually(lambda: gateway.settled(1))
        (row,) = await gateway.rows()
        assert (row.status, row.prompt_tokens, row.completion_tokens) == (
            "completed",
            with_tools,
            1 + len(CALL_ARGUMENTS),
        )
        assert "tollgate_upstream_usage_disagreement_tokens_count{" not in gateway.metrics()


async def test_a_whole_answers_tool_calls_are_put_together(gateway: Gateway) -> None:
    """The gateway always streams from the upstream: a client's whole answer has the
    call assembled from its deltas; tool_choice and parallel_tool_calls go as sent, and
    the next turn's assistant call and tool result go in OpenAI's shape."""
    async with upstream() as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))
        named: Any = {"type": "function", "function": {"name": "get_time"}}
        whole = await sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice=named,  # type: ignore[arg-type]
            parallel_tool_calls=False,
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.id.startswith("chatcmpl-tool-")
        assert (call.function.name, call.function.arguments) == ("get_time", CALL_ARGUMENTS)  # type: ignore[union-attr]

        turn: list[Any] = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
        ]
        answer = await sdk.chat.completions.create(
            model=MODEL, messages=turn, tools=[WEATHER], tool_choice="none", max_tokens=3
        )
        assert answer.choices[0].message.content == OUTPUT_TEXT[:3]
        assert answer.choices[0].message.tool_calls is None

        first, second = [r["body"] for r in await recorded(url)]
        assert (first["tool_choice"], first["parallel_tool_calls"]) == (named, False)
        assert second["tool_choice"] == "none"
        function = second["messages"][1]["tool_calls"][0]["function"]
        assert function["name"] == "get_time"
        # JSON text, as OpenAI's API has it (re-encoded: vLLM parses it for its template)
        assert json.loads(function["arguments"]) == json.loads(CALL_ARGUMENTS)
        assert second["messages"][2]["tool_call_id"] == call.id


async def test_tools_are_counted_with_a_local_template_that_knows_them(gateway: Gateway) -> None:
    """The built-in model's template renders tools: the gateway counts them locally (the
    upstream's /tokenize is not asked), so its count with tools exceeds the one without."""
    async with upstream(tokens=2) as url:
        await gateway.register(url, tokenizer=str(BUILTIN_MODEL_DIR.resolve()))
        client = gateway.client()
        assert client.local is not None and client.local.tokenizer.knows_tools
        plain = await client.tokenize_chat(MESSAGES)
        with_tools = await client.tokenize_chat(MESSAGES, [WEATHER])
        assert len(with_tools) > len(plain)
        assert [r for r in await recorded(url) if r["path"] == "/tokenize"] == []


@pytest.mark.parametrize("burst", [False, True], ids=["paced", "in-one-write"])
async def test_the_upstreams_logprobs_are_relayed(gateway: Gateway, burst: bool) -> None:
    """Chat's and completions' logprobs, streamed and whole, are the upstream's (its
    token texts: no local tokenizer is needed), asked for in each endpoint's terms; a
    stream's come one token at a time even when they came together."""
    async with upstream(tokens=4, burst=burst) as url:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))
        expected = [logprob_of(i) for i in range(4)]

        whole = await sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2
        )
        chat_logprobs = whole.choices[0].logprobs
        assert chat_logprobs is not None and chat_logprobs.content is not None
        content = chat_logprobs.content
        assert "".join(e.token for e in content) == OUTPUT_TEXT[:4]
        assert [e.logprob for e in content] == expected
        assert [t.token for t in content[0].top_logprobs] == [OUTPUT_TEXT[0], "~"]

        stream = await sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, stream=True
        )
        chunks = [c async for c in stream]
        streamed = [
            entry
            for chunk in chunks
            for choice in chunk.choices
            for entry in (choice.logprobs.content or [] if choice.logprobs else [])
        ]
        texts = [c.choices[0].delta.content for c in chunks if c.choices]
        assert [text for text in texts if text] == list(OUTPUT_TEXT[:4])
        assert [(e.token, e.logprob) for e in streamed] == list(
            zip(OUTPUT_TEXT[:4], expected, strict=True)
        )
        assert all(e.top_logprobs == [] for e in streamed)

        text = await sdk.completions.create(model=MODEL, prompt="Once", logprobs=1)
        logprobs = text.choices[0].logprobs
        assert logprobs is not None
        assert logprobs.tokens == list(OUTPUT_TEXT[:4])
        assert logprobs.token_logprobs == expected
        assert logprobs.text_offset == [0, 1, 2, 3]
        pairs = zip(OUTPUT_TEXT[:4], expected, strict=True)
        assert logprobs.top_logprobs == [{token: value} for token, value in pairs]

        bodies = [r["body"] for r in await recorded(url)]
        assert [(b.get("logprobs"), b.get("top_logprobs")) for b in bodies] == [
            (True, 2),
            (True, 0),
            (1, None),
        ]
        await eventually(lambda: gateway.settled(3))
        assert [r.completion_tokens for r in await gateway.rows()] == [4, 4, 4]


# -- cancellation ----------------------------------------------------------------------


async def test_a_disconnect_aborts_upstream_and_bills_what_was_delivered(
    gateway: Gateway,
) -> None:
    async with upstream(tokens=400, delay_ms=10) as url:
        await gateway.register(url)
        key = await gateway.key("acme")
        async with (
            httpx.AsyncClient(base_url=gateway.url) as http,
            http.stream(
                "POST",
                "/v1/completions",
                json={"model": MODEL, "prompt": "go", "max_tokens": 400, "stream": True},
                headers={"Authorization": f"Bearer {key}"},
            ) as response,
        ):
            request_id = response.headers["x-request-id"]
            await read_text_events(response, 5)  # then leaving the block disconnects

        async def aborted() -> bool:
            requests = await recorded(url)
            return bool(requests) and requests[-1]["aborted"]

        await eventually(aborted)
        await eventually(lambda: gateway.row(request_id))
        row = await gateway.row(request_id)
        assert row is not None and row.status == "cancelled"
        sent = (await recorded(url))[-1]["tokens_sent"]
        assert 5 <= row.completion_tokens <= sent < 400


# -- upstream errors ---------------------------------------------------------------------


async def test_upstream_429_and_503_pass_through_with_their_retry_after(gateway: Gateway) -> None:
    async with upstream() as url, httpx.AsyncClient() as http:
        await gateway.register(url)
        sdk = gateway.sdk(await gateway.key("acme"))
        await http.post(f"{url}/_test/fail", json={"status": 429, "retry_after": 7})
        with pytest.raises(openai.RateLimitError) as limited:
            await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert limited.value.response.headers["retry-after"] == "7"
        passed = limited.value.response.headers  # the upstream's limit, the one that refused
        assert passed["x-ratelimit-limit-requests"] == "60"
        assert passed["x-ratelimit-remaining-requests"] == "0"
        assert passed["x-ratelimit-reset-requests"] == "7s"
        assert limited.value.body["type"] == "rate_limit_error"  # type: ignore[index]

        await http.post(f"{url}/_test/fail", json={"status": 503, "retry_after": 3})
        stream = sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True)
        with pytest.raises(openai.InternalServerError) as overloaded:
            await stream
        assert overloaded.value.status_code == 503
        assert overloaded.value.response.headers["retry-after"] == "3"
        await eventually(lambda: gateway.settled(2))
        assert [r.completion_tokens for r in await gateway.rows()] == [0, 0]


async def test_an_upstream_400_keeps_its_message_and_is_not_retried(gateway: Gateway) -> None:
    """The registry's context is larger than the upstream's: the upstream's refusal (its
    message) reaches the client as a 400, and no other target is tried."""
    async with upstream(max_model_len=64) as first, upstream(max_model_len=64) as second:
        await gateway.register(first, second, context_length=4096)
        sdk = gateway.sdk(await gateway.key("acme"))
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.completions.create(model=MODEL, prompt="x" * 100, max_tokens=2)
        assert "maximum context length is 64" in refused.value.message
        assert len(await recorded(first)) + len(await recorded(second)) == 1


async def test_a_5xx_moves_to_another_target_and_alone_is_a_502(gateway: Gateway) -> None:
    async with (
        upstream(tokens=2) as failing,
        upstream(tokens=2) as healthy,
        httpx.AsyncClient() as http,
    ):
        await gateway.register(failing, healthy)
        key, tenant = await gateway.tenant("acme")
        sdk = gateway.sdk(key)
        await http.post(f"{failing}/_test/fail", json={"status": 500, "count": 1})
        prompt = preferring(gateway.client(), tenant, failing)
        answer = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert answer.choices[0].text == OUTPUT_TEXT[:2]
        assert [r["status"] for r in await recorded(failing)] == [500]
        assert len(await recorded(healthy)) == 1

    async with upstream(fail_status=500) as broken:
        await gateway.register(broken, name="broken")
        with pytest.raises(openai.APIStatusError) as failed:
            await sdk.completions.create(model="broken", prompt="hi", max_tokens=2)
        assert failed.value.status_code == 502
        assert failed.value.body["code"] == "upstream_error"  # type: ignore[index]


# -- the pool ----------------------------------------------------------------------------


def preferring(client: OpenAIUpstreamClient, tenant: str, url: str) -> list[int]:
    """A token-id prompt whose affinity, for `tenant`, is the target at `url`."""
    for first in range(1, 1000):
        prompt = [first, 2, 3]
        chosen = pick(client.targets, affinity_key(tenant, prompt))
        if chosen is not None and chosen.url == url:
            return prompt
    raise AssertionError(f"no prompt prefers {url}")


async def test_a_refused_connection_fails_over_to_the_next_target(gateway: Gateway) -> None:
    port = free_port()
    async with upstream(tokens=3) as live:
        async with upstream(port=port, tokens=3) as dying:
            await gateway.register(dying, live)
        # `dying` has stopped, but no probe has seen it: routing still believes in it.
        client = gateway.client()
        key, tenant = await gateway.tenant("acme")
        prompt = preferring(client, tenant, dying)
        answer = await gateway.sdk(key).completions.create(model=MODEL, prompt=prompt)
        assert answer.choices[0].text == OUTPUT_TEXT[:3]
        assert [r["body"]["prompt"] for r in await recorded(live)] == [prompt]
        assert not client.targets[0].healthy  # out until a probe finds it back


async def test_a_target_with_a_queue_gets_no_new_requests(gateway: Gateway) -> None:
    async with (
        upstream(tokens=200, delay_ms=20, max_num_seqs=1) as busy,
        upstream(tokens=2) as idle,
        httpx.AsyncClient() as http,
    ):
        await gateway.register(busy, idle)
        key = await gateway.key("acme")

        async def occupy() -> None:  # straight to the upstream: the gateway never sees it
            body = {"model": "vllm-like", "prompt": "long", "stream": True}
            async with http.stream("POST", f"{busy}/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

        hogs = [asyncio.create_task(occupy()) for _ in range(8)]
        try:

            async def queued() -> bool:
                text = (await http.get(f"{busy}/metrics")).text
                return 'vllm:num_requests_waiting{engine="0",model_name="vllm-like"} 7.0' in text

            await eventually(queued)
            await probe(gateway)
            assert gateway.client().targets[0].waiting == 7
            sdk = gateway.sdk(key)
            for first in range(20):
                await sdk.completions.create(model=MODEL, prompt=[first + 1, 2], max_tokens=2)
            assert len(await recorded(idle)) == 20
            assert len(await recorded(busy)) == 8  # only the ones sent straight to it
        finally:
            for hog in hogs:
                hog.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)


async def test_a_stopped_target_is_taken_out_and_probed_back_in(gateway: Gateway) -> None:
    port = free_port()
    async with upstream(tokens=2) as other:
        async with upstream(port=port, tokens=2) as flaky:
            await gateway.register(flaky, other)
        await probe(gateway)  # connection refused
        client = gateway.client()
        assert [t.healthy for t in client.targets] == [False, True]
        key, tenant = await gateway.tenant("acme")
        sdk = gateway.sdk(key)
        for first in range(6):
            await sdk.completions.create(model=MODEL, prompt=[first + 1, 9], max_tokens=2)
        assert len(await recorded(other)) == 6

        async with upstream(port=port, tokens=2) as back:
            await probe(gateway)
            assert [t.healthy for t in client.targets] == [True, True]
            prompt = preferring(client, tenant, back)
            await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            assert [r["body"]["prompt"] for r in await recorded(back)] == [prompt]


# -- both kinds in one registry ----------------------------------------------------------


async def test_a_tollgate_backend_and_an_openai_upstream_in_one_registry(
    gateway: Gateway, settings: Settings
) -> None:
    """`tollgate backend serve` behind the registry as a `tollgate` model, beside a
    vLLM-like upstream, both served by the same gateway."""
    port = free_port()
    backend = start(
        ["backend", "serve", "--port", str(port)],
        {"TOLLGATE_BACKEND_SECRET": BACKEND_SECRET, "TOLLGATE_MODEL": ""},
    )
    with running(backend):
        backend.wait_for("ready on")
        async with upstream(tokens=3) as url:
            await gateway.register(f"http://127.0.0.1:{port}", name="tiny", kind="tollgate")
            await gateway.register(url)
            sdk = gateway.sdk(await gateway.key("acme"))
            local = await sdk.completions.create(model="tiny", prompt="Return the", max_tokens=4)
            remote = await sdk.completions.create(model=MODEL, prompt="Return the", max_tokens=3)
            assert local.usage is not None and local.usage.completion_tokens == 4
            assert remote.choices[0].text == OUTPUT_TEXT[:3]
            await eventually(lambda: gateway.settled(2))
            rows = {r.model: r for r in await gateway.rows()}
            assert rows["tiny"].replica == f"http://127.0.0.1:{port}"
            assert rows[MODEL].replica == url


async def test_the_upstreams_api_key_comes_from_the_environment_and_is_never_logged(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with upstream(tokens=2, api_key="sk-upstream-secret") as url:
        await gateway.register(url, name="unset", api_key_env="TOLLGATE_UPSTREAM_KEY_MISSING")
        monkeypatch.setenv("TOLLGATE_UPSTREAM_KEY_TEST", "sk-upstream-secret")
        await gateway.register(url, api_key_env="TOLLGATE_UPSTREAM_KEY_TEST")
        sdk = gateway.sdk(await gateway.key("acme"))
        answer = await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert answer.choices[0].text == OUTPUT_TEXT[:2]
        with pytest.raises(openai.InternalServerError) as unopened:  # its variable is unset
            await sdk.completions.create(model="unset", prompt="hi", max_tokens=2)
        assert unopened.value.status_code == 503
    assert "TOLLGATE_UPSTREAM_KEY_MISSING" in caplog.text  # the operator learns why
    assert "sk-upstream-secret" not in caplog.text


async def test_a_stored_key_variable_of_another_name_is_never_sent_upstream(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A registry row stored before key variables were limited to TOLLGATE_UPSTREAM_KEY_*
    (here the gateway's own backend secret): the model is not opened, so the variable
    never goes to the upstream, and the operator's log says what to rename."""
    monkeypatch.setenv("TOLLGATE_BACKEND_SECRET", "gateway-own-secret")
    async with upstream(tokens=2) as url:
        async with gateway.sessions.begin() as session:
            session.add(
                ServedModel(
                    name="legacy",
                    kind="openai",
                    targets=[{"url": url, "weight": 1}],
                    api_key_env="TOLLGATE_BACKEND_SECRET",
                )
            )
            await PriceService(session).create("legacy", Price(1, 1, 1), utcnow(), "test")
        runtime = gateway.app.state.runtime
        runtime.recorder.prices.invalidate()
        await runtime.models.refresh()
        assert runtime.models.built("legacy") is None
        sdk = gateway.sdk(await gateway.key("acme"))
        with pytest.raises(openai.InternalServerError) as unopened:
            await sdk.completions.create(model="legacy", prompt="hi", max_tokens=2)
        assert unopened.value.status_code == 503
        assert await recorded(url) == []
    assert "TOLLGATE_BACKEND_SECRET is not named TOLLGATE_UPSTREAM_KEY_<NAME>" in caplog.text
    assert "gateway-own-secret" not in caplog.text
