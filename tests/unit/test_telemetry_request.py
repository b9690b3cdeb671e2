"""The scope outside any request is shared by every caller, so it must keep nothing."""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator

from backend import RequestOutput, SamplingParams
from gateway.api.formats import CHAT_FORMAT
from gateway.api.generation import Generation
from gateway.core.usage import Charge
from gateway.telemetry import RequestScope, current_request
from tenants.models import KeyRole
from tenants.services import Principal
from tests.unit.test_telemetry_tracing import _output


def _noted(scope: RequestScope) -> tuple[object, ...]:
    return (
        scope.tenant,
        scope.request_id,
        scope.model,
        scope.rejection,
        scope.replica,
        scope.admitted,
        scope.timeline.output_tokens,
    )


async def _outputs() -> AsyncIterator[RequestOutput]:
    yield _output(0, 2, [101.0, 101.5], finished=True)


async def test_no_value_leaks_through_the_scope_outside_requests() -> None:
    """What one caller outside any request notes (an admin route's principal, a rejection,
    a replica) never reaches the next caller outside a request."""
    principal = Principal("t-1", "acme", "k-1", KeyRole.TENANT)
    charge = Charge("req-leak", principal, "tiny", "chat.completions")
    job = Generation(charge, CHAT_FORMAT, [1, 2, 3], SamplingParams(max_tokens=4))
    first = current_request()  # no scope was set: the inert one
    untouched = _noted(first)
    first.identify(principal)
    first.describe(job, stream=True)
    first.reject("rpm")
    first.route("http://127.0.0.1:9")
    first.admitted = True
    assert [out async for out in first.dispatch(_outputs())]
    later = contextvars.Context().run(current_request)  # another request, also unscoped
    assert _noted(later) == untouched == (None, None, None, None, None, False, 0)
