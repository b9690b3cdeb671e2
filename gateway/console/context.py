"""What a console handler works with, as one Litestar dependency: the request, its
database transaction and the signed-in administrator (`ConsolePage`), plus the posted
form for a state-changing route (`ConsoleAction`). Handlers ask for `ctx` (pages),
`action` (owners only, CSRF-checked) or `viewer_action` (any signed-in administrator,
CSRF-checked: signing out, verifying the audit chain)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency, Provide
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.console.auth import (
    Console,
    ConsoleForbidden,
    provide_console,
    provide_form,
)
from gateway.console.render import back_to, or_back_to, page, query_text
from gateway.dispatch.engine_client import EngineClient
from gateway.http.deps import MaybeEngine
from gateway.settings import Settings
from tenants.audit import Actor
from tenants.billing.prices import PriceBook


@dataclass(frozen=True)
class ConsolePage:
    """One console request: who is signed in, the request's database session, and the
    services the pages read."""

    request: Request[Any, Any, Any]
    db: AsyncSession
    console: Console
    settings: Settings
    engine_client: EngineClient | None  # None until the start has attached the engine
    prices: PriceBook

    @property
    def actor(self) -> Actor:
        """The administrator, as the audit log names them."""
        return self.console.actor

    def query(self, name: str) -> str:
        """A query parameter, stripped; "" when absent."""
        return query_text(self.request, name)

    def render(self, template: str, *, status_code: int = 200, **context: Any) -> Response[str]:
        return page(self.request, self.console, template, status_code=status_code, **context)


@dataclass(frozen=True)
class ConsoleAction(ConsolePage):
    """A form post whose CSRF token matched the session's."""

    form: FormMultiDict

    def field(self, name: str) -> str:
        """A form field, stripped; "" when absent."""
        return str(self.form.get(name, "")).strip()

    def back(self, path: str, message: str, kind: str = "ok") -> Response[Any]:
        """Post/redirect/get: go to `path` with a one-time notice."""
        return back_to(self.request, path, message, kind)

    async def remove(self, path: str, remove: Callable[[str], Awaitable[object]]) -> Response[Any]:
        """Remove what the form's `name` field names, then back to `path` saying so (or
        with the reason it was refused)."""
        name = self.field("name")
        with or_back_to(path):
            await remove(name)
        return self.back(path, f"Removed {name}.")


def provide_page(
    request: Request[Any, Any, Any],
    db_session: NamedDependency[AsyncSession],
    console: NamedDependency[Console],
    settings: NamedDependency[Settings],
    engine_client: MaybeEngine,
    prices: NamedDependency[PriceBook],
) -> ConsolePage:
    return ConsolePage(request, db_session, console, settings, engine_client, prices)


def provide_action(
    ctx: NamedDependency[ConsolePage], form: NamedDependency[FormMultiDict]
) -> ConsoleAction:
    return ConsoleAction(**vars(ctx), form=form)


def provide_owner_action(viewer_action: NamedDependency[ConsoleAction]) -> ConsoleAction:
    """The CSRF token is checked first (by `form`), then the role: a forged cross-site
    post is refused whoever is signed in."""
    if not viewer_action.console.can_write:
        raise ConsoleForbidden("viewers cannot change anything; ask an owner")
    return viewer_action


# The console router's; each is resolved only by the handlers that ask for it (the
# sign-in form needs no session, a page never reads a form).
CONSOLE_DEPENDENCIES = {
    "console": Provide(provide_console),
    "form": Provide(provide_form),
    "ctx": Provide(provide_page, sync_to_thread=False),
    "viewer_action": Provide(provide_action, sync_to_thread=False),
    "action": Provide(provide_owner_action, sync_to_thread=False),
}
