"""Typed errors of the request path, each with its own HTTP status and OpenAI error type
(gateway/http/errors.py renders them).

Each failure class has its own type, status and code so clients (the `openai` SDK
maps statuses to exception classes) can tell them apart.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ApiError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    # False: retrying cannot help; sent as `x-should-retry: false`, which the openai SDKs
    # obey over their status rules (they retry every 429 otherwise).
    retryable: ClassVar[bool] = True

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = dict(headers or {})
        if not self.retryable:
            self.headers["x-should-retry"] = "false"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class AuthenticationFailed(ApiError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDenied(ApiError):
    status = 403
    type = "permission_error"


class NotFound(ApiError):
    status = 404
    type = "not_found_error"


class Conflict(ApiError):
    status = 409
    type = "conflict_error"


class FileStorageFull(InvalidRequest):
    """An upload past the tenant's file storage quota: a 400, as OpenAI refuses a file
    over its limits; retrying cannot help until files are deleted."""

    default_code = "file_storage_limit_exceeded"
    retryable = False


class ContextLengthExceeded(ApiError):
    status = 400  # as OpenAI answers it: SDKs raise BadRequestError, litellm maps the code
    type = "invalid_request_error"
    default_code = "context_length_exceeded"


class RateLimited(ApiError):
    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class Cancelled(ApiError):
    status = 499
    type = "cancelled"
    default_code = "client_closed_request"


class Unavailable(ApiError):
    """Something the request needs is down for now (a 503): retrying later can help."""

    status = 503


class EngineUnavailable(Unavailable):
    default_code = "engine_unavailable"


class Overloaded(Unavailable):
    default_code = "overloaded"


class QuotaStoreUnavailable(Unavailable):
    """The quota store is down, or does not know the tenant's spend yet: retryable."""

    default_code = "quota_unavailable"


class DeadlineExceeded(ApiError):
    status = 504
    type = "timeout_error"
    default_code = "deadline_exceeded"


class InternalError(ApiError):
    default_code = "internal_error"  # ApiError's own status and type: 500, server_error


class UpstreamFailed(ApiError):
    """An OpenAI-compatible upstream failed the request (5xx, a broken stream, refused
    credentials): a bad gateway, as a proxy answers it."""

    status = 502
    default_code = "upstream_error"


class DatabaseUnavailable(Unavailable):
    """The database cannot be reached right now (a restart, a failover): retryable."""

    default_code = "database_unavailable"
