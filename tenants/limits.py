"""What a tenant may do: its plan's terms, and the limits one key may override."""

from __future__ import annotations

from dataclasses import dataclass, field

from tenants.errors import InvalidInputError
from tenants.models import LimitColumns, Plan

LIMIT_NAMES = ("rpm", "tpm", "max_concurrent", "monthly_budget_micros", "max_tokens_per_request")
LOWEST_PRIORITY = 9  # priorities run 0 (most urgent) to 9
MAX_WHOLE = 2**31 - 1  # the limit columns are 32-bit integers
MAX_BYTES = 2**50  # a byte count a plan may name (1 PiB; the column is 64-bit)
MAX_MICROS = 10**15  # a billion dollars: anything above is a typo (and near BIGINT's end)


@dataclass(frozen=True)
class LimitSet:
    """None means unlimited (on a plan) or inherit the plan's (on a key)."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    monthly_budget_micros: int | None = None
    max_tokens_per_request: int | None = None

    def __post_init__(self) -> None:
        for name in LIMIT_NAMES:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidInputError(f"{name} must be a whole number >= 0 or unset")

    @classmethod
    def of(cls, row: LimitColumns) -> LimitSet:
        return cls(**{name: getattr(row, name) for name in LIMIT_NAMES})

    def apply_to(self, row: LimitColumns) -> None:
        for name in LIMIT_NAMES:
            setattr(row, name, getattr(self, name))


@dataclass(frozen=True)
class PlanTerms:
    """A plan as admission sees it. The default (no plan) is unlimited."""

    name: str = "unlimited"
    limits: LimitSet = field(default_factory=LimitSet)
    allowed_models: frozenset[str] | None = None
    default_priority: int = 4
    max_priority: int = 0  # the most urgent priority this plan may ask for
    weight: int = 1
    max_batch_tokens: int | None = None  # worst-case tokens of unfinished batches; None: any
    max_file_bytes: int | None = None  # a tenant's stored files; None: the gateway's default

    @classmethod
    def of(cls, plan: Plan | None) -> PlanTerms:
        if plan is None:
            return cls()
        return cls(
            name=plan.name,
            limits=LimitSet.of(plan),
            allowed_models=None if plan.allowed_models is None else frozenset(plan.allowed_models),
            default_priority=plan.default_priority,
            max_priority=plan.max_priority,
            weight=plan.weight,
            max_batch_tokens=plan.max_batch_tokens,
            max_file_bytes=plan.max_file_bytes,
        )

    def allows_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


def check_priorities(default_priority: int, max_priority: int, weight: int) -> None:
    for name, value in (("default_priority", default_priority), ("max_priority", max_priority)):
        if not 0 <= value <= LOWEST_PRIORITY:
            raise InvalidInputError(f"{name} must be between 0 and {LOWEST_PRIORITY}")
    if default_priority < max_priority:
        raise InvalidInputError("default_priority cannot be more urgent (lower) than max_priority")
    if weight < 1:
        raise InvalidInputError("weight must be at least 1")
