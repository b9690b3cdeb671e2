"""The lookups every audited service over a table of uniquely named rows (tenants, plans,
served models) gives: find, get and list by name."""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar, cast

from sqlalchemy import select

from tenants.audit import Audited
from tenants.errors import found

R = TypeVar("R")


class ByName(Audited, Generic[R]):
    """`table` is the rows' class; `what` names one row in errors ('no plan named ...')."""

    table: ClassVar[type[Any]]  # R, with a unique `name` column (a ClassVar cannot say R)
    what: ClassVar[str]

    async def find(self, name: str) -> R | None:
        row = await self.session.scalar(select(self.table).where(self.table.name == name))
        return cast("R | None", row)

    async def get(self, name: str) -> R:
        return found(await self.find(name), f"no {self.what} named {name!r}")

    async def list(self) -> list[R]:
        rows = await self.session.scalars(select(self.table).order_by(self.table.name))
        return cast("list[R]", list(rows))
