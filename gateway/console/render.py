"""Server-side rendering of console pages (Jinja, autoescaped) and redirects with notices."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from litestar import MediaType, Request, Response
from litestar.response import Redirect

from gateway.console.auth import COOKIE_PATH, FLASH_COOKIE, Console, decode_flash, with_flash
from tenants.errors import DomainError
from tenants.models import as_utc

# web/ sits next to gateway/, in the source tree and in an installed wheel alike.
WEB_DIR = Path(__file__).resolve().parents[2] / "web"
TEMPLATES_DIR = WEB_DIR / "templates"
STATIC_DIR = WEB_DIR / "static"

# Pages never end up in shared caches, and may not be framed (clickjacking).
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
}


@cache
def environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        autoescape=select_autoescape(["html"]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["money"] = money
    env.filters["when"] = when
    env.filters["ms"] = lambda value: "-" if value is None else f"{value:,.1f} ms"
    return env


def query_text(request: Request[Any, Any, Any], name: str) -> str:
    """A query parameter, stripped; "" when absent."""
    return (request.query_params.get(name) or "").strip()


def money(micros: int | None) -> str:
    """Micro-units of currency as dollars: 1_234_567 -> "$1.234567" trimmed to cents+."""
    if micros is None:
        return "unlimited"
    text = f"{micros / 1_000_000:,.6f}".rstrip("0")
    whole, _, fraction = text.partition(".")
    return f"${whole}.{fraction.ljust(2, '0')}"


def when(moment: datetime | None) -> str:
    if moment is None:
        return "never"
    return as_utc(moment).strftime("%Y-%m-%d %H:%M:%S UTC")


def render(template: str, **context: Any) -> str:
    return environment().get_template(template).render(**context)


def page(
    request: Request[Any, Any, Any],
    console: Console | None,
    template: str,
    *,
    status_code: int = 200,
    **context: Any,
) -> Response[str]:
    flash = decode_flash(request.cookies.get(FLASH_COOKIE))
    html = render(
        template,
        me=console.admin if console else None,
        can_write=console.can_write if console else False,
        csrf_token=console.csrf_token if console else "",
        flash=flash,
        path=request.url.path,
        **context,
    )
    response = Response(
        html, status_code=status_code, media_type=MediaType.HTML, headers=SECURITY_HEADERS
    )
    if flash is not None:
        response.delete_cookie(FLASH_COOKIE, path=COOKIE_PATH)
    return response


def csv_download(text: str, filename: str) -> Response[str]:
    return Response(
        text,
        media_type="text/csv; charset=utf-8",
        headers={**SECURITY_HEADERS, "Content-Disposition": f'attachment; filename="{filename}"'},
    )


def back_to(
    request: Request[Any, Any, Any], path: str, message: str, kind: str = "ok"
) -> Response[Any]:
    """Post/redirect/get: go to `path` with a one-time notice."""
    return with_flash(request, Redirect(path, status_code=303), kind, message)


class GoBack(Exception):
    """A refused form post: the console answers it with `back_to(path, message)`."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


@contextmanager
def or_back_to(path: str) -> Iterator[None]:
    """A refused action (a DomainError) goes back to `path` with the reason. It is raised,
    not returned, so the request's transaction rolls back on its way out."""
    try:
        yield
    except DomainError as error:
        raise GoBack(path, str(error)) from error


def went_back(request: Request[Any, Any, Any], exc: GoBack) -> Response[Any]:
    """The console's exception handler for GoBack."""
    return back_to(request, exc.path, exc.message, "error")
