"""Shared fixtures: databases built by the Alembic migrations (SQLite and PostgreSQL),
one engine on the built-in model for the whole session, and app clients."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import inspect
import json
import os
import shutil
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import psycopg
import pytest
import uvicorn
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.app import create_app, engine_config
from gateway.dispatch.engine_client import InProcessEngineClient
from gateway.settings import Settings
from tenants import db
from tenants.admins import ScryptCost, scrypt_cost_for_tests
from tenants.models import KeyRole
from tenants.services import ApiKeyService, TenantService

# Under pytest-xdist (`make test` runs one worker a core) each worker has a PostgreSQL
# database and a Redis logical database of its own: tenant ids repeat across databases,
# so workers sharing either would see each other's rows and quota keys.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...; "" when serial
POSTGRES_URL = os.environ.get(
    "TOLLGATE_TEST_DATABASE_URL",
    "postgresql+psycopg://postgres:postgres@127.0.0.1:5432/tollgate_test",
) + (f"_{WORKER}" if WORKER else "")
REDIS_URL = f"redis://127.0.0.1:6379/{int(WORKER[2:]) if WORKER else 0}"


def pytest_configure(config: pytest.Config) -> None:
    if WORKER:
        _create_database(POSTGRES_URL)


def _create_database(url: str) -> None:
    """Create a worker's database once (the set-up makes only the serial one). Where
    PostgreSQL is not up, the tests that need it fail with their own error."""
    target = make_url(url)
    with (
        contextlib.suppress(psycopg.OperationalError),
        psycopg.connect(db.libpq_url(url, database="postgres"), autocommit=True) as connection,
    ):
        exists = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (target.database,)
        ).fetchone()
        if exists is None:
            connection.execute(f'CREATE DATABASE "{target.database}"')


# The real cost (OWASP's minimum) takes ~0.3 s a hash, and the suite creates hundreds of
# administrators; tests that are about the cost set it themselves.
TEST_SCRYPT_COST = ScryptCost(n=2**12, r=8, p=1)


@pytest.fixture(scope="session", autouse=True)
def cheap_password_hashing() -> Iterator[None]:
    with scrypt_cost_for_tests(TEST_SCRYPT_COST):
        yield


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty database of each kind."""
    if request.param == "sqlite":
        return migrated_sqlite(tmp_path / "tollgate.db")
    return migrated_postgres()


def migrated_sqlite(path: Path) -> str:
    """A migrated, empty SQLite database at `path`: a copy of the one the migrations
    built at the first call (running them again for every test costs ~0.5 s each)."""
    with (
        contextlib.closing(sqlite3.connect(_migrated_sqlite_template())) as source,
        contextlib.closing(sqlite3.connect(path)) as copy,
    ):
        source.backup(copy)
    return f"sqlite:///{path}"


@functools.cache
def _migrated_sqlite_template() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="tollgate-schema-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "migrated.db"
    db.upgrade(f"sqlite:///{path}")
    return path


def migrated_postgres() -> str:
    """POSTGRES_URL, migrated and empty: the worker's database dropped (its connections
    closed) and made again from a template the migrations built at the first call, ~0.15 s
    where running them again costs ~0.5 s."""
    name = make_url(POSTGRES_URL).database
    template = _migrated_postgres_template()
    with psycopg.connect(
        db.libpq_url(POSTGRES_URL, database="postgres"), autocommit=True
    ) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        connection.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return POSTGRES_URL


@functools.cache
def _migrated_postgres_template() -> str:
    """A database beside the worker's, built by the migrations of this checkout (made
    again in every test session, so a changed migration is never skipped)."""
    target = make_url(POSTGRES_URL)
    template = f"{target.database}_template"
    with psycopg.connect(
        db.libpq_url(POSTGRES_URL, database="postgres"), autocommit=True
    ) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{template}" WITH (FORCE)')
        connection.execute(f'CREATE DATABASE "{template}"')
    db.upgrade(target.set(database=template).render_as_string(hide_password=False))
    return template


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    base = Settings.from_env({})
    return replace(base, database_url=database_url, data_dir=tmp_path / "data")


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = db.create_engine(database_url)
    yield db.session_factory(engine)
    await engine.dispose()


@pytest.fixture(scope="session")
async def engine_client() -> AsyncIterator[InProcessEngineClient]:
    """One engine on the built-in model (or TOLLGATE_TEST_MODEL), shared by every app test."""
    from backend.builtin import BUILTIN_MODEL_DIR

    model = Path(os.environ.get("TOLLGATE_TEST_MODEL") or BUILTIN_MODEL_DIR)
    client = await InProcessEngineClient.load(model, engine_config(Settings.from_env({})))
    yield client
    await client.close()


@pytest.fixture
async def client(
    settings: Settings, engine_client: InProcessEngineClient
) -> AsyncIterator[AsyncTestClient[Litestar]]:
    app = create_app(settings, engine_client=engine_client)
    async with AsyncTestClient(app=app) as test_client:
        yield test_client


@pytest.fixture
async def tenant_key(sessions: async_sessionmaker[AsyncSession]) -> str:
    """The secret of a fresh key for tenant 'acme'."""
    async with sessions.begin() as session:
        tenant = await TenantService(session).create("acme")
        created = await ApiKeyService(session).create(tenant, "test", KeyRole.TENANT)
    return created.secret


async def eventually(check: Callable[[], object], timeout_s: float = 10.0) -> None:
    """Poll a condition that another task or process makes true (bounded, never a bare sleep)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.01)


async def read_text_events(response: httpx.Response, count: int) -> None:
    """Read a completions stream until `count` of its events carried text (the caller
    leaving its `stream` block then closes the connection mid-stream)."""
    received = 0
    async for line in response.aiter_lines():
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
            received += 1
        if received == count:
            return


@contextlib.asynccontextmanager
async def serving(app: Litestar, port: int = 0) -> AsyncIterator[str]:
    """Serve `app` with a real uvicorn on loopback, in this event loop: on a free port, or
    on `port` (a server restarted where its clients expect it)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started or task.done())
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def live_server(
    settings: Settings, engine_client: InProcessEngineClient
) -> AsyncIterator[tuple[Litestar, str]]:
    app = create_app(settings, engine_client=engine_client)
    async with serving(app) as base_url:
        yield app, base_url
