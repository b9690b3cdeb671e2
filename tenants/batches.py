"""Batches (the Batch API) and their lines: one row per line holds its request, its state and
its result, so a restarted gateway resumes a batch where it was, loses no result and runs
no line twice. A tenant's queries name the tenant; the runner's (BatchQueue) name a batch."""

from __future__ import annotations

import enum
import secrets
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    UniqueConstraint,
    bindparam,
    func,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from tenants.errors import ConflictError, InvalidInputError, NotFoundError
from tenants.files import is_stored_id
from tenants.models import (
    ApiKey,
    Base,
    KeyStatus,
    Plan,
    Tenant,
    as_utc,
    utcnow,
)
from tenants.services import Principal

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
WINDOWS = {"24h": timedelta(hours=24)}


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ACTIVE = (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING)
FINAL = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


class LineStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"  # claimed by a runner; back to pending if its lease lapses
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"  # the window closed, or the batch was cancelled, before it ran


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_created", "tenant_id", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    errors: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    total: Mapped[int] = mapped_column(Integer)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    enqueued_tokens: Mapped[int] = mapped_column(BigInteger)  # worst case, for the plan's cap
    worst_case_micros: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    def as_openai(self) -> dict[str, Any]:
        def stamp(moment: datetime | None) -> int | None:
            return None if moment is None else int(as_utc(moment).timestamp())

        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": self.errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": stamp(self.created_at),
            "in_progress_at": stamp(self.in_progress_at),
            "expires_at": stamp(self.expires_at),
            "finalizing_at": stamp(self.finalizing_at),
            "completed_at": stamp(self.completed_at),
            "failed_at": stamp(self.failed_at),
            "expired_at": stamp(self.expired_at),
            "cancelling_at": stamp(self.cancelling_at),
            "cancelled_at": stamp(self.cancelled_at),
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata_,
        }


class BatchLine(Base):
    __tablename__ = "batch_lines"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
        Index("ix_batch_lines_batch_status", "batch_id", "status"),
    )

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)  # from 1, as in the file
    custom_id: Mapped[str] = mapped_column(String(255))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    claimed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    status_code: Mapped[int | None] = mapped_column(Integer)
    request_id: Mapped[str | None] = mapped_column(String(64))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # the response body, or error


@dataclass(frozen=True)
class NewLine:
    line: int
    custom_id: str
    body: dict[str, Any]


def batch_lines(requests: list[dict[str, Any]], endpoint: str) -> list[NewLine]:
    """The lines of an input file, checked as OpenAI checks them: a `custom_id` unique in
    the file, `method` POST, `url` the batch's endpoint, a `body` object."""
    lines: list[NewLine] = []
    seen: set[str] = set()
    for number, request in enumerate(requests, start=1):
        custom_id, body = request.get("custom_id"), request.get("body")
        problem = None
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 255:
            problem = "custom_id must be a string of 1 to 255 characters"
        elif custom_id in seen:
            problem = f"custom_id {custom_id!r} is not unique in the file"
        elif request.get("method", "POST") != "POST":
            problem = "method must be POST"
        elif request.get("url", endpoint) != endpoint:
            problem = f"url must be the batch's endpoint, {endpoint}"
        elif not isinstance(body, dict):
            problem = "body must be a JSON object"
        if problem is not None:
            raise InvalidInputError(f"request {number} of the file: {problem}", "input_file_id")
        assert isinstance(custom_id, str) and isinstance(body, dict)
        seen.add(custom_id)
        lines.append(NewLine(number, custom_id, body))
    if not lines:
        raise InvalidInputError("the input file holds no request", "input_file_id")
    return lines


