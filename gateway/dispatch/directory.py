"""Which client serves each model name: the default entry (the in-process engine, or the
replicas of TOLLGATE_BACKENDS) and the registry's models. Every gateway replica re-reads
the registry every `refresh_s` seconds, so adding, changing or removing a model takes
effect everywhere within a few seconds, without a restart. The tenants' LoRA adapters are
re-read with it: a tenant names its own adapter in `model` and is served by the adapter's
base model; to every other tenant the name is a model that does not exist."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.core.errors import ApiError, EngineUnavailable, NotFound
from gateway.core.tasks import Periodic
from gateway.dispatch.engine_client import EngineClient
from tenants.adapters import Adapter, AdapterService
from tenants.registry import ModelService, ModelSpec, spec_of

log = logging.getLogger(__name__)

Builder = Callable[[ModelSpec], Awaitable[EngineClient]]
REFRESH_S = 2.0


class ModelDirectory:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        build: Builder,
        default: EngineClient | None = None,
        default_opened_at: int = 0,
    ) -> None:
        self.sessions = sessions
        self.build = build
        self.default = default
        self.default_opened_at = default_opened_at  # when the default engine was attached
        self._specs: dict[str, ModelSpec] = {}  # what the registry says
        self._clients: dict[str, EngineClient] = {}  # what is built of it
        self._opened: dict[str, int] = {}  # when each client opened (unix seconds)
        self._adapters: dict[str, Adapter] = {}  # every tenant's, by name

    def get(self, name: str) -> EngineClient:
        """The client for `name`; 404 when no such model is served, 503 while its client
        cannot be built (an upstream that is down when the model is added)."""
        client = self._clients.get(name)
        if client is not None:
            return client
        if name in self._specs:
            raise EngineUnavailable(
                f"model {name!r} is not reachable yet", headers={"Retry-After": "2"}
            )
        if self.default is not None and name == self.default.model_name:
            return self.default
        raise not_found(name)

    def resolve(self, name: str, tenant_id: str) -> tuple[EngineClient, Adapter | None]:
        """The client for `name` as `tenant_id` asks for it, and the adapter when it names
        one of the tenant's own: another tenant's adapter is not found, word for word as
        a model that does not exist."""
        adapter = self.adapter(name, tenant_id)
        if adapter is None:
            return self.get(name), None
        if not self._serves(adapter.base_model):  # its own name, never its base's
            raise not_found(name)
        return self.get(adapter.base_model), adapter

    def adapter(self, name: str, tenant_id: str) -> Adapter | None:
        """The tenant's adapter of that name; None when `name` names no adapter; 404 for
        another tenant's. A served model's name is never an adapter's: a row that takes
        one (the CLI cannot know a gateway's default entry; a model added after the
        adapter) cannot hide the model from every other tenant."""
        if self._serves(name):
            return None
        adapter = self._adapters.get(name)
        if adapter is not None and adapter.tenant_id != tenant_id:
            raise not_found(name)
        return adapter

    def adapters_of(self, tenant_id: str) -> list[Adapter]:
        """The tenant's adapters, by name."""
        mine = [
            a
            for a in self._adapters.values()
            if a.tenant_id == tenant_id and not self._serves(a.name)
        ]
        return sorted(mine, key=lambda a: a.name)

    def _serves(self, name: str) -> bool:
        """A model of the registry or the default entry (an adapter is neither)."""
        default = self.default
        return name in self._specs or (default is not None and name == default.model_name)

    def ready(self, name: str, tenant_id: str) -> tuple[EngineClient, Adapter | None]:
        """The client serving `name` for this tenant (404 when none does), 503 until it is
        ready, and its LoRA adapter when `name` names one of the tenant's own (another
        tenant's is a 404, as an unknown model)."""
        client, adapter = self.resolve(name, tenant_id)
        if not client.is_ready():
            raise EngineUnavailable(
                f"the model {name!r} is not ready yet", headers={"Retry-After": "1"}
            )
        return client, adapter

    def names(self) -> list[str]:
        """Every model served, the default entry first."""
        default = [self.default.model_name] if self.default is not None else []
        return [*default, *sorted(n for n in self._specs if n not in default)]

    def spec(self, name: str) -> ModelSpec | None:
        """What the registry says of `name`; None for the default entry and unknown names."""
        return self._specs.get(name)

    def built(self, name: str) -> EngineClient | None:
        """The client serving `name` if one is open (the default entry's included)."""
        if name in self._specs:  # a registry entry wins over a default of the same name
            return self._clients.get(name)
        default = self.default
        return default if default is not None and name == default.model_name else None

    async def refresh(self) -> None:
        async with self.sessions() as session:
            rows = await ModelService(session).list()
            adapters = await AdapterService(session).routes()
        self._adapters = {a.name: a for a in adapters}
        specs = {row.name: spec_of(row) for row in rows}
        for name in [n for n in self._specs if specs.get(n) != self._specs[n]]:
            await self._drop(name)  # removed or changed: the old client goes
        self._specs = specs
        for name, spec in specs.items():
            if name not in self._clients:
                await self._open(name, spec)

    def periodic(self) -> Periodic:
        return Periodic([(self.refresh, REFRESH_S)])

    async def close(self) -> None:
        for name in list(self._clients):
            await self._drop(name)
        self._specs = {}

    async def _open(self, name: str, spec: ModelSpec) -> None:
        try:
            self._clients[name] = await self.build(spec)
        except Exception as exc:  # retried at the next refresh; requests get 503 meanwhile
            # Our own errors say why (a variable's name, the targets tried), never a secret;
            # anything else is named by type only.
            reason = exc.message if isinstance(exc, ApiError) else type(exc).__name__
            log.warning("model %s: cannot open its client (%s)", name, reason)
        else:
            self._opened[name] = int(time.time())
            log.info("model %s: serving from %d target(s)", name, len(spec.targets))

    def opened_at(self, name: str) -> int | None:
        """When the registry model's client opened (OpenAI's `created`); None otherwise."""
        return self._opened.get(name)

    async def _drop(self, name: str) -> None:
        self._opened.pop(name, None)
        client = self._clients.pop(name, None)
        if client is not None:
            await client.close()


def not_found(name: str) -> NotFound:
    """The one answer for a model that is not there, or is another tenant's adapter."""
    return NotFound(
        f"the model {name!r} does not exist; GET /v1/models lists the available ones",
        param="model",
        code="model_not_found",
    )
