"""The Batch API's refusals, each with its own HTTP status."""

from __future__ import annotations

from gateway.core.errors import ApiError


class BatchOverBudget(ApiError):
    """The batch's worst case costs more than the tenant's budget has left."""

    status = 402
    type = "insufficient_quota"
    default_code = "batch_over_budget"
    retryable = False


class BatchTokenLimit(ApiError):
    """The plan's limit on enqueued batch tokens would be passed."""

    status = 429
    type = "rate_limit_error"
    default_code = "token_limit_exceeded"
    retryable = False
