"""Fixtures for tests of one API with the official `openai` client against a real server:
SQLite only (the ledger is tested on both databases elsewhere)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from gateway.app import create_app
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants import db
from tests.conftest import serving


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'sdk.db'}"
    db.upgrade(url)
    return url


@pytest.fixture
async def base_url(settings: Settings, engine_client: InProcessEngineClient) -> AsyncIterator[str]:
    async with serving(create_app(settings, engine_client=engine_client)) as url:
        yield url + "/v1"


@pytest.fixture
def client(base_url: str, tenant_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=tenant_key, max_retries=0)
