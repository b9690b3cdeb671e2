"""The model registry: which model names the gateway serves, and from where.

A model is either `tollgate` (Tollgate backend replicas, `tollgate backend serve`) or
`openai` (any OpenAI-compatible server: vLLM, SGLang, TGI, a hosted API). Several targets
form a pool. An upstream's API key is never stored: only the name of the environment
variable that holds it on the gateway's machines, which must start with
UPSTREAM_KEY_PREFIX: the gateway sends that variable to the model's targets (as a bearer
token, on every request and probe), so no other variable, and none of the gateway's own
secrets (TOLLGATE_DATABASE_URL, TOLLGATE_BACKEND_SECRET, ...), can be named.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import JSON, DateTime, Integer, String, Text, select
from sqlalchemy.orm import Mapped, mapped_column

from tenants.errors import ConflictError, InvalidInputError
from tenants.models import Base, new_id, utcnow
from tenants.named import ByName

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")  # OpenAI-style model ids
UPSTREAM_KEY_PREFIX = "TOLLGATE_UPSTREAM_KEY_"
_ENV_VAR = re.compile(rf"^{UPSTREAM_KEY_PREFIX}[A-Z0-9_]{{1,100}}$")
MAX_TARGETS = 64
MAX_WEIGHT = 1000
MAX_CONTEXT = 10_000_000


class ModelKind(enum.StrEnum):
    TOLLGATE = "tollgate"  # Tollgate backend replicas
    OPENAI = "openai"  # an OpenAI-compatible server


class ServedModel(Base):
    __tablename__ = "served_models"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    targets: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    tokenizer: Mapped[str | None] = mapped_column(Text)
    upstream_model: Mapped[str | None] = mapped_column(String(256))
    api_key_env: Mapped[str | None] = mapped_column(String(128))
    context_length: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


@dataclass(frozen=True)
class Target:
    url: str
    weight: int = 1

    @classmethod
    def parse(cls, text: str) -> Target:
        """`URL` or `URL=WEIGHT`, as the CLI and the console take a target."""
        url, _, weight = text.rpartition("=") if "=" in text else (text, "", "1")
        if not (weight.isascii() and weight.isdigit()):
            raise InvalidInputError(f"a target weight must be a whole number, not {weight!r}")
        return cls(url.strip(), int(weight))


@dataclass(frozen=True)
class ModelSpec:
    """What an operator says about a model; checked before it is stored."""

    name: str
    kind: ModelKind
    targets: tuple[Target, ...]
    tokenizer: str | None = None
    upstream_model: str | None = None
    api_key_env: str | None = None
    context_length: int | None = None

    def checked(self) -> ModelSpec:
        _check_name(self.name)
        if not self.targets:
            raise InvalidInputError("a model needs at least one target URL")
        if len(self.targets) > MAX_TARGETS:
            raise InvalidInputError(f"a model has at most {MAX_TARGETS} targets")
        urls = [_check_target(t) for t in self.targets]
        if len(set(urls)) != len(urls):
            raise InvalidInputError("a target URL is listed twice")
        if self.api_key_env is not None:
            check_api_key_env(self.api_key_env)
        if self.context_length is not None and not 1 <= self.context_length <= MAX_CONTEXT:
            raise InvalidInputError(f"context length must be 1..{MAX_CONTEXT}")
        if self.tokenizer is not None:
            _check_tokenizer(self.tokenizer)
        return self


EDITABLE = frozenset(f.name for f in fields(ModelSpec)) - {"name"}


def spec_of(row: ServedModel) -> ModelSpec:
    return ModelSpec(
        name=row.name,
        kind=ModelKind(row.kind),
        targets=tuple(Target(t["url"], int(t.get("weight", 1))) for t in row.targets),
        tokenizer=row.tokenizer,
        upstream_model=row.upstream_model,
        api_key_env=row.api_key_env,
        context_length=row.context_length,
    )


def model_view(row: ServedModel) -> dict[str, Any]:
    """A model as the admin API and the CLI show it (never an API key: only its variable)."""
    return {
        "name": row.name,
        "kind": row.kind,
        "targets": list(row.targets),
        "tokenizer": row.tokenizer,
        "upstream_model": row.upstream_model,
        "api_key_env": row.api_key_env,
        "context_length": row.context_length,
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
    }


def is_upstream_key_env(name: str) -> bool:
    """Only a variable named for the purpose may be sent to an upstream."""
    return _ENV_VAR.match(name) is not None


def check_api_key_env(name: str) -> None:
    """The value is not echoed: it may be a key given by mistake."""
    if not is_upstream_key_env(name):
        raise InvalidInputError(
            f"the api key variable must be an environment variable named "
            f"{UPSTREAM_KEY_PREFIX}<NAME> (A-Z, 0-9, _), not the key itself: only such "
            "variables are sent to upstreams, never the gateway's own settings or secrets",
            param="api_key_env",
        )


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise InvalidInputError(
            "model name must be 1-128 characters of letters, digits and . _ : / @ + -, "
            "starting with a letter or digit"
        )


def _check_target(target: Target) -> str:
    parts = urlsplit(target.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInputError(f"target {target.url[:200]!r} must be an http(s) URL")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise InvalidInputError(
            f"target {target.url[:200]!r} must not carry a query, fragment or credentials "
            "(use --api-key-env for a key)"
        )
    if not 1 <= target.weight <= MAX_WEIGHT:
        raise InvalidInputError(f"target weight must be 1..{MAX_WEIGHT}")
    return target.url.rstrip("/")


def _check_tokenizer(folder: str) -> None:
    path = Path(folder)
    if not path.is_absolute():
        raise InvalidInputError("tokenizer must be an absolute folder path")
    if not (path / "tokenizer.json").is_file():
        raise InvalidInputError(f"tokenizer folder {folder!r} has no tokenizer.json")


class ModelService(ByName[ServedModel]):
    """Adding, changing and removing served models, audited in the caller's transaction."""

    table, what = ServedModel, "model"

    async def add(self, spec: ModelSpec) -> ServedModel:
        spec = spec.checked()
        if await self.find(spec.name) is not None:
            raise ConflictError(f"model {spec.name!r} already exists")
        from tenants.adapters import LoRAAdapter  # here: that module imports this one

        taken = select(LoRAAdapter.id).where(LoRAAdapter.name == spec.name)
        if await self.session.scalar(taken) is not None:  # the model would hide the adapter
            raise ConflictError(f"{spec.name!r} is a tenant's LoRA adapter")
        row = ServedModel(name=spec.name)
        _store(row, spec)
        self.session.add(row)
        await self.session.flush()
        await self._audit("model.add", f"model:{row.name}", None, **model_view(row))
        return row

    async def update(self, name: str, **changes: Any) -> ServedModel:
        """Change some fields of a model (the others stay): `targets`, `tokenizer`, ..."""
        row = await self.get(name)
        before = model_view(row)
        fixed = set(changes) - EDITABLE
        if fixed:
            raise InvalidInputError(f"cannot change {', '.join(sorted(fixed))}")
        spec = replace(spec_of(row), **changes).checked()
        _store(row, spec)
        row.updated_at = utcnow()
        await self.session.flush()
        after = model_view(row)
        changed = [k for k in after if before[k] != after[k] and k != "updated_at"]
        diff = {k: [before[k], after[k]] for k in changed}
        await self._audit("model.update", f"model:{row.name}", None, changes=diff)
        return row

    async def remove(self, name: str) -> None:
        row = await self.get(name)
        await self.session.delete(row)
        await self.session.flush()
        await self._audit("model.remove", f"model:{row.name}", None)


def _store(row: ServedModel, spec: ModelSpec) -> None:
    row.kind = spec.kind.value
    row.targets = [{"url": t.url.rstrip("/"), "weight": t.weight} for t in spec.targets]
    row.tokenizer = spec.tokenizer
    row.upstream_model = spec.upstream_model
    row.api_key_env = spec.api_key_env
    row.context_length = spec.context_length
