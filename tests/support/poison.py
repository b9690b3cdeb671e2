"""Requests that once killed or stalled something, replayed by tests/e2e/test_poison.py on
the embedded default and on the stack (issue 13's standing poison suite). Each is sent
by one tenant while another tenant's ordinary request must still be served."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Poison:
    name: str
    path: str  # under /v1
    body: bytes
    statuses: tuple[int, ...]  # what the product answers; never a 500


def _chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, **extra}


def _json(body: dict[str, Any], model: str) -> bytes:
    return json.dumps({"model": model, **body}).encode()


def table(model: str, max_model_len: int) -> list[Poison]:
    chat, text = "/chat/completions", "/completions"
    refused, served = (400,), (200,)
    huge = "lorem ipsum " * 900_000  # 10.8 MB: over the body limit
    long = "x" * (max_model_len * 64)  # under the body limit, past what the context holds
    cases: list[tuple[str, str, dict[str, Any] | bytes, tuple[int, ...]]] = [
        ("seed past 2^64", chat, _chat(seed=1180591620717411303424), refused),
        ("seed 2^64-1 with n=2", chat, _chat(seed=2**64 - 1, n=2), refused),
        ("seed 2^63-1 with n=2", chat, _chat(seed=2**63 - 1, n=2), refused),
        ("largest seed for n=2", chat, _chat(seed=2**63 - 2, n=2, temperature=1), served),
        ("negative seed", chat, _chat(seed=-1), refused),
        ("max_tokens past int64", chat, _chat(max_tokens=2**70), refused),
        ("max_tokens past the context", chat, _chat(max_tokens=10**6), refused),
        ("n=16", text, {"prompt": "a", "n": 16, "max_tokens": 64}, served),
        ("n=17", chat, _chat(n=17), refused),
        ("top_k past int64", chat, _chat(top_k=2**70, temperature=1), refused),
        ("top_k past the vocabulary", chat, _chat(top_k=10**6, temperature=1), served),
        ("logit_bias at its bound", chat, _chat(logit_bias={"1": 100}), served),
        ("logit_bias past the vocabulary", chat, _chat(logit_bias={"999999999": 1}), refused),
        ("logit_bias of 301 tokens", chat, _chat(logit_bias={str(i): 1 for i in range(301)}),
         refused),
        ("logit_bias of 101", chat, _chat(logit_bias={"1": 101}), refused),
        ("logit_bias keyed by a word", chat, _chat(logit_bias={"hello": 1}), refused),
        ("min_p 1 (greedy)", chat, _chat(temperature=1, min_p=1), served),
        ("min_p past 1", chat, _chat(min_p=1.5), refused),
        ("best_of 2 (not supported)", text, {"prompt": "a", "best_of": 2}, refused),
        ("suffix (not supported)", text, {"prompt": "a", "suffix": "b"}, refused),
        ("beam search (not supported)", chat, _chat(use_beam_search=True), refused),
        ("reasoning_effort (not supported)", chat, _chat(reasoning_effort="low"), refused),
        ("allowed_token_ids (not supported)", text, {"prompt": "a", "allowed_token_ids": [1]},
         refused),
        ("prompt_logprobs (not supported)", text, {"prompt": "a", "prompt_logprobs": 1}, refused),
        ("store true (not supported)", chat, _chat(store=True), refused),
        ("audio out (not supported)", chat, _chat(modalities=["text", "audio"]), refused),
        ("unsupported fields as the server acts anyway", chat,
         _chat(store=False, modalities=["text"], use_beam_search=False, service_tier="auto"),
         served),
        ("64 stop token ids", chat, _chat(stop_token_ids=list(range(64))), served),
        ("65 stop token ids", chat, _chat(stop_token_ids=list(range(65))), refused),
        ("four 1,024-character stops", chat, _chat(stop=["q" * 1024] * 4), served),
        ("five stops", chat, _chat(stop=["a", "b", "c", "d", "e"]), refused),
        ("a 2,000-character stop", chat, _chat(stop="z" * 2000), refused),
        ("most logprobs", chat, _chat(logprobs=True, top_logprobs=20), served),
        ("too many logprobs", chat, _chat(logprobs=True, top_logprobs=21), refused),
        ("echo with logprobs", text, {"prompt": "a b c", "echo": True, "logprobs": 20}, served),
        ("penalties at their bounds", chat, _chat(repetition_penalty=100, presence_penalty=2),
         served),
        # Issue 32: positive floats that are 0 in float32 once made NaN rows, an id past the
        # vocabulary, and a failed step for every request beside them.
        ("temperature 1e-300 (0 in float32)", chat, _chat(temperature=1e-300), served),
        ("the smallest double temperature", chat, _chat(temperature=5e-324), served),
        ("top_p 1e-300", chat, _chat(temperature=1, top_p=1e-300), served),
        ("repetition_penalty 1e-300", chat, _chat(repetition_penalty=1e-300), refused),
        ("repetition_penalty at its floor", chat, _chat(repetition_penalty=0.01), served),
        ("temperature -0.0 (greedy)", chat, _chat(temperature=-0.0), served),
        ("min_tokens == max_tokens", chat, _chat(min_tokens=4, ignore_eos=False), served),
        ("a 1 ms first-token deadline", chat, _chat(ttft_deadline_ms=1), (200, 504)),
        ("token ids past the vocabulary", text, {"prompt": [10**9], "max_tokens": 2}, refused),
        ("an empty token list", text, {"prompt": [], "max_tokens": 2}, refused),
        ("an empty prompt (BOS alone)", text, {"prompt": "", "max_tokens": 2}, served),
        ("a lone surrogate", chat, _chat(messages=[{"role": "user", "content": "\ud800"}]),
         (200, 400)),
        ("NUL and controls", chat, _chat(messages=[{"role": "user", "content": "a\x00\x1b[2J"}]),
         served),
        ("10,000 combining marks", chat,
         _chat(messages=[{"role": "user", "content": "e" + "\u0301" * 10_000}]), (200, 400)),
        ("RTL override and emoji", chat,
         _chat(messages=[{"role": "user", "content": "\u202e🙂" * 200}]), served),
        ("1,000 messages", chat,
         _chat(messages=[{"role": "user", "content": "hi"}] * 1000), (200, 400)),
        # Issue 32: no content characters, but each message takes a token of the context;
        # rendered and tokenized on the event loop, they held every tenant 1.3 s.
        ("100,000 empty messages", chat,
         _chat(messages=[{"role": "user", "content": None}] * 100_000), refused),
        ("100,000 empty Responses inputs", "/responses",
         {"input": [{"role": "user", "content": ""}] * 100_000, "max_output_tokens": 4},
         refused),
        ("a prompt the context cannot hold", text, {"prompt": long, "max_tokens": 2}, refused),
        ("a 10.8 MB prompt", text, {"prompt": huge, "max_tokens": 2}, (413,)),
        ("JSON nested 1,000 deep", chat, b"[" * 1000 + b"]" * 1000, refused),
    ]  # fmt: skip
    return [
        Poison(name, path, body if isinstance(body, bytes) else _json(body, model), statuses)
        for name, path, body, statuses in cases
    ]
