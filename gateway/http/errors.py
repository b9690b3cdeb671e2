"""How the app answers each error, in the OpenAI error shape (`{"error": {...}}`): the
gateway's typed errors (gateway/core/errors.py), the domain's, Litestar's own and the
stores' outages."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap
from redis import exceptions as redis_errors
from sqlalchemy.exc import DataError, IntegrityError, InterfaceError, OperationalError

from gateway.core.errors import (
    ApiError,
    AuthenticationFailed,
    Cancelled,
    Conflict,
    DatabaseUnavailable,
    FileStorageFull,
    InternalError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    QuotaStoreUnavailable,
)
from tenants.errors import ConflictError, DomainError, InvalidInputError, NotFoundError
from tenants.files import StorageFull

log = logging.getLogger(__name__)


def error_response(error: ApiError) -> Response[bytes]:
    return Response(
        content=msgspec.json.encode(error.body()),
        status_code=error.status,
        media_type=MediaType.JSON,
        headers=error.headers,
    )


def handle_api_error(_: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    return error_response(exc if isinstance(exc, ApiError) else InternalError("internal error"))


DOMAIN_ERRORS: dict[type[Exception], type[ApiError]] = {
    NotFoundError: NotFound,
    ConflictError: Conflict,
    InvalidInputError: InvalidRequest,
    StorageFull: FileStorageFull,
}


def handle_domain_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """The nearest mapped class in the error's MRO, so a subclass (ExportBusy is a
    ConflictError) keeps its meaning; a domain error of no mapped kind is a defect."""
    mapped = next((DOMAIN_ERRORS[c] for c in type(exc).__mro__ if c in DOMAIN_ERRORS), None)
    if mapped is None:
        return handle_unexpected(request, exc)
    return error_response(mapped(str(exc), param=getattr(exc, "param", None)))


# What Litestar raises (as a 500) when the client leaves while its body is being read.
CLIENT_LEFT_DETAIL = "client disconnected prematurely"
# Litestar's own client errors that have no class here, by the code OpenAI would give.
HTTP_CODES = {405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


def handle_http_exception(_: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Litestar's own errors (404 route, 405 method, 413 body, 400 parse) in the OpenAI
    shape; a client that left mid-upload is a 499, not a failure of ours."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    if status == 500 and detail == CLIENT_LEFT_DETAIL:
        return error_response(Cancelled("the client closed the connection"))
    kinds = {400: InvalidRequest, 401: AuthenticationFailed, 403: PermissionDenied, 404: NotFound}
    kind = kinds.get(status, InvalidRequest if status < 500 else InternalError)
    error = kind(detail, code=HTTP_CODES.get(status))
    response = error_response(error)
    response.status_code = status
    return response


def handle_too_deep(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """msgspec refuses JSON nested deeper than the interpreter's recursion limit with a
    RecursionError, not a DecodeError: the client's body, not a defect of ours."""
    log.warning("RecursionError on %s (a body nested too deeply?)", request.url.path)
    return error_response(InvalidRequest("request body is nested too deeply"))


def handle_unstorable(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """The database refused a value the request carried (PostgreSQL: a NUL character in
    text, a string longer than its column, a number out of range): the client's input."""
    log.warning("%s on %s: the database refused a value", type(exc).__name__, request.url.path)
    return error_response(
        InvalidRequest("a value in the request cannot be stored (too long, out of range or NUL)")
    )


def handle_integrity(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """A unique index refused a row whose name a concurrent request took between the
    service's check and its write (two admins adding one tenant, plan, model or adapter):
    the 409 the check gives when they do not overlap. Any other violation is a defect."""
    if not _is_unique_violation(exc):
        return handle_unexpected(request, exc)
    log.info("unique violation on %s: a concurrent request took the name", request.url.path)
    return error_response(Conflict("the name is taken (by a concurrent request)"))


def _is_unique_violation(exc: Exception) -> bool:
    cause = getattr(exc, "orig", None)
    return getattr(cause, "sqlstate", None) == "23505" or str(cause).startswith(
        "UNIQUE constraint failed"  # SQLite's words: it has no SQLSTATE
    )


def handle_store_down(_: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Redis (locks, idempotency) unreachable: retryable, not a defect."""
    log.warning("shared store unreachable: %s", exc)
    error = QuotaStoreUnavailable(
        "a shared store is unavailable; retry shortly",
        code="store_unavailable",
        headers={"Retry-After": "1"},
    )
    return error_response(error)


def handle_database_down(_: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """A lost or refused database connection is an outage to retry, not a defect."""
    log.warning("database unreachable: %s", type(exc).__name__)
    error = DatabaseUnavailable(
        "the database is unavailable; retry shortly", headers={"Retry-After": "1"}
    )
    return error_response(error)


def handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    # A defect: never echo internals (they may hold prompt text) to the client.
    log.error("unhandled %s on %s", type(exc).__name__, request.url.path, exc_info=exc)
    return error_response(InternalError("internal error"))


def exception_handlers() -> ExceptionHandlersMap:
    """How the app answers each error, by class: Litestar takes the nearest in the MRO,
    so anything not named here (a stray ValueError included) is a logged 500."""
    return {
        ApiError: handle_api_error,
        redis_errors.ConnectionError: handle_store_down,  # locks, idempotency
        redis_errors.TimeoutError: handle_store_down,
        DomainError: handle_domain_error,
        HTTPException: handle_http_exception,
        RecursionError: handle_too_deep,
        DataError: handle_unstorable,  # SQLSTATE class 22: a value, not the statement
        IntegrityError: handle_integrity,  # a name taken by a concurrent request
        OperationalError: handle_database_down,  # connection lost or refused
        InterfaceError: handle_database_down,
        Exception: handle_unexpected,
    }
