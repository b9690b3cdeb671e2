"""Console sign-in throttling over real HTTP (uvicorn on loopback, which believes the
X-Forwarded-For of its loopback peer, so each test can speak from several addresses)."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from datetime import timedelta

import httpx
import pytest
from litestar import Litestar
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.console.session import MAX_FAILURES
from tenants import audit
from tenants.admins import AdminService
from tenants.models import utcnow
from tenants.sign_ins import SignInThrottle

OWNER, PASSWORD = "owner@example.com", "correct horse battery"
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


@pytest.fixture
async def console(
    live_server: tuple[Litestar, str], sessions: async_sessionmaker[AsyncSession]
) -> httpx.AsyncClient:
    async with sessions.begin() as session:
        await AdminService(session).create(OWNER, "owner", PASSWORD)
    return httpx.AsyncClient(base_url=live_server[1], follow_redirects=False, timeout=60)


async def login_token(client: httpx.AsyncClient) -> str:
    """A sign-in form's CSRF token, which is also its cookie's value."""
    match = CSRF.search((await client.get("/admin/login")).text)
    assert match is not None
    client.cookies.clear()  # each attempt below sends the form's cookie itself
    return match.group(1)


async def sign_in(
    client: httpx.AsyncClient, token: str, email: str, password: str, address: str
) -> httpx.Response:
    answer = await client.post(
        "/admin/login",
        data={"csrf_token": token, "email": email, "password": password},
        headers={"X-Forwarded-For": address, "Cookie": f"tg_login_csrf={token}"},
    )
    client.cookies.clear()
    return answer


async def failures(sessions: async_sessionmaker[AsyncSession]) -> int:
    async with sessions() as session:
        return len(await audit.list_events(session, action="console.sign_in_failed"))


async def test_concurrent_wrong_passwords_get_at_most_the_limit_of_guesses(
    console: httpx.AsyncClient, sessions: async_sessionmaker[AsyncSession]
) -> None:
    async with console:
        token = await login_token(console)
        answers = await asyncio.gather(
            *(sign_in(console, token, OWNER, f"guess {n}", "198.51.100.1") for n in range(40))
        )
    statuses = Counter(answer.status_code for answer in answers)
    assert set(statuses) <= {401, 429}, statuses
    assert statuses[401] <= MAX_FAILURES
    assert statuses[429] >= 40 - MAX_FAILURES
    assert await failures(sessions) == statuses[401]  # a refused attempt checks no password


async def test_a_locked_account_still_signs_in_from_another_address(
    console: httpx.AsyncClient,
) -> None:
    async with console:
        token = await login_token(console)
        guesses = [
            await sign_in(console, token, OWNER, f"guess {n}", "198.51.100.1")
            for n in range(MAX_FAILURES)
        ]
        assert [guess.status_code for guess in guesses] == [401] * MAX_FAILURES
        assert (await sign_in(console, token, OWNER, PASSWORD, "198.51.100.1")).status_code == 429
        assert (await sign_in(console, token, OWNER, PASSWORD, "198.51.100.2")).status_code == 303


async def test_unknown_and_known_accounts_are_answered_alike(
    console: httpx.AsyncClient,
) -> None:
    async def answers(email: str, address: str) -> list[tuple[int, str]]:
        seen = []
        for n in range(MAX_FAILURES + 1):
            answer = await sign_in(console, token, email, f"guess {n}", address)
            seen.append((answer.status_code, CSRF.sub("", answer.text)))
        return seen

    async with console:
        token = await login_token(console)
        known = await answers(OWNER, "198.51.100.1")
        unknown = await answers("nobody@example.com", "198.51.100.2")
    assert [status for status, _ in known] == [401] * MAX_FAILURES + [429]
    assert known == unknown


async def test_an_address_trying_many_accounts_waits_until_its_window_ends(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    throttle = SignInThrottle(per_account=2, per_address=3, window=timedelta(minutes=15))
    start, later = utcnow(), utcnow() + timedelta(minutes=16)
    guesser, other = "198.51.100.1", "198.51.100.2"
    async with sessions.begin() as session:
        tries = [await throttle.admit(session, f"u{n}@x.example", guesser, start) for n in range(4)]
        assert tries == [True, True, True, False]
        assert await throttle.admit(session, "u0@x.example", other, start)
        assert await throttle.admit(session, "u9@x.example", guesser, later)  # a new window
        # u0..u2 from the guesser, and the other address with its u0: their windows ended.
        assert await throttle.purge(session, later) == 5


async def test_sign_ins_clear_their_count_and_spend_none_of_the_addresss(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    throttle, address = SignInThrottle(per_account=2, per_address=3), "198.51.100.1"
    async with sessions.begin() as session:
        for _ in range(5):  # signing in again and again from one address
            assert await throttle.admit(session, OWNER, address)
            await throttle.succeeded(session, OWNER, address)
        tries = [await throttle.admit(session, OWNER, address) for _ in range(3)]
        assert tries == [True, True, False]  # the account's limit from this address
        await throttle.succeeded(session, OWNER, address)  # a right password at last
        assert await throttle.admit(session, OWNER, address)
        assert not await throttle.admit(session, "u0@x.example", address)  # address: 4 > 3
