"""LoRA adapters as product objects: a tenant's fine-tune of a served base model.

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors) on the
engines' hosts, owned by one tenant, who addresses it by name in `model` as vLLM's
clients do. Only its tenant sees or reaches it: to anyone else its name is a model that
does not exist. Names are unique across tenants (the engine, the price book and replica
affinity know an adapter by its name alone) and never a registry model's name.

The folder is checked when the adapter is added, against the engine's own limits: a
LoRA config, a weights file, a rank no larger than `max_lora_rank` (when the caller knows
the engine's) and only target modules the engine adapts. The engine checks the weights'
shapes when a request first names the adapter.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, DateTime, ForeignKey, Integer, String, Text, select
from sqlalchemy.orm import Mapped, mapped_column

from backend.requests import LORA_TARGET_MODULES
from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.models import Base, Tenant, new_id, utcnow
from tenants.registry import ModelService
from tenants.services import Audited, TenantService

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")  # as a model name


class LoRAAdapter(Base):
    __tablename__ = "lora_adapters"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    base_model: Mapped[str] = mapped_column(String(128))
    path: Mapped[str] = mapped_column(Text)
    rank: Mapped[int] = mapped_column(Integer)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


@dataclass(frozen=True)
class AdapterFolder:
    """What a PEFT folder's adapter_config.json says, once checked."""

    rank: int
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class Adapter:
    """An adapter as the gateway routes it: who owns it, what it adapts, where it is."""

    name: str
    tenant_id: str
    base_model: str
    path: str


def read_folder(path: str, max_rank: int | None = None) -> AdapterFolder:
    """Check a PEFT LoRA folder against the engine's limits (`max_rank` when known)."""
    folder = Path(path)
    if not folder.is_absolute():
        raise InvalidInputError("the adapter path must be an absolute folder", param="path")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        raise InvalidInputError(f"{path!r} has no readable {CONFIG_FILE}", param="path") from None
    if not (folder / WEIGHTS_FILE).is_file():
        raise InvalidInputError(f"{path!r} has no {WEIGHTS_FILE}", param="path")
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise InvalidInputError(f"{path!r} is not a LoRA adapter", param="path")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidInputError(f"{path!r}: r must be a positive integer", param="path")
    if max_rank is not None and rank > max_rank:
        raise InvalidInputError(
            f"adapter rank {rank} is above the engine's max_lora_rank {max_rank}", param="path"
        )
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not targets:
        raise InvalidInputError(f"{path!r} names no target_modules", param="path")
    unknown = sorted(str(t) for t in set(targets) - LORA_TARGET_MODULES)
    if unknown:
        raise InvalidInputError(
            f"the adapter targets {unknown}; the engine adapts {sorted(LORA_TARGET_MODULES)}",
            param="path",
        )
    return AdapterFolder(rank, tuple(sorted(targets)))


def adapter_view(row: LoRAAdapter, tenant: str) -> dict[str, Any]:
    """An adapter as the admin API, the CLI and the console show it."""
    return {
        "name": row.name,
        "tenant": tenant,
        "base_model": row.base_model,
        "path": row.path,
        "rank": row.rank,
        "target_modules": list(row.target_modules),
        "created_at": row.created_at.isoformat(),
    }


class AdapterService(Audited):
    """Adding, listing and removing adapters, audited in the caller's transaction."""

    async def add(
        self, name: str, base_model: str, path: str, tenant: str, max_rank: int | None = None
    ) -> tuple[LoRAAdapter, Tenant]:
        if not _NAME.fullmatch(name):
            raise InvalidInputError(
                "adapter name must be 1-128 characters of letters, digits and . _ : / @ + -, "
                "starting with a letter or digit",
                param="name",
            )
        if not _NAME.fullmatch(base_model):
            raise InvalidInputError("base_model must be a model's name", param="base_model")
        if not _storable(tenant):
            raise NotFoundError(f"no tenant named {tenant[:100]!r}")
        owner = await TenantService(self.session).get(tenant)
        folder = read_folder(path, max_rank)
        if await self._find(name) is not None or await ModelService(self.session).find(name):
            raise ConflictError(f"the name {name!r} is taken", param="name")
        row = LoRAAdapter(
            name=name,
            tenant_id=owner.id,
            base_model=base_model,
            path=path,
            rank=folder.rank,
            target_modules=list(folder.target_modules),
        )
        self.session.add(row)
        await self.session.flush()
        await self._audit("adapter.add", f"adapter:{name}", owner.id, **adapter_view(row, tenant))
        return row, owner

    async def routes(self) -> list[Adapter]:
        """Every adapter as the gateway routes it (re-read by each gateway's directory)."""
        rows = await self.session.execute(select(LoRAAdapter))
        return [Adapter(r.name, r.tenant_id, r.base_model, r.path) for r in rows.scalars()]

    async def list(self, tenant: str | None = None) -> list[tuple[LoRAAdapter, str]]:
        """Adapters with their tenant's name, optionally one tenant's alone."""
        query = select(LoRAAdapter, Tenant.name).join(Tenant, Tenant.id == LoRAAdapter.tenant_id)
        if tenant is not None and not _storable(tenant):
            return []
        if tenant is not None:
            query = query.where(Tenant.name == tenant)
        rows = await self.session.execute(query.order_by(Tenant.name, LoRAAdapter.name))
        return [(row, owner) for row, owner in rows.all()]

    async def remove(self, name: str, tenant: str | None = None) -> None:
        """`tenant`, when given, must own it (else it is not found, as for a tenant)."""
        row = await self._find(name)
        if row is not None and tenant is not None:
            owner = await TenantService(self.session).find(tenant)
            row = row if owner is not None and owner.id == row.tenant_id else None
        if row is None:
            raise NotFoundError(f"no adapter named {name!r}")
        await self.session.delete(row)
        await self.session.flush()
        await self._audit("adapter.remove", f"adapter:{name}", row.tenant_id)

    async def _find(self, name: str) -> LoRAAdapter | None:
        if not _NAME.fullmatch(name):
            return None  # no stored name is like it (and PostgreSQL refuses a NUL)
        rows = await self.session.execute(select(LoRAAdapter).where(LoRAAdapter.name == name))
        return rows.scalar_one_or_none()


def _storable(text: str) -> bool:
    """A name a stored row may have: PostgreSQL refuses a NUL in a query's text."""
    return len(text) <= 100 and "\0" not in text
