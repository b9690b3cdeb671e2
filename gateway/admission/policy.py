"""The plan's terms applied to one request: model, output length, priority."""

from __future__ import annotations

from gateway.core.errors import ContextLengthExceeded, InvalidRequest, PermissionDenied
from gateway.telemetry import current_request
from tenants.billing.prices import Quote
from tenants.services import Principal

# The opening of OpenAI's and vLLM's context-length errors, which clients match on (litellm
# raises ContextWindowExceededError, so its context_window_fallbacks fire, only on it).
CONTEXT_IS = "This model's maximum context length is {} tokens."


def check_model(principal: Principal, name: str) -> None:
    """The plan includes the model (whether it is served is the model directory's answer)."""
    if not principal.plan.allows_model(name):
        raise PermissionDenied(
            f"your plan does not include the model {name!r}",
            param="model",
            code="model_not_allowed",
        )


def check_priced(quote: Quote, model: str, registered: bool) -> None:
    """The built-in default price is the default entry's alone (so `make run` needs no
    price book): a registry model without a price of its own or a '*' one is refused,
    never served at a price nobody set."""
    if registered and quote.version_id is None:
        current_request().reject("model_not_priced")
        raise InvalidRequest(
            f"the model {model!r} has no price yet; an operator must set one "
            "(tollgate prices set) before it can be used",
            param="model",
            code="model_not_priced",
        )


def visible_models(principal: Principal, served: list[str]) -> list[str]:
    return [name for name in served if principal.plan.allows_model(name)]


def max_tokens_cap(principal: Principal) -> int | None:
    key_cap = principal.key_limits.max_tokens_per_request
    return key_cap if key_cap is not None else principal.plan.limits.max_tokens_per_request


def output_limit(
    principal: Principal, requested: int | None, prompt_tokens: int, max_model_len: int
) -> int:
    """How many tokens the request may generate: what it asked for, else all that fits,
    never more than the context has room for or the plan allows."""
    room = max_model_len - prompt_tokens
    if requested is not None and requested > room:
        current_request().reject("context_length")
        raise ContextLengthExceeded(
            f"{CONTEXT_IS.format(max_model_len)} However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the messages, "
            f"{requested} in the completion). Please reduce the length of the messages or "
            "completion.",
            param="max_tokens",
        )
    cap = max_tokens_cap(principal)
    if requested is not None and cap is not None and requested > cap:
        raise InvalidRequest(
            f"max_tokens is {requested}; your plan allows at most {cap} per request",
            param="max_tokens",
            code="max_tokens_exceeded",
        )
    limit = requested or room
    return min(limit, cap) if cap is not None else limit


def check_prompt_chars(
    chars: int, max_model_len: int, max_token_chars: int, param: str, messages: int = 0
) -> None:
    """Refuse, before tokenizing it, a prompt with more characters than max_model_len
    tokens can hold, or more chat messages than it has tokens (each takes at least one,
    its role marker): rendering and tokenizing megabytes costs seconds of CPU that a
    quota never sees."""
    if messages > max_model_len:
        current_request().reject("context_length")
        raise ContextLengthExceeded(
            f"{CONTEXT_IS.format(max_model_len)} However, you sent {messages} messages, "
            f"at least one token each. Please reduce the number of {_what(param)}.",
            param=param,
        )
    limit = max_model_len * max_token_chars
    if chars > limit:
        current_request().reject("context_length")
        raise ContextLengthExceeded(
            f"{CONTEXT_IS.format(max_model_len)} However, you sent {chars} characters in "
            f"the {_what(param)}, more than {max_model_len} tokens can hold (at most {limit} "
            f"characters). Please reduce the length of the {_what(param)}.",
            param=param,
        )


def room_for_output(prompt_tokens: int, max_model_len: int, param: str) -> int:
    room = max_model_len - prompt_tokens
    if room <= 0:
        current_request().reject("context_length")
        raise ContextLengthExceeded(
            f"{CONTEXT_IS.format(max_model_len)} However, your {_what(param)} resulted in "
            f"{prompt_tokens} tokens. Please reduce the length of the {_what(param)}.",
            param=param,
        )
    return room


def _what(param: str) -> str:
    """What the client sent, as OpenAI's context errors name it."""
    return {"prompt": "prompt", "input": "input"}.get(param, "messages")


def priority(principal: Principal, requested: int | None) -> int:
    """0 is the most urgent. A plan sets the default and the most urgent a tenant may ask for."""
    if requested is None:
        return principal.plan.default_priority
    if requested < principal.plan.max_priority:
        raise PermissionDenied(
            f"priority {requested} is more urgent than your plan allows "
            f"(at most {principal.plan.max_priority})",
            param="priority",
            code="priority_not_allowed",
        )
    return requested
