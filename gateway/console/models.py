"""The console's Models page: the registry's models next to the default entry, with
whether each has a price, and (owners) a form to add one and a button to remove one.
The same ModelService as the admin API and the CLI, audited as the administrator."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get, post
from litestar.datastructures import FormMultiDict
from litestar.di import NamedDependency

from gateway.console.context import ConsoleAction, ConsolePage
from gateway.console.render import or_back_to
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

    @get("/")
    async def models(self, ctx: NamedDependency[ConsolePage]) -> Response[str]:
        client = ctx.engine_client
        priced = {version.model for version in await PriceService(ctx.db).list()}
        return ctx.render(
            "models.html",
            title="Models",
            models=await ModelService(ctx.db).list(),
            priced=priced,
            any_priced=ANY_MODEL in priced,
            default=client.model_name if client else None,
        )

    @post("/")
    async def add_model(self, action: NamedDependency[ConsoleAction]) -> Response[Any]:
        with or_back_to(HERE):
            row = await ModelService(action.db, action.actor).add(spec_from(action.form))
        return action.back(HERE, f"Added {row.name}; every gateway serves it within seconds.")

    @post("/remove")
    async def remove_model(self, action: NamedDependency[ConsoleAction]) -> Response[Any]:
        return await action.remove(HERE, ModelService(action.db, action.actor).remove)
