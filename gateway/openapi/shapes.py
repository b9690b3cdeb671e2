"""The response bodies of the public routes, as msgspec structs for the OpenAPI schema.

The handlers build these bodies as dicts (gateway/api/formats.py, the `*_view`
functions); these structs only describe them, and the schemathesis suite
(tests/integration/test_schema_fuzz.py) checks every response against them."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

# Tool calls: the routes build them (gateway/api/tools.py) and answer them as they are.


class CalledFunction(Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct):
    id: str
    function: CalledFunction
    type: Literal["function"] = "function"


class ErrorDetail(Struct):
    message: str
    type: str  # invalid_request_error, authentication_error, rate_limit_error, ...
    param: str | None  # the offending field, when one is to blame
    code: str | None  # e.g. context_length_exceeded, invalid_api_key, rate_limit_exceeded


class ErrorResponse(Struct):
    """Every refusal, in OpenAI's error shape."""

    error: ErrorDetail


# OpenAI-compatible routes


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class AssistantMessage(Struct, kw_only=True):
    role: Literal["assistant"]
    content: str | None  # None when the output was tool calls only
    tool_calls: list[ToolCall] | None = None  # present when the output held tool calls


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None  # stop, length, tool_calls
    logprobs: ChatLogprobs | None


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(Struct):
    index: int
    id: str
    type: Literal["function"]
    function: CalledFunction  # each call whole, in one delta


class ChatDelta(Struct, kw_only=True):
    role: Literal["assistant"] | None = None  # in each choice's first chunk
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatCompletionChunk(Struct, kw_only=True):
    """One `data:` event of a streamed chat completion; `usage` is null but in the last
    (empty `choices`) event when `stream_options.include_usage` is set."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class StreamError(Struct):
    """The `data:` event that ends a stream an error cut short (mid-stream errors are an
    event, not a status: the 200 was sent)."""

    error: ErrorDetail


class TextLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TextChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: TextLogprobs | None


class Completion(Struct, kw_only=True):
    """A text completion; streamed, each `data:` event is one of these with one choice
    (and `usage` as for chat chunks)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None


class Model(Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str  # "tollgate": Tollgate's own engines; "upstream": an OpenAI-compatible one
    max_model_len: int | None  # null while an upstream's context is not known yet
    context_length: int | None = None
    parent: str | None = None  # a LoRA adapter's base model (as vLLM lists its adapters)


class ModelList(Struct):
    object: Literal["list"]
    data: list[Model]


class ResponseText(Struct):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ResponseMessage(Struct):
    id: str
    type: Literal["message"]
    status: str
    role: Literal["assistant"]
    content: list[ResponseText]


class ResponseTextPart(Struct):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseEvent(Struct, kw_only=True):
    """One event of a streamed /v1/responses (`event:` is its `type`), in this order:
    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta (one per text delta),
    response.output_text.done, response.content_part.done, response.output_item.done,
    then response.completed or response.incomplete (`response` whole, with `usage`); or
    `error` (`code`, `message`) where an error cut the stream short."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    item: ResponseMessage | None = None
    part: ResponseTextPart | None = None
    item_id: str | None = None
    output_index: int | None = None
    content_index: int | None = None
    delta: str | None = None
    text: str | None = None
    code: str | None = None
    message: str | None = None


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class ResponseObject(Struct, kw_only=True):
    """/v1/responses: one `response` (streamed: its typed events, the last of which
    carries this object)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[ResponseMessage]
    usage: ResponseUsage | None
    incomplete_details: dict[str, str] | None = None


class EmbeddingItem(Struct):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct):
    object: Literal["list"]
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


# Usage and billing


class Totals(Struct):
    requests: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    cost_micros: int


class ModelTotals(Totals, kw_only=True):
    model: str


class DayTotals(Totals, kw_only=True):
    date: str


class InvoiceLine(Struct):
    description: str
    model: str
    amount_micros: int
    amount: str  # decimal, never a float


class InvoicePreview(Struct):
    currency: str
    lines: list[InvoiceLine]
    total_micros: int
    total: str


class Report(Struct, kw_only=True):
    """A tenant's usage and spend over a month (UTC)."""

    tenant: str
    period: str  # YYYY-MM
    from_: str = msgspec.field(name="from")
    to: str
    totals: Totals
    batch: Totals  # the part of the totals that batch lines (the Batch API) used
    by_status: dict[str, int]
    by_model: list[ModelTotals]
    daily: list[DayTotals]
    invoice_preview: InvoicePreview


