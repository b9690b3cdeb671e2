"""Console sign-in: server-side sessions in an HttpOnly cookie, CSRF tokens, roles.

Every console route depends on `console` (a live session, else a redirect to sign-in).
Every state-changing route depends on `form`, which checks the session's CSRF token, and
then (gateway/console/context.py) on the role.
"""

from __future__ import annotations

import base64
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from litestar import Request, Response
from litestar.datastructures import Cookie, FormMultiDict
from litestar.di import NamedDependency
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.http.auth import audit_context
from gateway.settings import Settings
from tenants.admins import AdminService, ConsoleAdmin
from tenants.audit import Actor
from tenants.errors import InvalidInputError

SESSION_COOKIE = "tg_console"
LOGIN_CSRF_COOKIE = "tg_login_csrf"
FLASH_COOKIE = "tg_flash"
COOKIE_PATH = "/admin"
CSRF_FIELD = "csrf_token"
# The console's largest form has a dozen short fields: far bigger posts are refused before
# parsing (the router caps the body, `read_form` the fields), not parsed for seconds.
MAX_FORM_BYTES = 64 * 1024
MAX_FORM_FIELDS = 100


class SignInRequired(Exception):
    """No live session: pages redirect to the sign-in form."""


class ConsoleForbidden(Exception):
    """Signed in, but this needs the owner role (or a valid CSRF token)."""


@dataclass(frozen=True)
class Console:
    """The signed-in administrator of one request."""

    admin: ConsoleAdmin
    csrf_token: str
    token: str
    actor: Actor  # for the audit log: "console:<email>" and where the request came from

    @property
    def can_write(self) -> bool:
        return self.admin.can_write


def is_https(request: Request[Any, Any, Any]) -> bool:
    return request.url.scheme == "https"


def cookie(request: Request[Any, Any, Any], key: str, value: str, **extra: Any) -> Cookie:
    """HttpOnly, SameSite=Lax, scoped to /admin, Secure whenever the request came over TLS."""
    return Cookie(
        key=key,
        value=value,
        path=COOKIE_PATH,
        httponly=True,
        samesite="lax",
        secure=is_https(request),
        **extra,
    )


def console_actor(request: Request[Any, Any, Any], email: str) -> Actor:
    return Actor(f"console:{email}", audit_context(request))


def idle_limit(settings: Settings) -> timedelta:
    return timedelta(seconds=settings.console_idle_s)


async def provide_console(
    request: Request[Any, Any, Any],
    sessions: NamedDependency[async_sessionmaker[AsyncSession]],
    settings: NamedDependency[Settings],
) -> Console:
    token = request.cookies.get(SESSION_COOKIE)
    if not token:
        raise SignInRequired
    # Its own transaction: the session stays alive even when the action it allows fails.
    async with sessions.begin() as session:
        signed_in = await AdminService(session).resume(token, idle_limit(settings))
    if signed_in is None:
        raise SignInRequired
    admin = signed_in.admin
    return Console(
        admin=admin,
        csrf_token=signed_in.session.csrf_token,
        token=token,
        actor=console_actor(request, admin.email),
    )


def csrf_ok(expected: str, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(expected.encode(), str(given).encode())


async def read_form(request: Request[Any, Any, Any]) -> FormMultiDict:
    """The posted form; one with more than MAX_FORM_FIELDS fields is refused unparsed."""
    if (await request.body()).count(b"&") >= MAX_FORM_FIELDS:
        raise InvalidInputError(f"the form has too many fields (at most {MAX_FORM_FIELDS})")
    return await request.form()


async def provide_form(
    request: Request[Any, Any, Any], console: NamedDependency[Console]
) -> FormMultiDict:
    """The posted form, once its CSRF token matches the session's."""
    form = await read_form(request)
    if not csrf_ok(console.csrf_token, form.get(CSRF_FIELD)):
        raise ConsoleForbidden("the form's security token is missing or stale; reload the page")
    return form


def new_login_csrf() -> str:
    return secrets.token_urlsafe(32)


def encode_flash(kind: str, message: str) -> str:
    return base64.urlsafe_b64encode(f"{kind}:{message[:300]}".encode()).decode()


def decode_flash(value: str | None) -> tuple[str, str] | None:
    if not value:
        return None
    try:
        kind, _, message = base64.urlsafe_b64decode(value.encode()).decode().partition(":")
    except ValueError:
        return None
    return (kind, message) if kind in ("ok", "error") else None


def with_flash(
    request: Request[Any, Any, Any], response: Response[Any], kind: str, message: str
) -> Response[Any]:
    response.set_cookie(cookie(request, FLASH_COOKIE, encode_flash(kind, message)))
    return response
