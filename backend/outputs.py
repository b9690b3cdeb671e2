"""What the engine hands back: one RequestOutput per request per step, and stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """A delta: `text` and `token_ids` are new since the previous output of this request.
    Times are time.monotonic() seconds."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"; None until finished
    prompt_tokens: int
    completion_tokens: int  # cumulative
    cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None  # queue time = this - arrival_time
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per id in token_ids


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    block_size: int
    num_steps: int
