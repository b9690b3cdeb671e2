"""The admin console: server-rendered pages under /admin, signed in with a session cookie."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from litestar import Request, Response, Router
from litestar.response import Redirect
from litestar.static_files import create_static_files_router

from gateway.console.actions import ActionsController
from gateway.console.adapters import AdaptersController
from gateway.console.auth import MAX_FORM_BYTES, ConsoleForbidden, SignInRequired
from gateway.console.batches import BatchesController
from gateway.console.capacity import CapacityController
from gateway.console.context import CONSOLE_DEPENDENCIES
from gateway.console.ledger import LedgerController
from gateway.console.models import ModelsController
from gateway.console.pages import PagesController
from gateway.console.render import STATIC_DIR, GoBack, page, went_back
from gateway.console.session import SessionController
from tenants.errors import DomainError, NotFoundError


def _to_sign_in(request: Request[Any, Any, Any], _: Exception) -> Response[Any]:
    target = request.url.path if request.method == "GET" else "/admin"
    return Redirect(f"/admin/login?next={quote(target)}", status_code=303)


def _forbidden(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    return page(request, None, "error.html", status_code=403, title="Not allowed", message=str(exc))


def _domain_error(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    status = 404 if isinstance(exc, NotFoundError) else 400
    title = "Not found" if status == 404 else "Cannot do that"
    return page(request, None, "error.html", status_code=status, title=title, message=str(exc))


def console_router() -> Router:
    return Router(
        path="/admin",
        route_handlers=[
            SessionController,
            PagesController,
            ActionsController,
            LedgerController,
            CapacityController,
            ModelsController,
            AdaptersController,
            BatchesController,
            create_static_files_router(path="/static", directories=[STATIC_DIR]),
        ],
        dependencies=CONSOLE_DEPENDENCIES,
        request_max_body_size=MAX_FORM_BYTES,  # 413 before a byte past it is read
        include_in_schema=False,  # HTML pages and forms, not an API
        exception_handlers={
            SignInRequired: _to_sign_in,
            ConsoleForbidden: _forbidden,
            DomainError: _domain_error,
            GoBack: went_back,
        },
    )
