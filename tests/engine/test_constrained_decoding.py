"""Structured outputs by constrained decoding, on the built-in model (random-ish weights
that would never write JSON by themselves): every constrained output obeys its
constraint, unconstrained neighbours in the batch are untouched, and a constraint that
cannot be enforced is refused when it is submitted."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator

import jsonschema
import msgspec
import pytest
import torch

from backend.builtin import BUILTIN_MODEL_DIR
from backend.config import EngineConfig
from backend.constraint import Constraint
from backend.engine.async_engine import AsyncEngine
from backend.engine.engine import Engine
from backend.errors import ConstraintError, RequestFailedError
from backend.grammar import GrammarCompiler
from backend.layers.sampler import apply_token_bitmask
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from backend.server import create_backend_app
from backend.tokenizer import Tokenizer
from backend.wire import GenerateBody
from gateway.core.errors import InvalidRequest
from gateway.dispatch.engine_client import GenerateRequest
from gateway.dispatch.remote import RemoteEngineClient
from tests.conftest import serving
from tests.engine.engine_support import run_to_completion, text_of, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}
# Enough for the longest output the schema allows (every character a \uXXXX escape).
SCHEMA_MAX_TOKENS = 256
CONFIG = EngineConfig(num_kv_blocks=1024, max_model_len=512, max_num_seqs=64)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(BUILTIN_MODEL_DIR, CONFIG)


def generate(
    engine: Engine, prompt: str, constraint: Constraint | None, seeds: range, **params: object
) -> list[tuple[str, str | None]]:
    """(text, finish_reason) of every completion, the requests run in one batch."""
    for seed in seeds:
        sampling = SamplingParams(seed=seed, constraint=constraint, **params)  # type: ignore[arg-type]
        engine.add_request(EngineRequest(prompt, sampling, f"r{seed}"))
    results = []
    for outputs in run_to_completion(engine).values():
        for index in sorted({o.index for o in outputs}):
            mine = [o for o in outputs if o.index == index]
            results.append((text_of(mine), mine[-1].finish_reason))
    assert len(results) == len(seeds) * int(params.get("n", 1))  # type: ignore[call-overload]
    return results


def test_json_schema_outputs_parse_and_validate_for_50_seeds(engine: Engine) -> None:
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    results = generate(engine, "A person:", constraint, range(50), max_tokens=SCHEMA_MAX_TOKENS)
    for text, reason in results:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in results}) > 40  # sampled, not one answer repeated


def test_json_object_gives_a_json_object(engine: Engine) -> None:
    """Greedy, from prompts that start other JSON. Whether the tiny model closes its object
    within max_tokens is its own affair (on a set-up of 2026-12-04 it wrote one endless key
    from '{"a": 1}', where earlier set-ups closed it): every completion opens an object,
    every one that stops is one, and most stop."""
    prompts = ['{"a": 1}', '[{"": ""}]', "{}", "A JSON object:"]
    stopped = 0
    for prompt in prompts:
        [(text, reason)] = generate(
            engine, prompt, Constraint("json_object"), range(1), max_tokens=128, temperature=0
        )
        assert text.startswith("{"), (prompt, text)
        if reason == "stop":
            assert isinstance(json.loads(text), dict), (prompt, text)
            stopped += 1
        else:
            assert reason == "length", (prompt, reason)
    assert stopped >= len(prompts) - 1


def test_regex_choice_and_grammar_are_obeyed_by_every_completion(engine: Engine) -> None:
    cases = [
        (Constraint("regex", r"[0-9]{3}-[a-z]{2,5}"), r"[0-9]{3}-[a-z]{2,5}"),
        (Constraint("choice", json.dumps(["yes", "no", "perhaps"])), r"yes|no|perhaps"),
        (Constraint("grammar", 'start: "SELECT " COL " FROM t"\nCOL: /[a-z]{1,8}/'), None),
        (Constraint("grammar", 'root ::= "(" [0-9]+ ")"'), r"\([0-9]+\)"),  # GBNF
    ]
    for constraint, pattern in cases:
        # n=2: each completion has its own matcher.
        results = generate(engine, "Answer:", constraint, range(6), max_tokens=24, n=2)
        for text, reason in results:
            assert reason == "stop", (constraint, text)
            assert re.fullmatch(pattern or r"SELECT [a-z]{1,8} FROM t", text), (constraint, text)


def test_an_unconstrained_request_is_unchanged_beside_a_constrained_one(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("The engine", greedy, "alone"))
    alone = tokens_of(run_to_completion(engine)["alone"])
    engine.add_request(EngineRequest("The engine", greedy, "plain"))
    constrained = Constraint("json_schema", json.dumps(SCHEMA))
    for key, temperature in (("json", 1.0), ("json_greedy", 0.0)):
        params = SamplingParams(SCHEMA_MAX_TOKENS, temperature, constraint=constrained)
        engine.add_request(EngineRequest("The engine", params, key))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["plain"]) == alone
    for key in ("json", "json_greedy"):
        jsonschema.validate(json.loads(text_of(outputs[key])), SCHEMA)


def test_a_batch_without_a_constrained_request_builds_no_mask(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_masks(*_: object) -> None:
        raise AssertionError("a mask was built for an unconstrained batch")

    monkeypatch.setattr("backend.engine.model_runner.fill_bitmasks", no_masks)
    monkeypatch.setattr("backend.engine.model_runner.apply_token_bitmask", no_masks)
    engine.add_request(
        EngineRequest("The engine", SamplingParams(max_tokens=8, n=2, logprobs=2), "plain")
    )
    outputs = run_to_completion(engine)["plain"]
    assert sum(len(o.token_ids) for o in outputs) > 0 and all(o.error is None for o in outputs)


def test_logprobs_are_of_the_masked_distribution(engine: Engine) -> None:
    params = SamplingParams(
        max_tokens=4, logprobs=5, constraint=Constraint("regex", "[ab]"), seed=1
    )
    engine.add_request(EngineRequest("Pick:", params, "lp"))
    [out] = run_to_completion(engine)["lp"]
    [lp] = out.logprobs or []
    allowed = [(t, p) for t, p in lp.top if p > -1e30]  # masked tokens: the lowest logit
    assert {engine.tokenizer.decode([t]) for t, _ in allowed} <= {"a", "b"}
    assert math.isclose(sum(math.exp(p) for _, p in allowed), 1.0, rel_tol=1e-4)
    assert all(math.isfinite(p) for _, p in lp.top)  # JSON can carry them
    assert lp.rank <= len(allowed) and out.text in ("a", "b")


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        (Constraint("json_schema", '{"type": "object", "if": {}, "then": {}}'), '"if"'),
        (Constraint("json_schema", '{"type": "string", "format": "colour"}'), "colour"),
        (Constraint("json_schema", '{"type": "object"'), "not valid JSON"),
        (Constraint("json_schema", "[1, 2]"), "must be a JSON object"),
        (Constraint("regex", "(a|b"), "not a valid regular expression"),
        (Constraint("choice", '["yes", 3]'), "list of strings"),
        (Constraint("choice", "[]"), "list of strings"),
        (Constraint("grammar", "start: undefined_rule"), "undefined_rule"),
    ],
)
def test_a_constraint_that_cannot_be_enforced_is_refused_at_submission(
    engine: Engine, constraint: Constraint, named: str
) -> None:
    with pytest.raises(ConstraintError, match=re.escape(named)) as caught:
        engine.add_request(EngineRequest("x", SamplingParams(constraint=constraint), "bad"))
    assert caught.value.param == "response_format"
    assert caught.value.args[0].startswith("response_format ")  # the field, in own words
    assert not engine.has_work()


def test_a_constraint_of_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ConstraintError, match="kind must be one of"):
        Constraint("xml")  # type: ignore[arg-type]


def test_compiled_grammars_are_kept_by_kind_and_spec_least_recently_used_dropped() -> None:
    tok = Tokenizer(BUILTIN_MODEL_DIR)
    compiler = GrammarCompiler(BUILTIN_MODEL_DIR / "tokenizer.json", 4096, tok.eos_token_ids, 2)
    a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    compiler.matcher(a)
    compiler.matcher(b)
    compiler.matcher(a)  # a hit: a becomes the most recently used
    compiler.matcher(c)
    assert compiler.cached() == [("", "regex", "a+"), ("", "regex", "c+")]
    # Matchers from one compiled grammar do not share their state.
    [a_id], [b_id] = (tok.encode(t, add_special_tokens=False) for t in "ab")
    ab = Constraint("regex", "ab")
    first, second = compiler.matcher(ab), compiler.matcher(ab)
    assert first.advance(a_id) is False and second.advance(a_id) is False
    assert first.advance(b_id) is True
    with pytest.raises(RequestFailedError, match="outside the request's grammar"):
        second.advance(a_id)


def _devices() -> Iterator[str]:
    yield "cpu"
    if torch.cuda.is_available():
        yield "cuda"


@pytest.mark.parametrize("device", list(_devices()))
def test_the_bitmask_masks_only_its_rows_and_only_disallowed_tokens(device: str) -> None:
    logits = torch.randn(3, 70, device=device)
    before = logits.clone()
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5 | -(1 << 31)  # tokens 5 and 31 (the sign bit)
    bitmask[0, 2] = 1 << 1  # token 65
    apply_token_bitmask(logits, torch.tensor([1], device=device), bitmask.to(device))
    allowed = logits[1] > torch.finfo(logits.dtype).min
    assert allowed.nonzero().flatten().tolist() == [5, 31, 65]
    assert torch.equal(logits[1][allowed], before[1][allowed])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])


def test_the_constraint_travels_over_the_replica_wire() -> None:
    params = SamplingParams(constraint=Constraint("regex", "[0-9]+"))
    body = msgspec.json.encode({"request_id": "r", "prompt": [1], "params": params})
    assert msgspec.json.decode(body, type=GenerateBody).params == params
    bad = body.replace(b'"regex"', b'"xml"')
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(bad, type=GenerateBody)


async def test_a_replica_enforces_the_constraint_and_names_a_bad_one() -> None:
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, CONFIG)
    app = create_backend_app(engine, BUILTIN_MODEL_DIR, secret="s3cret")
    async with serving(app) as url:
        client = RemoteEngineClient([url], "s3cret", engine.engine.tokenizer, "m", 512)
        try:
            prompt = client.encode("Digits:")
            params = SamplingParams(max_tokens=16, constraint=Constraint("regex", "[0-9]{4}"))
            outs = [out async for out in client.generate(GenerateRequest(prompt, params, "ok"))]
            assert re.fullmatch("[0-9]{4}", text_of(outs)) and outs[-1].finish_reason == "stop"
            bad = SamplingParams(constraint=Constraint("regex", "(unclosed"))
            with pytest.raises(InvalidRequest, match="is not a valid regular expression") as e:
                async for _ in client.generate(GenerateRequest(prompt, bad, "bad")):
                    pass
            assert e.value.param == "response_format"
        finally:
            await client.close()
