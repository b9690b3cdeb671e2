"""How the app answers each kind of error: by class, nearest in the MRO, so a subclass
keeps its meaning and only the errors that mean "your request" are a 4xx."""

from __future__ import annotations

from typing import Any

import pytest
from litestar import Litestar, get
from litestar.params import FromPath
from litestar.testing import AsyncTestClient

from backend.errors import InvalidParameterError
from gateway.http.errors import exception_handlers
from tenants.errors import ConflictError, NotFoundError
from tenants.quota import StoreUnavailableError


class WidgetMissing(NotFoundError):
    """A domain error the gateway's table does not name, below one it does."""


class WidgetTaken(ConflictError):
    pass


FAILURES: dict[str, Exception] = {
    "missing": WidgetMissing("no widget w1"),
    "taken": WidgetTaken("widget w1 is taken"),
    "defect": ValueError("temperature must be a number, secret prompt text"),
    "engine-param": InvalidParameterError("top_p must be in (0, 1]", "top_p"),
    "quota-store": StoreUnavailableError("redis at 10.0.0.7 refused"),
}


@get("/fail/{name:str}")
async def fail(name: FromPath[str]) -> None:
    raise FAILURES[name]


async def _error(name: str) -> tuple[int, dict[str, Any]]:
    app = Litestar([fail], exception_handlers=exception_handlers(), logging_config=None)
    async with AsyncTestClient(app=app) as client:
        response = await client.get(f"/fail/{name}")
    return response.status_code, response.json()["error"]


async def test_a_subclass_of_a_mapped_domain_error_keeps_its_status() -> None:
    status, error = await _error("missing")
    assert (status, error["type"], error["message"]) == (404, "not_found_error", "no widget w1")
    status, error = await _error("taken")
    assert (status, error["type"]) == (409, "conflict_error")


@pytest.mark.parametrize("name", ["defect", "engine-param", "quota-store"])
async def test_errors_that_do_not_mean_a_bad_request_are_a_500_that_echoes_nothing(
    name: str,
) -> None:
    """A ValueError from a defect (or an engine refusal that no engine client translated,
    or a quota store outage nobody caught) is ours: 500, and its text stays in the log."""
    status, error = await _error(name)
    assert (status, error["code"], error["param"]) == (500, "internal_error", None)
    assert error["message"] == "internal error"
