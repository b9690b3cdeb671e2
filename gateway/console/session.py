"""Sign-in and sign-out. The sign-in form carries its own CSRF token (a cookie it must
match), so another site cannot sign a browser into an account of its choosing."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.response import Redirect
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.console.auth import (
    CSRF_FIELD,
    LOGIN_CSRF_COOKIE,
    SESSION_COOKIE,
    cookie,
    csrf_ok,
    idle_limit,
    new_login_csrf,
    read_form,
)
from gateway.console.context import ConsoleAction
from gateway.console.render import page
from gateway.http.auth import audit_context
from gateway.settings import Settings
from tenants import audit
from tenants.admins import AdminService
from tenants.audit import client_address
from tenants.sign_ins import SignInThrottle

FAILED = "console.sign_in_failed"
MAX_FAILURES = 10  # per account and source address within the window, then sign-in waits
THROTTLE = SignInThrottle(per_account=MAX_FAILURES, per_address=50, window=timedelta(minutes=15))
LOCKED_OUT = "Too many sign-in attempts; try again in 15 minutes."


def safe_next(target: str | None) -> str:
    """Only a path inside the console: never an open redirect to another site."""
    if target and target.startswith("/admin") and not target.startswith("//"):
        return target
    return "/admin"


def login_page(
    request: Request[Any, Any, Any], error: str | None = None, status_code: int = 200
) -> Response[str]:
    token = new_login_csrf()
    response = page(
        request,
        None,
        "login.html",
        status_code=status_code,
        login_csrf=token,
        next=safe_next(request.query_params.get("next")),
        error=error,
        email=request.query_params.get("email", ""),
    )
    response.set_cookie(cookie(request, LOGIN_CSRF_COOKIE, token, max_age=3600))
    return response


async def attempt(
    session: AsyncSession, request: Request[Any, Any, Any], email: str, password: str
) -> str | None:
    """A new session's token, or None; either way the audit log hears of it."""
    admin = await AdminService(session).verify(email, password)
    context = audit_context(request)
    if admin is not None:
        token = await AdminService(session).sign_in(admin)
        await audit.record(
            session,
            actor=f"console:{admin.email}",
            action="console.sign_in",
            target=f"admin:{admin.email}",
            details={"role": admin.role},
            context=context,
        )
        return token
    if await AdminService(session).find(email) is not None:
        await audit.record(
            session,
            actor=f"console:{email}",
            action=FAILED,
            target=f"admin:{email}",
            context=context,
        )
    else:  # names an attacker made up are not worth an event each
        await audit.record(
            session,
            actor="console:unknown",
            action=FAILED,
            target="admin:unknown",
            context=context,
            unless_within=timedelta(minutes=1),
        )
    return None


class SessionController(Controller):
    path = "/"

    @get("/login")
    async def login_form(self, request: Request[Any, Any, Any]) -> Response[str]:
        return login_page(request)

    @post("/login")
    async def login(
        self,
        request: Request[Any, Any, Any],
        settings: NamedDependency[Settings],
        db_session: NamedDependency[AsyncSession],
    ) -> Response[Any]:
        form = await read_form(request)
        if not csrf_ok(request.cookies.get(LOGIN_CSRF_COOKIE, ""), form.get(CSRF_FIELD)):
            return login_page(request, "The sign-in form expired; please try again.", 403)
        email = str(form.get("email", "")).strip().lower()[:254]
        address = client_address(request.client.host if request.client else None)
        admitted = await THROTTLE.admit(db_session, email, address)
        await db_session.commit()  # counted, whatever the attempt does
        if not admitted:
            return login_page(request, LOCKED_OUT, 429)
        token = await attempt(db_session, request, email, str(form.get("password", "")))
        if token is not None:  # sweep sessions and counts nobody came back to, now and then
            await THROTTLE.succeeded(db_session, email, address)
            await THROTTLE.purge(db_session)
            await AdminService(db_session).purge_idle(idle_limit(settings))
        if token is None:
            return login_page(request, "Wrong email or password.", 401)
        response = Redirect(safe_next(str(form.get("next", ""))), status_code=303)
        response.set_cookie(cookie(request, SESSION_COOKIE, token))
        response.delete_cookie(LOGIN_CSRF_COOKIE, path="/admin")
        return response

    @post("/logout")
    async def logout(self, viewer_action: NamedDependency[ConsoleAction]) -> Response[Any]:
        console = viewer_action.console
        await AdminService(viewer_action.db).sign_out(console.token)
        await audit.record(
            viewer_action.db,
            actor=console.actor.name,
            action="console.sign_out",
            target=f"admin:{console.admin.email}",
            context=console.actor.context,
        )
        response = Redirect("/admin/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/admin")
        return response
