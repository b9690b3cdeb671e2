"""/admin/api/audit: read and verify the audit log (admin keys only)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from litestar import Controller, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromQuery, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.admin.controllers import require_admin
from gateway.core.errors import InvalidRequest
from gateway.openapi import ADMIN, route
from gateway.openapi.shapes import AuditPage, AuditVerification
from tenants import audit
from tenants.errors import InvalidInputError
from tenants.models import parse_utc
from tenants.services import Principal, TenantService

MAX_PAGE = 1000


def parse_time(text: str | None, param: str) -> datetime | None:
    """An ISO 8601 time; without a zone it is taken as UTC."""
    if text is None:
        return None
    try:
        # In UTC: SQLite compares the stored UTC text, so other zones must be converted.
        return parse_utc(text)
    except ValueError:
        raise InvalidRequest(
            f"{param} must be an ISO 8601 time, e.g. 2026-11-29T12:00:00Z", param=param
        ) from None


class AuditController(Controller):
    path = "/admin/api/audit"
    tags = ["Admin"]
    dependencies = {"admin": Provide(require_admin)}

    @route(get, "/", AuditPage, errors=ADMIN)
    async def list_events(
        self,
        db_session: NamedDependency[AsyncSession],
        admin: NamedDependency[Principal],
        tenant: FromQuery[str | None] = None,
        action: FromQuery[str | None] = None,
        actor: FromQuery[str | None] = None,
        since: FromQuery[str | None] = None,
        until: FromQuery[str | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=MAX_PAGE)] = 100,
        cursor: Annotated[int | None, QueryParameter(ge=1)] = None,
    ) -> dict[str, Any]:
        """Newest first. `next_cursor` (when not null) fetches the next, older page."""
        tenant_id = None if tenant is None else (await TenantService(db_session).get(tenant)).id
        events = await audit.list_events(
            db_session,
            tenant_id=tenant_id,
            action=action,
            actor=actor,
            since=parse_time(since, "since"),
            until=parse_time(until, "until"),
            before_id=cursor,
            limit=limit,
        )
        more = len(events) == limit
        return {
            "data": [audit.event_view(event) for event in events],
            "next_cursor": events[-1].id if more else None,
        }

    @route(post, "/verify", AuditVerification, errors=ADMIN)
    async def verify(
        self,
        db_session: NamedDependency[AsyncSession],
        admin: NamedDependency[Principal],
        anchor: FromQuery[str | None] = None,
    ) -> dict[str, Any]:
        """Walk the whole chain; `ok` false names the first bad event and why. `anchor`
        (the `anchor` of an earlier result) also catches deletion of the newest events."""
        try:
            kept = None if anchor is None else audit.Anchor.parse(anchor)
        except InvalidInputError as exc:
            raise InvalidRequest(str(exc), param="anchor") from None
        result = await audit.verify(db_session, kept)
        return {
            "ok": result.ok,
            "events": result.events,
            "first_bad_id": result.first_bad_id,
            "reason": result.reason,
            "anchor": None if result.anchor is None else str(result.anchor),
        }
