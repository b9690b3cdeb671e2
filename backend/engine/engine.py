"""The synchronous engine: step() = admit -> schedule -> run -> sample -> update.

add_request() and abort() may be called from any thread; everything else runs on the one
thread that calls step(). New requests and aborts wait in an inbox until a step boundary."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from backend.config import EngineConfig
from backend.engine.block_manager import BlockManager
from backend.engine.model_runner import ModelRunner
from backend.engine.request import Request, RequestStatus
from backend.engine.scheduler import Scheduler
from backend.errors import PromptTooLongError
from backend.loader import load_model_config
from backend.outputs import EngineStats, RequestOutput
from backend.sampling import SamplingParams
from backend.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Live:
    """A request between add_request and its final output, with its text state."""

    request: Request
    detok: IncrementalDetokenizer
    text: str = ""  # all output text so far (cut at a stop string)
    sent: int = 0  # characters of `text` already handed out


class Engine:
    def __init__(self, model_dir: Path | str, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.max_model_len = min(
            config.max_model_len or config.max_num_batched_tokens,
            self.model_config.max_position_embeddings,
        )
        self.runner = ModelRunner(self.model_dir, self.model_config, config, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size)
        if self.block_manager.blocks_for(self.max_model_len) > self.block_manager.num_blocks:
            raise ValueError(
                f"the KV pool has {self.block_manager.num_blocks} blocks of {config.block_size} "
                f"tokens, too few for one sequence of max_model_len={self.max_model_len}"
            )
        self.scheduler = Scheduler(config, self.block_manager)
        self.num_steps = 0
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: list[Request] = []
        self._live: dict[str, _Live] = {}

    # -- any thread ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
        tenant: str | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError (PromptTooLongError for a prompt
        that does not fit) in the caller's thread."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt)
        req = Request(
            request_id,
            ids,
            params,
            min(len(ids) + params.max_tokens, self.max_model_len),
            priority=priority,
            deadline=deadline,
            tenant=tenant,
        )
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in the engine")
            self._live[request_id] = _Live(req, IncrementalDetokenizer(self.tokenizer, ids))
            self._inbox.append(req)

    def abort(self, request_id: str) -> None:
        """Idempotent; takes effect at the next step boundary. Unknown or finished ids are
        ignored. The abort is bound to the request live now, not to a later one reusing the id."""
        with self._lock:
            live = self._live.get(request_id)
            if live is not None:
                self._aborts.append(live.request)

    def has_work(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        return pending or self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._inbox),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            block_size=bm.block_size,
            num_steps=self.num_steps,
        )

    # -- the step thread ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for req in inbox:
            self.scheduler.add_request(req)
        outputs = self._apply_aborts()
        batch = self.scheduler.schedule()
        result = self.runner.execute(batch)
        if not batch.requests:
            return outputs
        # Aborts that arrived during the forward pass win over its tokens.
        outputs += self._apply_aborts()
        for req, token in self.scheduler.update_from_output(batch, result):
            outputs.append(self._process_token(req, token))
        self.num_steps += 1
        return outputs

    def _apply_aborts(self) -> list[RequestOutput]:
        with self._lock:
            reqs, self._aborts = self._aborts, []
        live = self.scheduler.requests
        ids = [r.request_id for r in reqs if live.get(r.request_id) is r]
        done = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return [self._finish(req, "", [], []) for req in done]

    def _process_token(self, req: Request, token: int) -> RequestOutput:
        now = time.monotonic()
        if req.first_token_time is None:
            req.first_token_time = now
        state = self._live[req.request_id]
        status = self._stop_status(req, token)
        old_len = len(state.text)
        if status != RequestStatus.FINISHED_STOPPED:  # a stop token's text is never shown
            state.text += state.detok.step(token)
        if status is not None:
            state.text += state.detok.flush()
        stops = req.params.stop
        if stops:
            cut = _find_stop(state.text, stops, old_len)
            if cut is not None:
                state.text, status = state.text[:cut], RequestStatus.FINISHED_STOPPED
        # Hold back a tail that could still become a stop string.
        hold = 0 if status is not None or not stops else max(map(len, stops)) - 1
        end = max(len(state.text) - hold, state.sent)
        delta, state.sent = state.text[state.sent : end], end
        if status is None:
            return self._output(req, delta, [token], [now])
        self.scheduler.finish_requests([req.request_id], status)
        return self._finish(req, delta, [token], [now])

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        is_eos = not p.ignore_eos and token in self.tokenizer.eos_token_ids
        if is_eos or token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= req.max_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(
        self, req: Request, text: str, token_ids: list[int], times: list[float]
    ) -> RequestOutput:
        with self._lock:
            self._live.pop(req.request_id, None)
        return self._output(req, text, token_ids, times)

    def _output(
        self, req: Request, text: str, token_ids: list[int], times: list[float]
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            text=text,
            token_ids=token_ids,
            finished=req.is_finished,
            finish_reason=req.status.finish_reason,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=len(req.output_token_ids),
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            token_times=times,
        )

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        return ids


def _find_stop(text: str, stops: list[str], old_len: int) -> int | None:
    """Start of the earliest stop string that ends in the new part of `text`."""
    longest = max(map(len, stops))
    start = max(old_len - longest + 1, 0)
    hits = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(hits) if hits else None
