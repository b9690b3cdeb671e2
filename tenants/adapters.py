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

import asyncio
import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, DateTime, ForeignKey, Integer, String, Text, select
from sqlalchemy.orm import Mapped, mapped_column

from backend.requests import LORA_TARGET_MODULES, unsupported_lora_options
from tenants.audit import Audited
from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.models import Base, Tenant, new_id, utcnow
from tenants.registry import ModelService
from tenants.services import TenantService

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # PEFT's are a few hundred bytes
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
_LORA_KEY = re.compile(r"\.lora_([AB])(?:\.\w+)?\.weight$")
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
    config = _read_config(folder / CONFIG_FILE, path)
    header = _weights_header(folder / WEIGHTS_FILE, path)
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise InvalidInputError(f"{path!r} is not a LoRA adapter", param="path")
    unsupported = unsupported_lora_options(config)
    if unsupported:
        raise InvalidInputError(
            f"{path!r} uses {unsupported}; the engine serves plain LoRA", param="path"
        )
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
    if not all(isinstance(t, str) for t in targets):
        raise InvalidInputError(f"{path!r}: target_modules must be module names", param="path")
    unknown = sorted(str(t) for t in set(targets) - LORA_TARGET_MODULES)
    if unknown:
        raise InvalidInputError(
            f"the adapter targets {unknown}; the engine adapts {sorted(LORA_TARGET_MODULES)}",
            param="path",
        )
    _check_ranks(header, rank, path)
    return AdapterFolder(rank, tuple(sorted(targets)))


def _read_config(file: Path, path: str) -> Any:
    """The parsed config, from a regular file of a config's size: a FIFO would block the
    reader forever, a huge file hold it for seconds."""
    unreadable = InvalidInputError(f"{path!r} has no readable {CONFIG_FILE}", param="path")
    try:
        if not file.is_file() or file.stat().st_size > MAX_CONFIG_BYTES:
            raise unreadable
        return json.loads(file.read_text())
    except (OSError, ValueError):
        raise unreadable from None


def _weights_header(file: Path, path: str) -> dict[str, Any]:
    """The safetensors header (8 bytes of its length, then JSON): a file that is not one
    is refused now rather than failing every request that names the adapter."""
    bad = InvalidInputError(f"{path!r} has no readable {WEIGHTS_FILE}", param="path")
    try:
        if not file.is_file():
            raise bad
        with file.open("rb") as weights:
            length = int.from_bytes(weights.read(8), "little")
            if not 2 <= length <= min(file.stat().st_size - 8, MAX_HEADER_BYTES):
                raise bad
            header = json.loads(weights.read(length))
    except (OSError, ValueError):
        raise bad from None
    if not isinstance(header, dict):
        raise bad
    return header


def _check_ranks(header: dict[str, Any], rank: int, path: str) -> None:
    """Every lora_A is [r, in] and every lora_B [out, r], r as the config says."""
    for key, entry in header.items():
        found = _LORA_KEY.search(key)
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if found is None or not isinstance(shape, list) or len(shape) != 2:
            continue
        if shape[0 if found[1] == "A" else 1] != rank:
            raise InvalidInputError(f"{path!r}: {key} is {shape}, not of rank {rank}", param="path")


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
        self,
        name: str,
        base_model: str,
        path: str,
        tenant: str,
        max_rank: int | None = None,
        served: Collection[str] | None = None,
    ) -> tuple[LoRAAdapter, Tenant]:
        """`served`: the models the caller's gateway serves, when it knows them (the CLI
        does not know a gateway's default entry): the base must be one, the name none."""
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
        # In a thread: a folder on a slow or hung file system must not stall the gateway.
        folder = await asyncio.to_thread(read_folder, path, max_rank)
        if (
            await self._find(name) is not None
            or await ModelService(self.session).find(name)
            or name in (served or ())
        ):
            raise ConflictError(f"the name {name!r} is taken", param="name")
        if await self._find(base_model) is not None or (
            served is not None and base_model not in served
        ):
            raise InvalidInputError(
                f"base_model {base_model!r} is not a served model", param="base_model"
            )
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
