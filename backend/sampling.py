"""Per-request sampling parameters (pure data; the torch sampler is layers/sampler.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from backend.constraint import Constraint
from backend.errors import InvalidParameterError

MAX_N = 16
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # torch generators take any int64 >= 0; choice i uses seed + i
MAX_COUNT = 2**31 - 1  # bound for token counts and top_k: they become int32/int64 tensors
# The sampler divides float32 logits by the temperature and the repetition penalty: a
# positive value far below these floors rounds to 0 in float32 (1e-300 does) and turns a
# row into NaN. A temperature in (0, MIN_TEMPERATURE) is raised to it (as vLLM does: it
# is all but greedy there), and one above MAX_TEMPERATURE lowered to it (the row is
# uniform long before); a repetition penalty must lie in [MIN_PENALTY, MAX_PENALTY].
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 1e4
MIN_PENALTY = 1e-2
MAX_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS_ENTRIES = 300


@dataclass(frozen=True)
class SamplingParams:
    """temperature == 0 means greedy; a positive one is kept within [MIN_TEMPERATURE,
    MAX_TEMPERATURE] (the float32 sampler's range). top_k == 0 and top_p == 1 switch
    those filters off.
    A `seed` gives the request its own generator, so its tokens do not depend on what else
    is in the batch. Stop strings are cut from the output text; stop tokens end it too.

    `n` completions share the prompt's KV blocks; completion i draws with seed + i.
    `logprobs` (0..MAX_LOGPROBS) adds each sampled token's logprob and that many
    alternatives; None leaves them out.

    Penalties (off at their defaults) discourage repeats: `repetition_penalty` (vLLM's,
    in [0.01, 100]) divides a positive logit, or multiplies a negative one, of every token
    already in the prompt or the output; `presence_penalty` and `frequency_penalty` (OpenAI's, in
    [-2, 2]) subtract once per token seen in the output and once per occurrence there.
    `min_tokens` keeps EOS, stop tokens and stop strings from ending the output before it
    has that many tokens.

    `logit_bias` (OpenAI's) adds its value, in [-100, 100], to its token's logit before
    anything else, greedy rows included; `min_p` (vLLM's, 0 = off) drops the tokens less
    likely than min_p times the most likely one, after the temperature.

    `constraint` (structured outputs) masks every token that would leave its grammar;
    the request stops once the grammar is complete (see backend/grammar.py)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_COUNT:
            raise InvalidParameterError(
                f"max_tokens must be an integer in [1, {MAX_COUNT}], got {self.max_tokens!r}",
                "max_tokens",
            )
        if not _is_real(self.temperature) or self.temperature < 0:
            raise InvalidParameterError(
                f"temperature must be a number >= 0, got {self.temperature!r}", "temperature"
            )
        if self.temperature:
            bounded = min(max(self.temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)
            object.__setattr__(self, "temperature", bounded)  # frozen: set once, here
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_COUNT:
            raise InvalidParameterError(
                f"top_k must be an integer in [0, {MAX_COUNT}] (0 = off), got {self.top_k!r}",
                "top_k",
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameterError(
                f"stop must be a list of non-empty strings, got {self.stop!r}", "stop"
            )
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= MAX_COUNT for t in ids):
            raise InvalidParameterError(
                f"stop_token_ids must be a list of token ids >= 0, got {ids!r}", "stop_token_ids"
            )
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidParameterError(
                f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n"
            )
        self._check_seed()
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise InvalidParameterError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {lp!r}",
                "logprobs",
            )
        self._check_penalties()

    def _check_seed(self) -> None:
        """Every choice's seed (seed + i for choice i) must be a valid generator seed."""
        seed = self.seed
        if seed is None:
            return
        highest = MAX_SEED - (self.n - 1)
        if not _is_int(seed) or not 0 <= seed <= highest:
            raise InvalidParameterError(
                f"seed must be an integer in [0, {highest}] (2^63 - n), got {seed!r}", "seed"
            )

    def _check_penalties(self) -> None:
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParameterError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}",
                "min_tokens",
            )
        rp = self.repetition_penalty
        if not _is_real(rp) or not MIN_PENALTY <= rp <= MAX_PENALTY:
            raise InvalidParameterError(
                f"repetition_penalty must be a number in [{MIN_PENALTY}, {MAX_PENALTY}], "
                f"got {rp!r}",
                "repetition_penalty",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise InvalidParameterError(
                    f"{name} must be a number in [-2, 2], got {value!r}", name
                )
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidParameterError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidParameterError(
                f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases",
                "logit_bias",
            )
        for token, value in bias.items():
            if not _is_int(token) or not 0 <= token <= MAX_COUNT:
                raise InvalidParameterError(
                    f"logit_bias keys must be token ids, got {token!r}", "logit_bias"
                )
            if not _is_real(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise InvalidParameterError(
                    f"logit_bias values must be numbers in [-100, 100], got {value!r}",
                    "logit_bias",
                )

    @property
    def penalized(self) -> bool:
        """Whether the sampler must look at this request's history."""
        return (
            self.repetition_penalty != 1
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