class BatchStore:
    """One tenant's batches."""

    def __init__(self, session: AsyncSession, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    async def create(
        self,
        *,
        api_key_id: str,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        lines: list[NewLine],
        enqueued_tokens: int,
        worst_case_micros: int,
    ) -> Batch:
        now = utcnow()
        batch = Batch(
            id="batch_" + secrets.token_hex(12),
            tenant_id=self.tenant_id,
            api_key_id=api_key_id,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status=BatchStatus.IN_PROGRESS,  # validated before it is stored
            metadata_=metadata,
            total=len(lines),
            completed=0,
            failed=0,
            enqueued_tokens=enqueued_tokens,
            worst_case_micros=worst_case_micros,
            created_at=now,
            in_progress_at=now,
            expires_at=now + WINDOWS[completion_window],
        )
        self.session.add(batch)
        await self.session.flush()
        self.session.add_all(
            BatchLine(
                batch_id=batch.id,
                line=line.line,
                custom_id=line.custom_id,
                body=line.body,
                status=LineStatus.PENDING,
            )
            for line in lines
        )
        await self.session.flush()
        return batch

    async def get(self, batch_id: str) -> Batch:
        if not is_stored_id(batch_id):  # no query for what no id looks like (a NUL, say)
            raise NotFoundError(f"no batch {batch_id[:64]!r}")
        batch = await self.session.scalar(
            select(Batch).where(Batch.id == batch_id, Batch.tenant_id == self.tenant_id)
        )
        if batch is None:
            raise NotFoundError(f"no batch {batch_id!r}")
        return batch

    async def list(self, after: str | None = None, limit: int = 20) -> list[Batch]:
        query = select(Batch).where(Batch.tenant_id == self.tenant_id)
        if after is not None:
            anchor = await self.get(after)
            query = query.where(Batch.created_at <= anchor.created_at, Batch.id != anchor.id)
        rows = await self.session.scalars(
            query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)
        )
        return list(rows)

    async def cancel(self, batch_id: str) -> Batch:
        batch = await self.get(batch_id)
        if batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return batch
        if batch.status != BatchStatus.IN_PROGRESS:
            raise ConflictError(f"a batch that is {batch.status} cannot be cancelled")
        batch.status = BatchStatus.CANCELLING
        batch.cancelling_at = utcnow()
        return batch

    async def enqueued_tokens(self) -> int:
        """Worst-case tokens of this tenant's batches still running (the plan's cap)."""
        total = await self.session.scalar(
            select(func.coalesce(func.sum(Batch.enqueued_tokens), 0)).where(
                Batch.tenant_id == self.tenant_id, Batch.status.in_(ACTIVE)
            )
        )
        return int(total or 0)

    async def reserved_micros(self) -> int:
        """Worst-case cost of this tenant's batches still running."""
        total = await self.session.scalar(
            select(func.coalesce(func.sum(Batch.worst_case_micros), 0)).where(
                Batch.tenant_id == self.tenant_id, Batch.status.in_(ACTIVE)
            )
        )
        return int(total or 0)


@dataclass(frozen=True)
class LineOutcome:
    """What a line's run answered: its HTTP status, body and request id."""

    status_code: int
    body: dict[str, Any]
    request_id: str | None

    @property
    def succeeded(self) -> bool:
        return self.status_code == 200


@dataclass(frozen=True)
class LineResult:
    """A line's outcome, to keep (BatchQueue.finish)."""

    batch_id: str
    line: int
    outcome: LineOutcome


_LINE_TABLE = cast(Table, BatchLine.__table__)
_LINES = _LINE_TABLE.c
# A line's result, if it is still running: built once (a statement's construction costs
# more than its execution, once compiled and cached), run a line at a time for its rowcount.
_KEEP = (
    update(_LINE_TABLE)
    .where(
        _LINES.batch_id == bindparam("b_batch"),
        _LINES.line == bindparam("b_line"),
        _LINES.status == LineStatus.RUNNING,
    )
    .values(
        status=bindparam("b_status"),
        status_code=bindparam("b_code"),
        request_id=bindparam("b_request"),
        result=bindparam("b_result"),
    )
)