class TenantUsageReport(Report, kw_only=True):
    object: Literal["usage"]


class UsageRow(Struct):
    """One ledger row, as its tenant may see it."""

    request_id: str
    model: str
    endpoint: str
    status: str
    finish_reason: str | None
    priority: int | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_micros: int
    price_version_id: str | None
    queue_ms: float | None
    ttft_ms: float | None
    itl_ms: float | None
    e2e_ms: float | None
    started_at: str | None
    created_at: str


# The admin API


class Plan(Struct):
    name: str
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    monthly_budget_micros: int | None
    max_tokens_per_request: int | None
    allowed_models: list[str] | None  # None: every model
    default_priority: int
    max_priority: int
    weight: int
    max_batch_tokens: int | None  # worst-case tokens of unfinished batches (None: any)
    max_file_bytes: int | None  # the tenant's stored files (None: the gateway's default)


class Tenant(Struct):
    id: str
    name: str
    plan: str | None
    created_at: str


class KeyLimits(Struct):
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    monthly_budget_micros: int | None
    max_tokens_per_request: int | None


class Key(Struct, kw_only=True):
    id: str
    prefix: str
    name: str
    role: Literal["tenant", "admin"]
    status: str
    created_at: str
    last_used_at: str | None
    limits: KeyLimits


class CreatedKey(Key, kw_only=True):
    key: str  # the secret, shown this once


class TenantQuota(Struct):
    tenant: str
    period: str
    spent_micros: int
    reserved_micros: int
    concurrent: int
    requests_last_minute: int
    tokens_last_minute: int


class AuditEvent(Struct):
    id: int
    time: str
    actor: str
    action: str
    target: str
    tenant_id: str | None
    request_id: str | None
    ip: str | None
    user_agent: str | None
    details: dict[str, Any]
    prev_hash: str
    hash: str


class AuditPage(Struct):
    data: list[AuditEvent]
    next_cursor: int | None  # the next, older page; None: this is the last


class AuditVerification(Struct):
    ok: bool
    events: int
    first_bad_id: int | None
    reason: str | None
    anchor: str | None


class TargetShape(Struct):
    url: str
    weight: int


class UpstreamState(Struct):
    """One upstream of an `openai` model as the answering gateway replica sees it."""

    url: str
    healthy: bool
    suspect: bool  # it claimed more usage than was reserved (billed the reservation)
    usage_overclaims: int


class ServedModel(Struct):
    """A registry model (never an API key: only the variable that holds it)."""

    name: str
    kind: Literal["tollgate", "openai"]
    targets: list[TargetShape]
    tokenizer: str | None
    upstream_model: str | None
    api_key_env: str | None
    context_length: int | None
    created_at: str
    updated_at: str
    upstreams: list[UpstreamState]  # empty unless an `openai` model is open on this replica


class LoRAAdapter(Struct):
    """A tenant's LoRA adapter (tenants/adapters.py), addressed by `name` in `model`."""

    name: str
    tenant: str
    base_model: str
    path: str  # the PEFT folder on the engines' hosts
    rank: int
    target_modules: list[str]
    created_at: str


class PriceVersion(Struct):
    id: str
    model: str
    input_micros_per_mtok: int
    cached_input_micros_per_mtok: int
    output_micros_per_mtok: int
    batch_discount_pct: int  # off each rate for a batch line (the Batch API)
    effective_from: str
    created_by: str
    created_at: str


class StripeCustomer(Struct):
    tenant: str
    customer_id: str | None  # None: not linked yet


class ExportStatus(Struct):
    stripe: bool  # whether TOLLGATE_STRIPE_API_KEY is set
    pending: int
    exported: int
    failed: int
    unconfirmed: int
    too_old_for_stripe: int
    near_limit: int
    customers_failed: int
    meter_status: str | None
    oldest_pending: str | None
    warnings: list[str]


class Requeued(Struct):
    requeued: int


class Resolved(Struct):
    resolved: int
    in_stripe: bool


# The counts of one relay run by outcome, and `meter_error` (text or null).
ExportRun = dict[str, int | str | None]


# Probes


class Health(Struct):
    status: Literal["ok", "engine_dead"]


class ReadinessChecks(Struct):
    database: bool
    engine: bool


class Readiness(Struct):
    status: Literal["ready", "not_ready", "draining"]
    checks: ReadinessChecks
