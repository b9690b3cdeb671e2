"""The asyncio front: streaming deltas, concurrency, and every way a consumer can leave."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import pytest

from backend import AsyncEngine, EngineDeadError, PromptTooLongError, RequestOutput
from backend.engine.engine import Engine
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.conftest import eventually
from tests.engine.engine_support import SMALL, make_engine, run_to_completion, text_of, tokens_of

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)


@pytest.fixture(params=["off", "on"], ids=["sync", "async_scheduling"])
async def engine(llama_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(make_engine(llama_dir, async_scheduling=request.param))
    yield engine
    await engine.shutdown()


async def collect(
    engine: AsyncEngine, prompt: str, params: SamplingParams, rid: str
) -> list[RequestOutput]:
    return [out async for out in engine.generate(EngineRequest(prompt, params, rid))]


async def assert_idle(engine: AsyncEngine) -> None:
    """A follow-up request that needs several steps: once it finishes, every abort queued
    before it has been applied at a step boundary."""
    await collect(engine, "follow-up", SamplingParams(max_tokens=3, temperature=0), "follow-up")
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)


def sync_reference(llama_dir: Path, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    sync = make_engine(llama_dir)
    sync.add_request(EngineRequest(prompt, params, "ref"))
    return run_to_completion(sync)["ref"]


async def test_from_pretrained_exposes_the_interface(llama_dir: Path) -> None:
    engine = await asyncio.to_thread(AsyncEngine.from_pretrained, llama_dir, SMALL)
    try:
        assert engine.model_name == "llama" and engine.max_model_len == 96
        assert engine.is_running()
        ids = engine.tokenizer.encode("hello")
        assert engine.tokenizer.decode(ids) == "hello"
        assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        await engine.shutdown()
    assert not engine.is_running()
    with pytest.raises(EngineDeadError):
        await collect(engine, "x", GREEDY, "late")


async def test_streams_deltas_like_the_sync_engine(engine: AsyncEngine, llama_dir: Path) -> None:
    outs = await collect(engine, "The quick brown fox", GREEDY, "a")
    ref = sync_reference(llama_dir, "The quick brown fox", GREEDY)
    assert tokens_of(outs) == tokens_of(ref) and text_of(outs) == text_of(ref)
    assert [o.finished for o in outs] == [False] * 11 + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 12


async def test_concurrent_requests(engine: AsyncEngine, llama_dir: Path) -> None:
    prompts = ["The quick", "Paged attention stores", "héllo wörld", "def main():"]
    results = await asyncio.gather(
        *(collect(engine, p, GREEDY, f"c{i}") for i, p in enumerate(prompts))
    )
    for prompt, outs in zip(prompts, results, strict=True):
        assert tokens_of(outs) == tokens_of(sync_reference(llama_dir, prompt, GREEDY))


async def test_aclose_aborts(engine: AsyncEngine) -> None:
    async with aclosing(engine.generate(EngineRequest("The quick", LONG, "leaver"))) as stream:
        async for out in stream:
            assert not out.finished
            break
    await assert_idle(engine)


async def test_plain_break_aborts(engine: AsyncEngine) -> None:
    async for _ in engine.generate(EngineRequest("The quick", LONG, "breaker")):
        break  # the generator is finalised (and aborts) once dropped
    # A reference cycle can keep the dropped generator until the cyclic collector runs;
    # what is tested is its finaliser's abort, not when the collector happens to run.
    gc.collect()
    # The finaliser's aclose runs in a task the loop schedules later: once the stream is
    # gone its abort is queued (the same synchronous block), so the follow-up comes after
    # it. Without this wait a starved loop let the follow-up finish first.
    await eventually(lambda: "breaker" not in engine._streams)
    await assert_idle(engine)


async def test_cancelling_the_consumer_aborts(engine: AsyncEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(EngineRequest("The quick", LONG, "cancelled")):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_idle(engine)


async def test_engine_abort_ends_the_stream(engine: AsyncEngine) -> None:
    outs: list[RequestOutput] = []
    async for out in engine.generate(EngineRequest("The quick", LONG, "victim")):
        outs.append(out)
        if len(outs) == 2:
            engine.abort("victim")
            engine.abort("victim")
            engine.abort("unknown")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(outs) < 80
    await assert_idle(engine)


async def test_invalid_request_raises_and_frees_the_id(engine: AsyncEngine) -> None:
    with pytest.raises(PromptTooLongError):
        await collect(engine, "x" * 500, GREEDY, "bad")
    assert len(await collect(engine, "ok", GREEDY, "bad")) == 12
    async with aclosing(engine.generate(EngineRequest("a", LONG, "twice"))) as first:
        await anext(first)
        with pytest.raises(ValueError, match="already"):
            await collect(engine, "b", GREEDY, "twice")


async def test_a_crashed_step_loop_fails_every_stream(llama_dir: Path) -> None:
    sync: Engine = make_engine(llama_dir)

    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("kernel exploded")

    sync.step = broken_step  # type: ignore[method-assign]
    engine = AsyncEngine(sync)
    with pytest.raises(EngineDeadError, match="kernel exploded"):
        await collect(engine, "x", GREEDY, "doomed")
    assert not engine.is_running()
    with pytest.raises(EngineDeadError):
        await collect(engine, "x", GREEDY, "after")
    await engine.shutdown()


async def test_shutdown_fails_open_streams(llama_dir: Path) -> None:
    engine = AsyncEngine(make_engine(llama_dir))
    seen: list[RequestOutput] = []

    async def consume() -> None:
        async for out in engine.generate(EngineRequest("The quick", LONG, "open")):
            seen.append(out)
            if len(seen) == 1:
                await engine.shutdown()

    with pytest.raises(EngineDeadError, match="shut down"):
        await consume()
    assert len(seen) < 80 and not engine.is_running()
    await engine.shutdown()  # a second call is harmless


async def test_n_completions_stream_until_every_one_finishes(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=1, n=3, logprobs=1)
    outs = await collect(engine, "The quick", params, "multi")
    assert {o.index for o in outs} == {0, 1, 2} and outs[-1].finished
    assert sum(o.finished for o in outs) == 3
    for i in range(3):
        mine = [o for o in outs if o.index == i]
        assert [o.completion_tokens for o in mine] == [1, 2, 3, 4, 5]
        assert all(o.logprobs is not None and len(o.logprobs) == 1 for o in mine)
    await assert_idle(engine)


async def test_leaving_an_n_request_aborts_every_completion(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True, n=2)
    async with aclosing(
        engine.generate(EngineRequest("The quick", params, "multi-leaver"))
    ) as stream:
        async for _ in stream:
            break
    await assert_idle(engine)


async def test_batch_outputs_wait_for_interactive_work(
    engine: AsyncEngine, llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch-class request's outputs reach its consumer only once no interactive request
    is in the engine, all of them, in order, what waited as one delta (the hold's cap out
    of the way)."""
    monkeypatch.setattr("backend.engine.async_engine.BATCH_HOLD_S", 600.0)
    batch_priority = engine.engine.config.batch_priority
    interactive = engine.generate(EngineRequest("The quick", LONG, "chat"))
    await anext(interactive)  # running
    interactive_left: list[int] = []  # the engine's interactive work at each batch output

    async def batch() -> list[RequestOutput]:
        outs = []
        request = EngineRequest("Paged attention", GREEDY, "line", priority=batch_priority)
        async for out in engine.generate(request):
            interactive_left.append(engine.engine.num_interactive())
            outs.append(out)
        return outs

    line = asyncio.ensure_future(batch())
    rest = [out async for out in interactive]
    outs = await line
    assert rest[-1].finished and interactive_left == [0] * len(outs)
    ref = sync_reference(llama_dir, "Paged attention", GREEDY)
    assert tokens_of(outs) == tokens_of(ref) and outs[-1].finished
    # What waited came as one delta, not one per token (a wake-up of the consumer each).
    assert len(outs) < len(tokens_of(outs)), [len(o.token_ids) for o in outs]


async def test_batch_outputs_go_out_coalesced_without_interactive_work(
    engine: AsyncEngine, llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alone in the engine, a batch-class request's deltas wait BATCH_COALESCE_S between
    deliveries and its last goes out at once: with the interval long, one delta with every
    token; an interactive request's come one per step."""
    monkeypatch.setattr("backend.engine.async_engine.BATCH_COALESCE_S", 600.0)
    priority = engine.engine.config.batch_priority
    request = EngineRequest("Paged attention", GREEDY, "line", priority=priority)
    outs = [out async for out in engine.generate(request)]
    assert len(outs) == 1 and outs[0].finished and outs[0].completion_tokens == 12
    chat = [out async for out in engine.generate(EngineRequest("Paged attention", GREEDY, "c"))]
    assert [len(o.token_ids) for o in chat] == [1] * 12
    ref = sync_reference(llama_dir, "Paged attention", GREEDY)
    assert tokens_of(outs) == tokens_of(ref) == tokens_of(chat)
