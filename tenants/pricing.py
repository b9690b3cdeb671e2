"""Token prices in integer micro-units of currency per million tokens.

The built-in default prices every model the versioned price book
(tenants/billing/prices.py) has no version for.
Integer arithmetic throughout: money is never a float.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKENS_PER_UNIT = 1_000_000


@dataclass(frozen=True)
class Price:
    input_micros_per_mtok: int
    cached_input_micros_per_mtok: int
    output_micros_per_mtok: int
    batch_discount_pct: int = 50  # off every token of a batch line (the Batch API)

    def for_batch(self) -> Price:
        """The price of a batch line: the discount off each rate, rounded down."""
        keep = 100 - self.batch_discount_pct
        return Price(
            self.input_micros_per_mtok * keep // 100,
            self.cached_input_micros_per_mtok * keep // 100,
            self.output_micros_per_mtok * keep // 100,
            self.batch_discount_pct,
        )

    def cost_micros(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """Cost rounded up to a whole micro-unit, so nothing is given away by rounding."""
        uncached = prompt_tokens - cached_tokens
        numerator = (
            uncached * self.input_micros_per_mtok
            + cached_tokens * self.cached_input_micros_per_mtok
            + completion_tokens * self.output_micros_per_mtok
        )
        return -(-numerator // TOKENS_PER_UNIT)


# $0.10 / $0.05 / $0.40 per million input / cached input / output tokens.
DEFAULT_PRICE = Price(100_000, 50_000, 400_000)
