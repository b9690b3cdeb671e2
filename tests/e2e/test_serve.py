"""`tollgate serve` as a subprocess on a free loopback port, driven by the `openai` client."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam
from sqlalchemy import create_engine, text

from tests.e2e.processes import TOLLGATE, free_port, running, start

pytestmark = pytest.mark.e2e


@dataclass
class Server:
    base_url: str
    admin_key: str
    model: str
    database_url: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("serve")
    port = free_port()
    env = {
        "TOLLGATE_DATA_DIR": str(data_dir),
        "TOLLGATE_DATABASE_URL": "",
        "TOLLGATE_ADMIN_KEY": "",
        "TOLLGATE_TRUSTED_PROXIES": "127.0.0.1",  # as behind a local proxy
        "TOLLGATE_MODEL": os.environ.get("TOLLGATE_TEST_MODEL", ""),  # empty: the built-in
    }
    process = start(["serve", "--port", str(port)], env)
    with running(process):
        banner = process.wait_for('"model"')  # the banner's last line, printed once listening
        admin_key = re.search(r"Admin key \(new\): (tg-\S+)", banner)
        model = re.search(r'"model": "([^"]+)"', banner)
        assert admin_key and model, banner
        yield Server(
            base_url=f"http://127.0.0.1:{port}/v1",
            admin_key=admin_key.group(1),
            model=model.group(1),
            database_url=f"sqlite:///{data_dir / 'tollgate.db'}",
        )


def _client(server: Server, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key or server.admin_key, max_retries=0)


def _usage_rows(server: Server) -> int:
    engine = create_engine(server.database_url)
    try:
        with engine.connect() as connection:
            return int(connection.execute(text("SELECT count(*) FROM usage_events")).scalar_one())
    finally:
        engine.dispose()


def test_chat_streams_and_not(server: Server) -> None:
    client = _client(server)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What does json.dumps do?"}
    ]
    before = _usage_rows(server)
    whole = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=16,
        temperature=0,
    )
    text_whole = whole.choices[0].message.content
    assert text_whole
    assert whole.usage is not None and 0 < whole.usage.completion_tokens <= 16
    stream = client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    chunks = [chunk for chunk in stream if isinstance(chunk, ChatCompletionChunk)]
    pieces = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert len([p for p in pieces if p]) > 1  # really streamed, not one blob
    assert "".join(pieces) == text_whole
    assert _usage_rows(server) == before + 2


def test_completions_and_models(server: Server) -> None:
    client = _client(server)
    assert [m.id for m in client.models.list()] == [server.model]
    completion = client.completions.create(
        model=server.model, prompt="Return the", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text
    streamed = client.completions.create(
        model=server.model, prompt="Return the", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text


def test_errors_map_to_openai_exceptions(server: Server) -> None:
    before = _usage_rows(server)
    with pytest.raises(openai.AuthenticationError):
        _client(server, "tg-AAAAAAAA_" + "x" * 43).models.list()
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).chat.completions.create(model=server.model, messages=[])
    assert info.value.body is not None
    with pytest.raises(openai.NotFoundError):
        _client(server).chat.completions.create(
            model="gpt-nothing", messages=[{"role": "user", "content": "hi"}]
        )
    assert _usage_rows(server) == before


def test_new_tenant_key_from_the_cli_works(server: Server) -> None:
    env = {**os.environ, "TOLLGATE_DATABASE_URL": server.database_url}
    tollgate = TOLLGATE
    subprocess.run([tollgate, "tenants", "create", "beta"], env=env, check=True)
    created = subprocess.run(
        [tollgate, "keys", "create", "--tenant", "beta"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    key = created.stdout.strip()
    assert key.startswith("tg-")
    reply = _client(server, key).completions.create(model=server.model, prompt="The", max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    subprocess.run([tollgate, "keys", "revoke", key.split("_")[0]], env=env, check=True)
    with pytest.raises(openai.AuthenticationError):
        _client(server, key).models.list()


def test_the_audit_log_records_the_client_behind_a_trusted_proxy(server: Server) -> None:
    """127.0.0.1 is named a trusted proxy here: the right-most untrusted X-Forwarded-For
    entry is the client; an entry left of it (which the client could forge) is not."""
    response = httpx.post(
        server.base_url.removesuffix("/v1") + "/admin/api/tenants",
        json={"name": "proxied"},
        headers={
            "Authorization": f"Bearer {server.admin_key}",
            "X-Forwarded-For": "198.51.100.9, 203.0.113.7",
        },
    )
    assert response.status_code == 201
    engine = create_engine(server.database_url)
    try:
        with engine.connect() as connection:
            ips = connection.execute(
                text("SELECT ip FROM audit_events WHERE target = 'tenant:proxied'")
            ).scalars()
            assert list(ips) == ["203.0.113.7"]
    finally:
        engine.dispose()
