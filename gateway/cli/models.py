"""`tollgate models …`: the model registry (add, update, list, remove), audited as the CLI
user. Every gateway replica picks a change up within a few seconds."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.cli.support import actor, command, group, in_session, print_views, remove_served
from gateway.settings import Settings
from tenants.billing.prices import ANY_MODEL, PriceService
from tenants.errors import InvalidInputError
from tenants.registry import ModelKind, ModelService, ModelSpec, ServedModel, Target, model_view

CLEAR = "none"  # `update --tokenizer none`: the field goes back to unset
OPTIONAL = {  # flag dest -> the ModelSpec field it sets
    "tokenizer": "tokenizer",
    "upstream_model": "upstream_model",
    "api_key_env": "api_key_env",
    "context": "context_length",
}


def add_commands(commands: Any) -> None:
    models = group(commands, "models", "the model registry")
    add = command(models, "add", "serve a model from Tollgate replicas or an upstream", _add)
    add.add_argument("name")
    _model_flags(add, kind_required=True)
    update = command(
        models, "update", f"change a model (flags not given stay; '{CLEAR}' clears one)", _update
    )
    update.add_argument("name")
    _model_flags(update, kind_required=False)
    listing = command(models, "list", "the registry's models", _list)
    listing.add_argument("--json", action="store_true", help="as JSON")
    command(models, "remove", "stop serving a model", _remove).add_argument("name")


def _model_flags(parser: argparse.ArgumentParser, *, kind_required: bool) -> None:
    add = parser.add_argument
    add("--kind", choices=[k.value for k in ModelKind], required=kind_required)
    add(
        "--target",
        dest="targets",
        action="append",
        metavar="URL[=WEIGHT]",
        required=kind_required,
        help="a replica or upstream base URL; repeat for a pool",
    )
    add("--weight", dest="weights", action="append", help="a weight per --target, in order")
    add("--tokenizer", help="a local Hugging Face tokenizer folder (default: the target's)")
    add("--upstream-model", help="the model's name at the upstream (default: NAME)")
    add(
        "--api-key-env",
        help="the variable holding the upstream's API key: TOLLGATE_UPSTREAM_KEY_<NAME>",
    )
    add("--context", help="context length in tokens (default: learnt from a target)")


def _add(settings: Settings, args: argparse.Namespace) -> int:
    spec = ModelSpec(
        name=args.name,
        kind=ModelKind(args.kind),
        targets=_targets(args.targets, args.weights),
        **{field: _optional(args, dest) for dest, field in OPTIONAL.items()},
    )

    return _change(settings, "added", lambda service: service.add(spec))


def _update(settings: Settings, args: argparse.Namespace) -> int:
    changes: dict[str, Any] = {
        field: _optional(args, dest)
        for dest, field in OPTIONAL.items()
        if getattr(args, dest) is not None
    }
    if args.kind is not None:
        changes["kind"] = ModelKind(args.kind)
    if args.targets is not None:
        changes["targets"] = _targets(args.targets, args.weights)
    elif args.weights is not None:
        raise InvalidInputError("--weight goes with the --target flags it weighs")
    if not changes:
        raise InvalidInputError("nothing to change: give at least one flag")

    return _change(settings, "updated", lambda service: service.update(args.name, **changes))


def _change(
    settings: Settings, done: str, change: Callable[[ModelService], Awaitable[ServedModel]]
) -> int:
    """Apply one audited change as the CLI's user; print the model and whether it is priced."""

    async def work(session: AsyncSession) -> tuple[dict[str, Any], bool]:
        view = model_view(await change(ModelService(session, actor())))
        return view, await _priced(session, view["name"])

    view, priced = in_session(settings, work)
    print(f"{done} {_row(view)}")
    _note(view["name"], priced)
    return 0


def _list(settings: Settings, args: argparse.Namespace) -> int:
    async def work(session: AsyncSession) -> list[dict[str, Any]]:
        return [model_view(row) for row in await ModelService(session).list()]

    header = "NAME\tKIND\tTARGETS\tCONTEXT\tTOKENIZER\tUPSTREAM MODEL\tAPI KEY VARIABLE"
    return print_views(in_session(settings, work), header, _row, args.json)


def _remove(settings: Settings, args: argparse.Namespace) -> int:
    return remove_served(settings, ModelService, args.name)


def _targets(given: list[str], weights: list[str] | None) -> tuple[Target, ...]:
    """`--target URL=3`, or `--target URL --weight 3` (one weight per target, in order)."""
    if weights is not None and len(weights) != len(given):
        raise InvalidInputError(f"{len(weights)} --weight for {len(given)} --target: one each")
    targets = [Target.parse(text) for text in given]
    if weights is not None:
        targets = [Target.parse(f"{t.url}={w}") for t, w in zip(targets, weights, strict=True)]
    return tuple(targets)


def _optional(args: argparse.Namespace, dest: str) -> Any:
    value = getattr(args, dest)
    if value is None or value.lower() == CLEAR:
        return None
    return _whole(value, "--context") if dest == "context" else value


def _whole(text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise InvalidInputError(f"{what} must be a whole number, not {text!r}")
    return int(text)


async def _priced(session: AsyncSession, name: str) -> bool:
    prices = PriceService(session)
    return bool(await prices.list(name) or await prices.list(ANY_MODEL))


def _note(name: str, priced: bool) -> None:
    print("(every gateway serves the change within a few seconds)")
    if not priced:
        print(
            f"note: {name} has no price, so its requests are refused until one is set: "
            f"tollgate prices set --model {name} --input … --cached-input … --output …"
        )


def _row(view: dict[str, Any]) -> str:
    targets = ",".join(f"{t['url']}={t['weight']}" for t in view["targets"])
    optional = ("context_length", "tokenizer", "upstream_model", "api_key_env")
    return "\t".join(
        [view["name"], view["kind"], targets, *(str(view[k] or "-") for k in optional)]
    )
