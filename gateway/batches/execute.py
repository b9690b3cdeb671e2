"""What the batch runner knows of one line's run: the runner that answers it (its outcome:
tenants.batches.LineOutcome), the refusal that makes it run later, and the engine class
it runs at. The run itself goes through the same path as the request it stands for
(gateway/api/batch_lines.py, given to the runner by the app)."""

from __future__ import annotations

import math
from collections.abc import Awaitable
from typing import Any, Protocol

from backend import EngineConfig
from tenants.batches import LineOutcome
from tenants.services import Principal

RETRY_STATUSES = frozenset({409, 429, 499, 503})  # busy, not wrong: the line runs later


class Retry(Exception):
    """The line could not start now (the engine is busy, a rate limit): run it later."""


class LineRunner(Protocol):
    """Runs one line as the request it stands for; raises Retry when it cannot start now."""

    def __call__(
        self, principal: Principal, endpoint: str, body: dict[str, Any], key: str, priority: int
    ) -> Awaitable[LineOutcome]: ...


def batch_priority(config: EngineConfig, seconds_left: float) -> int:
    """The engine class of a line: below every interactive class, aging toward the batch
    class's floor exactly as the window closes (the engine raises a waiting request one
    class per aging interval), so batch work is ranked by its deadline and never above
    interactive work."""
    aging = config.aging_interval_s or 5.0
    return config.batch_priority + max(0, math.ceil(seconds_left / aging))