class BatchQueue:
    """The runner's view: lines to claim and results to keep, across tenants."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def active(self, batch_id: str | None = None) -> list[Batch]:
        """The batches not final yet (of them, `batch_id` alone when given)."""
        query = select(Batch).where(Batch.status.in_(ACTIVE))
        if batch_id is not None:
            query = query.where(Batch.id == batch_id)
        return list(await self.session.scalars(query.order_by(Batch.created_at)))

    async def claim(self, batch_id: str, count: int, lease: timedelta) -> list[BatchLine]:
        """Up to `count` lines of the batch to run now: pending ones, and running ones
        whose runner's lease lapsed (a gateway that died). Claimed by one conditional
        update stamped with this claim's time, so two runners never take the same line."""
        now = utcnow()
        claimable = (BatchLine.status == LineStatus.PENDING) | (
            (BatchLine.status == LineStatus.RUNNING) & (BatchLine.claimed_at < now - lease)
        )
        wanted = (
            select(BatchLine.line)
            .where(BatchLine.batch_id == batch_id, claimable)
            .order_by(BatchLine.line)
            .limit(count)
        )
        numbers = list(await self.session.scalars(wanted))
        if not numbers:
            return []
        await self.session.execute(
            update(BatchLine)
            .where(BatchLine.batch_id == batch_id, BatchLine.line.in_(numbers), claimable)
            .values(status=LineStatus.RUNNING, claimed_at=now)
            .execution_options(synchronize_session=False)
        )
        claimed = await self.session.scalars(
            select(BatchLine).where(
                BatchLine.batch_id == batch_id,
                BatchLine.line.in_(numbers),
                BatchLine.status == LineStatus.RUNNING,
                BatchLine.claimed_at == now,
            )
        )
        return list(claimed)

    async def renew(self, batch_id: str, lines: list[int]) -> None:
        """The runner still works on these lines: their lease starts again."""
        if lines:
            await self.session.execute(
                update(BatchLine)
                .where(
                    BatchLine.batch_id == batch_id,
                    BatchLine.line.in_(lines),
                    BatchLine.status == LineStatus.RUNNING,
                )
                .values(claimed_at=utcnow())
            )

    async def finish(self, results: list[LineResult]) -> int:
        """Keep each line's result, once (a line kept already, or expired, is passed over),
        and count them in their batches; returns how many were kept."""
        connection = await self.session.connection()
        counts: dict[tuple[str, bool], int] = defaultdict(int)
        for result in results:
            outcome = result.outcome
            kept = await connection.execute(
                _KEEP,
                {
                    "b_batch": result.batch_id,
                    "b_line": result.line,
                    "b_status": LineStatus.SUCCEEDED if outcome.succeeded else LineStatus.FAILED,
                    "b_code": outcome.status_code,
                    "b_request": outcome.request_id,
                    "b_result": outcome.body,
                },
            )
            counts[result.batch_id, outcome.succeeded] += kept.rowcount
        for (batch_id, succeeded), count in counts.items():
            counter = Batch.completed if succeeded else Batch.failed
            if count:
                await self.session.execute(
                    update(Batch).where(Batch.id == batch_id).values({counter: counter + count})
                )
        return sum(counts.values())

    async def release(self, batch_id: str, lines: list[int] | None = None) -> None:
        """Running lines back to pending (all of the batch's when `lines` is None): their
        runner stopped, or they could not start now."""
        query = update(BatchLine).where(
            BatchLine.batch_id == batch_id, BatchLine.status == LineStatus.RUNNING
        )
        if lines is not None:
            query = query.where(BatchLine.line.in_(lines))
        await self.session.execute(query.values(status=LineStatus.PENDING, claimed_at=None))

    async def expire_pending(self, batch_id: str) -> None:
        """The lines that never started, when the batch is cancelled or its window closes."""
        await self.session.execute(
            update(BatchLine)
            .where(BatchLine.batch_id == batch_id, BatchLine.status == LineStatus.PENDING)
            .values(status=LineStatus.EXPIRED)
        )

    async def running(self, batch_id: str) -> int:
        count = await self.session.scalar(
            select(func.count()).where(
                BatchLine.batch_id == batch_id, BatchLine.status == LineStatus.RUNNING
            )
        )
        return int(count or 0)

    async def unfinished(self, batch_id: str) -> int:
        count = await self.session.scalar(
            select(func.count()).where(
                BatchLine.batch_id == batch_id,
                BatchLine.status.in_((LineStatus.PENDING, LineStatus.RUNNING)),
            )
        )
        return int(count or 0)

    async def lines(self, batch_id: str) -> list[BatchLine]:
        rows = await self.session.scalars(
            select(BatchLine).where(BatchLine.batch_id == batch_id).order_by(BatchLine.line)
        )
        return list(rows)


async def key_principal(session: AsyncSession, key_id: str) -> Principal | None:
    """The caller a batch runs as: the key that created it, on its terms now (None once
    the key is revoked: its batch's remaining lines fail)."""
    row = (
        await session.execute(
            select(ApiKey, Tenant.name, Plan)
            .join(Tenant, Tenant.id == ApiKey.tenant_id)
            .outerjoin(Plan, Plan.id == Tenant.plan_id)
            .where(ApiKey.id == key_id)
        )
    ).one_or_none()
    if row is None or row[0].status != KeyStatus.ACTIVE:
        return None
    key, tenant_name, plan = row
    return Principal.of(key, tenant_name, plan)
