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
from backend.sampling import MAX_SEED, SamplingParams
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
    engine.add_request("good", "the quick brown fox", GREEDY)
    engine.add_request("poison", "the quick brown fox", unvalidated_seed(2**64))
    outputs = run_to_completion(engine)
    assert outputs["poison"][-1].error == RequestFailedError.kind
    assert outputs["poison"][-1].finished
    assert len(tokens_of(outputs["good"])) == GREEDY.max_tokens
    assert outputs["good"][-1].error is None
    alone = make_engine(llama_dir)
    alone.add_request("good", "the quick brown fox", GREEDY)
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
    monkeypatch.setattr(engine.runner, "execute", failing_steps(engine, 1))
    engine.add_request("a", "hello there", GREEDY)
    engine.add_request("b", "general kenobi", GREEDY)
    first = run_to_completion(engine)
    assert {first[r][-1].error for r in ("a", "b")} == {RequestFailedError.kind}
    check_blocks(engine)
    engine.add_request("after", "hello there", GREEDY)
    after = run_to_completion(engine)["after"]
    assert after[-1].error is None and len(tokens_of(after)) == GREEDY.max_tokens


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
