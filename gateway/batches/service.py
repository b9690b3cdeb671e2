"""Files and batches as a tenant asks for them: uploads checked line by line, and a batch
checked before it is stored (its lines, its worst case against the budget, the plan's cap
on enqueued batch tokens)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.admission.policy import check_model, check_priced
from gateway.batches.errors import BatchOverBudget, BatchTokenLimit
from gateway.core.errors import InvalidRequest
from gateway.dispatch.directory import ModelDirectory
from gateway.settings import Settings
from tenants.batches import ENDPOINTS, WINDOWS, Batch, BatchStore, NewLine, batch_lines
from tenants.billing.prices import PriceBook
from tenants.blobs import BlobStore, FolderBlobStore, S3BlobStore
from tenants.files import FileStore, StorageFull, StoredFile, parse_jsonl
from tenants.models import utcnow
from tenants.quota import QuotaStore, month_period, tenant_scope
from tenants.services import Principal

UPLOAD_PURPOSES = ("batch",)


@dataclass(frozen=True)
class WorstCase:
    tokens: int
    micros: int


class BatchService:
    """One tenant's files and batches, for the routes."""

    def __init__(
        self,
        session: AsyncSession,
        principal: Principal,
        blobs: BlobStore,
        directory: ModelDirectory,
        prices: PriceBook,
        store: QuotaStore,
        file_quota: int,  # the bytes a tenant's files may hold, where its plan names none
    ) -> None:
        self.principal = principal
        self.file_quota = file_quota
        self.directory, self.prices, self.store = directory, prices, store
        self.files = FileStore(session, blobs, principal.tenant_id)
        self.batches = BatchStore(session, principal.tenant_id)

    async def upload(self, filename: str, purpose: str, content: bytes) -> StoredFile:
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest(
                f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}", param="purpose"
            )
        parse_jsonl(content)  # a malformed line is refused now, naming its number
        return await self.files.create(filename, purpose, content, quota_bytes=self._quota())

    async def refuse_past_room(self, least_bytes: int) -> None:
        """StorageFull before an upload of at least `least_bytes` is read, when it cannot
        fit (unlocked: the check as the file is stored decides; this one spares reading
        and spooling up to 200 MiB that a tenant over its quota sends again and again)."""
        used, quota = await self.files.used_bytes(), self._quota()
        if used + least_bytes > quota:
            raise StorageFull(
                f"this file (at least {least_bytes} bytes) does not fit the tenant's file "
                f"storage: {used} of {quota} bytes are in use; delete files to make room",
                "file",
            )

    def _quota(self) -> int:
        quota = self.principal.plan.max_file_bytes
        return self.file_quota if quota is None else quota

    async def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> Batch:
        if endpoint not in ENDPOINTS:
            raise InvalidRequest(
                f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint"
            )
        if completion_window not in WINDOWS:
            raise InvalidRequest('completion_window must be "24h"', param="completion_window")
        stored = await self.files.get(input_file_id)
        if stored.purpose != "batch":
            raise InvalidRequest("the input file's purpose must be batch", param="input_file_id")
        lines = batch_lines(parse_jsonl(await self.files.content(input_file_id)), endpoint)
        worst = await self._worst_case(lines, endpoint)
        await self._check_token_cap(worst.tokens)
        await self._check_budget(worst.micros)
        return await self.batches.create(
            api_key_id=self.principal.key_id,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            metadata=metadata,
            lines=lines,
            enqueued_tokens=worst.tokens,
            worst_case_micros=worst.micros,
        )

    async def _worst_case(self, lines: list[NewLine], endpoint: str) -> WorstCase:
        """Every line at its most: a prompt of as many tokens as characters (a token is at
        least one), and all the output it may ask for, at the batch price."""
        tokens = micros = 0
        prices: dict[str, Any] = {}
        for line in lines:
            model = line.body.get("model")
            if not isinstance(model, str):
                raise InvalidRequest(
                    f"request {line.line} of the file names no model", param="model"
                )
            if model not in prices:
                # 404: no such model, or another tenant's adapter
                engine, adapter = self.directory.ready(model, self.principal.tenant_id)
                base = None if adapter is None else adapter.base_model
                # Refused now as each line would be when it runs: the plan's models, a price.
                check_model(self.principal, base or model)
                quote = await self.prices.quote(model, utcnow(), base)
                check_priced(quote, model, self.directory.spec(base or model) is not None)
                context = engine.max_model_len
                prices[model] = (context, quote.price.for_batch())
            context, price = prices[model]
            prompt, output = _line_tokens(line.body, endpoint, context)
            tokens += prompt + output
            micros += price.cost_micros(prompt, 0, output)
        return WorstCase(tokens, micros)

    async def _check_token_cap(self, tokens: int) -> None:
        cap = self.principal.plan.max_batch_tokens
        if cap is None:
            return
        enqueued = await self.batches.enqueued_tokens()
        if enqueued + tokens > cap:
            raise BatchTokenLimit(
                f"the batch would enqueue up to {tokens} tokens, with {enqueued} enqueued "
                f"already; your plan allows {cap}",
                param="input_file_id",
                headers={  # the limit that refused; room comes back as batches finish
                    "x-ratelimit-limit-tokens": str(cap),
                    "x-ratelimit-remaining-tokens": str(max(0, cap - enqueued)),
                },
            )

    async def _check_budget(self, micros: int) -> None:
        budget = self.principal.plan.limits.monthly_budget_micros
        if budget is None:
            return
        usage = await self.store.usage(tenant_scope(self.principal.tenant_id), month_period())
        pending = await self.batches.reserved_micros()  # other batches still running
        left = budget - usage.spent_micros - usage.reserved_micros - pending
        if micros > left:
            raise BatchOverBudget(
                f"the batch may cost up to {micros} micro-units; the budget has {max(left, 0)} "
                "left this month",
                param="input_file_id",
            )


def open_blob_store(settings: Settings) -> BlobStore:
    """Uploaded files' bytes: in the S3 bucket when TOLLGATE_S3_BUCKET is set, otherwise
    under the data folder's files/."""
    if settings.s3 is not None:
        return S3BlobStore(settings.s3)
    return FolderBlobStore(settings.data_dir / "files")


def _line_tokens(body: dict[str, Any], endpoint: str, context: int) -> tuple[int, int]:
    """The most prompt and output tokens one line may use."""
    source = body.get("messages") if endpoint == "/v1/chat/completions" else None
    if source is None:
        source = body.get("prompt", body.get("input", ""))
    prompt = min(len(json.dumps(source)), context)
    if endpoint == "/v1/embeddings":
        return prompt, 0
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    room = max(context - 1, 1)
    output = min(asked, room) if isinstance(asked, int) and asked > 0 else room
    choices = body.get("n")
    return prompt, output * (choices if isinstance(choices, int) and choices > 1 else 1)
