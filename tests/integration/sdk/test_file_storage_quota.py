"""A tenant's file storage quota through the openai SDK, on SQLite and PostgreSQL: the
gateway's default (TOLLGATE_FILES_MAX_BYTES_PER_TENANT), a plan's override, deleted files
giving their room back, and concurrent uploads that cannot both take the last room."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants.limits import PlanTerms
from tenants.models import KeyRole
from tenants.services import ApiKeyService, PlanService, TenantService
from tests.conftest import migrated_postgres, migrated_sqlite, serving

DEFAULT_QUOTA = 1000  # bytes: the gateway's default in these tests
LINE = (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings"}) + "\n").encode()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return migrated_sqlite(tmp_path / "quota.db")
    return migrated_postgres()


@pytest.fixture
async def base_url(settings: Settings, engine_client: InProcessEngineClient) -> AsyncIterator[str]:
    quota = replace(settings, files_max_bytes_per_tenant=DEFAULT_QUOTA)
    async with serving(create_app(quota, engine_client=engine_client)) as url:
        yield url + "/v1"


async def _client(
    base_url: str, sessions: async_sessionmaker[AsyncSession], max_file_bytes: int | None
) -> openai.AsyncOpenAI:
    """A fresh tenant's client; on a plan capping its files at `max_file_bytes`, if given."""
    async with sessions.begin() as session:
        count = len(await TenantService(session).list())
        name, plan = f"t{count}", None
        if max_file_bytes is not None:
            plan = f"p{count}"
            await PlanService(session).create(plan, PlanTerms(max_file_bytes=max_file_bytes))
        tenant = await TenantService(session).create(name, plan)
        secret = (await ApiKeyService(session).create(tenant, "test", KeyRole.TENANT)).secret
    return openai.AsyncOpenAI(base_url=base_url, api_key=secret, max_retries=0)


def _file(size: int) -> bytes:
    """A valid batch file of about `size` bytes (whole lines)."""
    return LINE * max(1, size // len(LINE))


async def _upload(client: openai.AsyncOpenAI, content: bytes) -> str:
    stored = await client.files.create(file=("in.jsonl", content), purpose="batch")
    return str(stored.id)


async def test_the_default_quota_counts_every_kept_file_and_frees_on_delete(
    base_url: str, sessions: async_sessionmaker[AsyncSession]
) -> None:
    client = await _client(base_url, sessions, None)
    first = await _upload(client, _file(600))
    with pytest.raises(openai.BadRequestError) as full:
        await _upload(client, _file(600))
    error = full.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("file_storage_limit_exceeded", "file")
    assert full.value.response.headers["x-should-retry"] == "false"
    other = await _client(base_url, sessions, None)  # another tenant's room is its own
    await _upload(other, _file(600))
    await client.files.delete(first)
    await _upload(client, _file(600))  # the deleted file's room is back


async def test_a_plans_cap_overrides_the_default(
    base_url: str, sessions: async_sessionmaker[AsyncSession]
) -> None:
    roomy = await _client(base_url, sessions, 3 * DEFAULT_QUOTA)
    for _ in range(2):
        await _upload(roomy, _file(DEFAULT_QUOTA))  # twice the default, within the plan's
    tight = await _client(base_url, sessions, 100)
    with pytest.raises(openai.BadRequestError):
        await _upload(tight, _file(200))


async def test_concurrent_uploads_cannot_both_take_the_last_room(
    base_url: str, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """Five uploads at once, room for two: exactly two are stored."""
    client = await _client(base_url, sessions, None)
    content = _file(400)
    outcomes = await asyncio.gather(
        *(_upload(client, content) for _ in range(5)), return_exceptions=True
    )
    refused = [o for o in outcomes if isinstance(o, openai.BadRequestError)]
    assert len(refused) == 3, outcomes
    stored = (await client.files.list()).data
    assert len(stored) == 2
    assert sum(f.bytes for f in stored) <= DEFAULT_QUOTA


async def test_an_upload_that_cannot_fit_is_refused_before_its_body_is_read(
    base_url: str, sessions: async_sessionmaker[AsyncSession]
) -> None:
    """A tenant over its quota must not make the gateway take in (and spool) up to
    200 MiB each time: its declared length is answered before the body comes. The client
    sends the headers and one chunk of a 100 MiB upload, then waits for the answer."""
    client = await _client(base_url, sessions, None)
    host, port = base_url.removeprefix("http://").removesuffix("/v1").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {client.api_key}\r\n"
        "Content-Type: multipart/form-data; boundary=b\r\n"
        f"Content-Length: {100 * 2**20}\r\n\r\n"
    )
    writer.write(head.encode() + b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\n')
    await writer.drain()
    try:  # a bound on a failure (the gateway waiting for the rest), not synchronisation
        status = await asyncio.wait_for(reader.readline(), timeout=30)
    finally:
        writer.close()
    assert status.startswith(b"HTTP/1.1 400")
