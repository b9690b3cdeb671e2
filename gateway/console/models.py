"""The console's Models page: the registry's models next to the default entry, with
whether each has a price, and (owners) a form to add one and a button to remove one.
The same ModelService as the admin API and the CLI, audited as the administrator."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency, Provide
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.console.auth import Console, provide_console, provide_form, provide_owner_form
from gateway.console.render import back_to, or_back_to, page
from gateway.runtime import Runtime
from tenants.billing.prices import ANY_MODEL, PriceService
from tenants.errors import InvalidInputError
from tenants.registry import ModelKind, ModelService, ModelSpec, Target

HERE = "/admin/models"


def _text(form: FormMultiDict, name: str) -> str | None:
    return str(form.get(name, "")).strip() or None


def spec_from(form: FormMultiDict) -> ModelSpec:
    """The add form: targets one per line (URL or URL=weight); blank optional fields unset."""
    try:
        kind = ModelKind(_text(form, "kind") or "")
    except ValueError:
        raise InvalidInputError("kind must be tollgate or openai") from None
    lines = str(form.get("targets", "")).splitlines()
    context = _text(form, "context_length")
    if context is not None and not (context.isascii() and context.isdigit()):
        raise InvalidInputError("context length must be a whole number of tokens, or blank")
    return ModelSpec(
        name=_text(form, "name") or "",
        kind=kind,
        targets=tuple(Target.parse(line) for line in lines if line.strip()),
        tokenizer=_text(form, "tokenizer"),
        upstream_model=_text(form, "upstream_model"),
        api_key_env=_text(form, "api_key_env"),
        context_length=int(context) if context is not None else None,
    )


class ModelsController(Controller):
    path = "/models"
    dependencies = {  # the form ones are resolved only by the posts that ask for them
        "console": Provide(provide_console),
        "form": Provide(provide_form),
        "owner_form": Provide(provide_owner_form),
    }

    @get("/")
    async def models(
        self,
        request: Request[Any, Any, Any],
        runtime: NamedDependency[Runtime],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
    ) -> Response[str]:
        priced = {version.model for version in await PriceService(db_session).list()}
        return page(
            request,
            console,
            "models.html",
            title="Models",
            models=await ModelService(db_session).list(),
            priced=priced,
            any_priced=ANY_MODEL in priced,
            default=runtime.engine_client.model_name if runtime.engine_client else None,
        )

    @post("/")
    async def add_model(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
        owner_form: NamedDependency[FormMultiDict],
    ) -> Response[Any]:
        with or_back_to(HERE):
            row = await ModelService(db_session, console.actor).add(spec_from(owner_form))
        return back_to(request, HERE, f"Added {row.name}; every gateway serves it within seconds.")

    @post("/remove")
    async def remove_model(
        self,
        request: Request[Any, Any, Any],
        db_session: NamedDependency[AsyncSession],
        console: NamedDependency[Console],
        owner_form: NamedDependency[FormMultiDict],
    ) -> Response[Any]:
        name = _text(owner_form, "name") or ""
        with or_back_to(HERE):
            await ModelService(db_session, console.actor).remove(name)
        return back_to(request, HERE, f"Removed {name}.")
