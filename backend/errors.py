"""Typed errors the engine raises; the gateway maps them to HTTP responses."""

from __future__ import annotations

from pathlib import Path


class EngineError(Exception):
    """Base class for every error raised by the backend."""


class CheckpointError(EngineError):
    """A checkpoint folder cannot be loaded; names the file and the problem."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


class InvalidParameterError(EngineError, ValueError):
    """A request parameter the engine cannot take (a sampling setting out of range, a
    prompt it cannot run): the caller's input, which the gateway answers with a 400
    naming `param`. A ValueError too, for callers of the engine's Python API; the gateway
    maps this type alone, so a ValueError from a defect stays a 500."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidParameterError):
    """The prompt does not fit the model's context (OpenAI: context_length_exceeded)."""

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"prompt has {prompt_tokens} tokens; max_model_len is {max_model_len} "
            "and at least one token must be generated",
            param="prompt",
        )
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len


class EngineDeadError(EngineError):
    """The step loop has stopped (shutdown or a crash); no request can be served."""


class OverloadedError(EngineError):
    """The waiting queue is full (by requests or by queued prompt tokens): the request is
    shed before it is queued. `retry_after_s` estimates when the queue will have drained."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(EngineError):
    """The request's first token cannot be produced by its deadline (estimated from the
    measured prefill throughput), so it is rejected before any compute is spent on it."""

    kind = "deadline_exceeded"


class RequestFailedError(EngineError):
    """The engine failed this request while stepping it (a fault in its own parameters or
    state, or a step that failed as a whole) and went on serving the others."""

    kind = "request_failed"


class GrammarTooComplexError(RequestFailedError):
    """A constraint's grammar needs more parser work for the next token than llguidance
    allows (a right-recursive rule grows with the output; an object of hundreds of
    optional properties): the client's grammar is at fault, not the engine. The request
    fails alone, and the gateway answers 400 on the constraint's field."""

    kind = "grammar_too_complex"


class RequestStepError(EngineError):
    """Raised inside a step by per-request work (e.g. seeding a request's generator):
    only `request_ids` are at fault, so only they fail and the step runs again without
    them."""

    def __init__(self, request_ids: list[str], problem: str) -> None:
        super().__init__(f"{len(request_ids)} request(s) failed in a step: {problem}")
        self.request_ids = request_ids


class ConstraintError(InvalidParameterError):
    """A structured-output constraint cannot be enforced: a bad regex or grammar, or a JSON
    schema feature the grammar library does not implement (the message names it). Raised
    when the request is submitted, never mid-step; OpenAI answers 400 on `param`.
    `problem`: the message without the field it names (kept to refuse the same grammar
    again, whichever field it comes in)."""

    def __init__(
        self, message: str, param: str | None = "response_format", problem: str | None = None
    ) -> None:
        super().__init__(message, param)
        self.problem = problem or message


class LoRAError(InvalidParameterError):
    """A request's LoRA adapter cannot be served: the caller's choice (`param` "model")."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class UnknownAdapterError(LoRAError):
    """The adapter's folder is missing or is not a PEFT LoRA adapter this engine can load
    (the message says which file or field)."""


class AdapterRankError(LoRAError):
    """The adapter's rank is above the engine's max_lora_rank."""
