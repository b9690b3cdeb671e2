"""Errors the business domain raises on purpose; the gateway maps each to its HTTP status.

`TenantsError` is the layer's root. `DomainError` is the part the caller can act on
(what was asked for does not exist, conflicts, or is invalid): the admin API, the console
and the CLI show its message. The others are the layer's own failures (the quota store,
Stripe), handled where they happen; one that escapes is a 500."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class TenantsError(Exception):
    """Root of every error tenants/ raises on purpose."""


class DomainError(TenantsError):
    """The caller's request cannot be done as asked; the message says why, and `param`
    names the field at fault where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NotFoundError(DomainError):
    pass


def found(row: T | None, missing: str) -> T:
    """`row`, or NotFoundError(`missing`) when a lookup found none."""
    if row is None:
        raise NotFoundError(missing)
    return row


class ConflictError(DomainError):
    pass


class InvalidInputError(DomainError):
    pass
