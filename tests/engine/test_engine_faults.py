"""A fault inside a step fails only the request at fault; the step loop goes on serving
everyone else. Only repeated step failures with no request to blame end the engine, and
then its liveness says so (issue 13, finding 1)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from backend import AsyncEngine, EngineDeadError
from backend.engine.batch import ModelRunnerOutput, SchedulerOutput
from backend.engine.engine import MAX_FAILED_STEPS, Engine
from backend.errors import RequestFailedError
from backend.requests import EngineRequest
from backend.sampling import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams
from tests.engine.engine_support import check_blocks, make_engine, run_to_completion, tokens_of

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def unvalidated_seed(seed: int) -> SamplingParams:
    """Params with a seed no generator takes, as if validation had missed it."""
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1)
    object.__setattr__(params, "seed", seed)
    return params


def test_sampling_params_bound_every_choice_seed() -> None:
    SamplingParams(seed=MAX_SEED)
    SamplingParams(seed=MAX_SEED - 1, n=2)
    for seed, n in ((MAX_SEED + 1, 1), (MAX_SEED, 2), (2**64 - 1, 2), (-1, 1), (2**70, 1)):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed, n=n)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**70)


def test_a_bad_seed_fails_only_its_request(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    engine.add_request(EngineRequest("the quick brown fox", GREEDY, "good"))
    engine.add_request(EngineRequest("the quick brown fox", unvalidated_seed(2**64), "poison"))
    outputs = run_to_completion(engine)
    assert outputs["poison"][-1].error == RequestFailedError.kind
    assert outputs["poison"][-1].finished
    assert len(tokens_of(outputs["good"])) == GREEDY.max_tokens
    assert outputs["good"][-1].error is None
    alone = make_engine(llama_dir)
    alone.add_request(EngineRequest("the quick brown fox", GREEDY, "good"))
    assert tokens_of(run_to_completion(alone)["good"]) == tokens_of(outputs["good"])
    assert engine.num_failed_requests == 1
    check_blocks(engine)


def failing_steps(engine: Engine, count: int) -> Callable[[SchedulerOutput], ModelRunnerOutput]:
    """Make the next `count` non-empty forward passes raise, as an engine defect would."""
    execute = engine.runner.execute
    left = [count]

    def flaky(batch: SchedulerOutput) -> ModelRunnerOutput:
        if batch.requests and left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected step failure")
        return execute(batch)

    return flaky


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(llama_dir)
    # Three failures: the batch of two, then each of them run alone.
    monkeypatch.setattr(engine.runner, "execute", failing_steps(engine, 3))
    engine.add_request(EngineRequest("hello there", GREEDY, "a"))
    engine.add_request(EngineRequest("general kenobi", GREEDY, "b"))
    first = run_to_completion(engine)
    assert {first[r][-1].error for r in ("a", "b")} == {RequestFailedError.kind}
    check_blocks(engine)
    engine.add_request(EngineRequest("hello there", GREEDY, "after"))
    after = run_to_completion(engine)["after"]
    assert after[-1].error is None and len(tokens_of(after)) == GREEDY.max_tokens


def poisoned_by(engine: Engine, culprit: str) -> Callable[[SchedulerOutput], ModelRunnerOutput]:
    """Every forward pass that holds `culprit` raises an error that names no request, as a
    bad value reaching a kernel would."""
    execute = engine.runner.execute

    def poisoned(batch: SchedulerOutput) -> ModelRunnerOutput:
        if any(item.request_id == culprit for item in batch.requests):
            raise RuntimeError("injected fault of one row")
        return execute(batch)

    return poisoned


def test_an_unattributed_step_failure_fails_only_the_request_that_fails_alone(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(llama_dir)
    engine.add_request(
        EngineRequest("the quick brown fox", GREEDY, "poison")
    )  # index 0 keeps the id
    monkeypatch.setattr(engine.runner, "execute", poisoned_by(engine, "poison"))
    engine.add_request(EngineRequest("hello there", GREEDY, "a"))
    engine.add_request(EngineRequest("general kenobi", GREEDY, "b"))
    outputs = run_to_completion(engine)
    assert outputs["poison"][-1].error == RequestFailedError.kind
    alone = make_engine(llama_dir)
    alone.add_request(EngineRequest("hello there", GREEDY, "a"))
    alone.add_request(EngineRequest("general kenobi", GREEDY, "b"))
    expected = run_to_completion(alone)
    for rid in ("a", "b"):
        assert outputs[rid][-1].error is None
        assert tokens_of(outputs[rid]) == tokens_of(expected[rid])
    assert engine.num_failed_requests == 1
    check_blocks(engine)


def test_a_temperature_that_is_zero_in_float32_fails_nobody(llama_dir: Path) -> None:
    """1e-300 is 0 in float32: unbounded, its row of logits became NaN and sampled an id
    past the vocabulary, and the next step failed for every request in the batch."""
    assert SamplingParams(temperature=1e-300).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=1e300).temperature == MAX_TEMPERATURE
    assert SamplingParams(temperature=-0.0).greedy
    for bad in (1e-300, 0.0, 1e3):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)
    poison = SamplingParams(max_tokens=6, ignore_eos=True)
    object.__setattr__(poison, "temperature", 1e-300)  # as if validation had missed it
    engine = make_engine(llama_dir)
    engine.add_request(EngineRequest("the quick brown fox", GREEDY, "good"))
    engine.add_request(EngineRequest("the quick brown fox", poison, "poison"))
    outputs = run_to_completion(engine)
    vocab = engine.model_config.vocab_size
    for rid in ("good", "poison"):
        assert outputs[rid][-1].error is None
        assert all(0 <= t < vocab for t in tokens_of(outputs[rid]))
        assert len(tokens_of(outputs[rid])) == 6


@pytest.fixture
async def async_engine(llama_dir: Path) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(make_engine(llama_dir))
    yield engine
    await engine.shutdown()


async def test_a_poison_request_leaves_the_async_engine_serving(
    async_engine: AsyncEngine,
) -> None:
    with pytest.raises(RequestFailedError):
        async for _ in async_engine.generate(EngineRequest("x", unvalidated_seed(2**64), "poison")):
            pass
    outs = [o async for o in async_engine.generate(EngineRequest("hello", GREEDY, "next"))]
    assert len(tokens_of(outs)) == GREEDY.max_tokens
    assert async_engine.is_running() and not async_engine.has_crashed()


async def test_repeated_step_failures_end_the_engine_visibly(
    async_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = async_engine.engine
    monkeypatch.setattr(engine.runner, "execute", failing_steps(engine, MAX_FAILED_STEPS))
    for i in range(MAX_FAILED_STEPS):
        with pytest.raises((RequestFailedError, EngineDeadError)):
            async for _ in async_engine.generate(EngineRequest("hello", GREEDY, f"r{i}")):
                pass
    assert async_engine.has_crashed() and not async_engine.is_running()
    with pytest.raises(EngineDeadError):
        async for _ in async_engine.generate(EngineRequest("hello", GREEDY, "late")):
            pass
