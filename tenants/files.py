"""Uploaded files (the Files API): the row here, the bytes in a blob store (tenants/blobs.py:
the data folder, or an S3-compatible bucket in stack mode) under `<tenant id>/<file id>`.
Every query names the tenant: one tenant never sees another's file."""

from __future__ import annotations

import json
import secrets
from datetime import datetime

from sqlalchemy import BigInteger, DateTime, ForeignKey, Index, String, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from tenants.blobs import BlobStore
from tenants.errors import InvalidInputError, NotFoundError
from tenants.models import Base, Tenant, as_utc, utcnow

PURPOSES = frozenset({"batch", "batch_output"})  # what a client may upload: "batch"
MAX_FILE_BYTES = 200 * 2**20  # OpenAI's limit for a batch input file
MAX_LINES = 50_000  # requests in one batch, as OpenAI's


def is_stored_id(text: str) -> bool:
    """What a file's or a batch's id can be: short and printable."""
    return len(text) <= 64 and text.isprintable()


class StoredFile(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    def as_openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(as_utc(self.created_at).timestamp()),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


class StorageFull(InvalidInputError):
    """An upload that would take the tenant's stored files past its quota."""


class MalformedLine(InvalidInputError):
    """A line of a batch input file that is not one request object."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line} of the file is not a valid request: {reason}", "file")
        self.line = line


def parse_jsonl(content: bytes) -> list[dict[str, object]]:
    """Each non-empty line as a JSON object; MalformedLine names the first bad one (from 1)."""
    objects: list[dict[str, object]] = []
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedLine(number, f"invalid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise MalformedLine(number, "a line must be a JSON object")
        objects.append(value)
        if len(objects) > MAX_LINES:
            raise InvalidInputError(f"a batch file holds at most {MAX_LINES} requests")
    return objects


class FileStore:
    """Files of one tenant: rows in the database, bytes in `blobs` as `<tenant>/<file id>`."""

    def __init__(self, session: AsyncSession, blobs: BlobStore, tenant_id: str) -> None:
        self.session = session
        self.blobs = blobs
        self.tenant_id = tenant_id

    def _blob(self, file_id: str) -> str:
        return f"{self.tenant_id}/{file_id}"

    async def create(
        self, filename: str, purpose: str, content: bytes, quota_bytes: int | None = None
    ) -> StoredFile:
        """`quota_bytes`: the most the tenant's files may hold with this one (None: no
        quota, for what the gateway writes itself: a batch's results)."""
        if len(content) > MAX_FILE_BYTES:
            raise InvalidInputError(f"a file is at most {MAX_FILE_BYTES} bytes")
        if quota_bytes is not None:
            await self._check_room(len(content), quota_bytes)
        stored = StoredFile(
            id="file-" + secrets.token_hex(12),
            tenant_id=self.tenant_id,
            filename=filename[:255] or "upload.jsonl",
            purpose=purpose,
            bytes=len(content),
            created_at=utcnow(),
        )
        # Bytes first: a crash between the two leaves an orphan blob, never a row without bytes.
        await self.blobs.put(self._blob(stored.id), content)
        self.session.add(stored)
        await self.session.flush()
        return stored

    async def _check_room(self, size: int, quota_bytes: int) -> None:
        """StorageFull unless `size` more bytes fit the quota, counting every file kept.
        The tenant's row is written first: until this transaction ends it holds the
        tenant's other uploads back (a row lock in PostgreSQL, the write lock in SQLite),
        so two uploads cannot both take the room left for one."""
        await self.session.execute(
            update(Tenant)
            .where(Tenant.id == self.tenant_id)
            .values(id=Tenant.id)
            .execution_options(synchronize_session=False)
        )
        used = await self.used_bytes()
        if used + size > quota_bytes:
            raise StorageFull(
                f"this file ({size} bytes) does not fit the tenant's file storage: "
                f"{used} of {quota_bytes} bytes are in use; delete files to make room",
                "file",
            )

    async def used_bytes(self) -> int:
        """What the tenant's kept files hold."""
        used = await self.session.scalar(
            select(func.coalesce(func.sum(StoredFile.bytes), 0)).where(
                StoredFile.tenant_id == self.tenant_id, StoredFile.deleted_at.is_(None)
            )
        )
        return int(used or 0)

    async def get(self, file_id: str) -> StoredFile:
        if not is_stored_id(file_id):  # no query for what no id looks like (a NUL, say)
            raise NotFoundError(f"no file {file_id[:64]!r}")
        stored = await self.session.scalar(
            select(StoredFile).where(
                StoredFile.id == file_id,
                StoredFile.tenant_id == self.tenant_id,
                StoredFile.deleted_at.is_(None),
            )
        )
        if stored is None:
            raise NotFoundError(f"no file {file_id!r}")
        return stored

    async def list(self, purpose: str | None = None, limit: int = 10_000) -> list[StoredFile]:
        query = select(StoredFile).where(
            StoredFile.tenant_id == self.tenant_id, StoredFile.deleted_at.is_(None)
        )
        if purpose is not None:
            if not is_stored_id(purpose):
                return []
            query = query.where(StoredFile.purpose == purpose)
        rows = await self.session.scalars(query.order_by(StoredFile.created_at.desc()).limit(limit))
        return list(rows)

    async def content(self, file_id: str) -> bytes:
        await self.get(file_id)
        return await self.blobs.get(self._blob(file_id))

    async def delete(self, file_id: str) -> StoredFile:
        stored = await self.get(file_id)
        stored.deleted_at = utcnow()
        await self.blobs.delete(self._blob(file_id))
        return stored
