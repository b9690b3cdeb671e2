"""A backend's /metrics carries the engine's state under vLLM's names (the model-server
protocol llm-d, vLLM production-stack's router and KEDA read) next to Tollgate's own,
read from a real engine with one request running and one queued; and the chart's KEDA
queries name metrics a backend really exports."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backend import AsyncEngine, EngineConfig, SamplingParams
from backend.builtin import BUILTIN_MODEL_DIR
from backend.requests import EngineRequest
from backend.server import create_backend_app
from tests.conftest import eventually, serving
from tests.infra.test_helm_chart import FULLNAME, _docs, _one

SECRET = "s3cret"
ONE_AT_A_TIME = EngineConfig(max_num_seqs=1, max_waiting_requests=4, cpu_threads=1)
LONG = SamplingParams(max_tokens=1800, ignore_eos=True, temperature=0)  # every test cancels it


@pytest.fixture
async def backend() -> AsyncIterator[tuple[AsyncEngine, str]]:
    engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, ONE_AT_A_TIME)
    async with serving(create_backend_app(engine, BUILTIN_MODEL_DIR, SECRET)) as url:
        yield engine, url


async def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{url}/metrics", headers={"Authorization": f"Bearer {SECRET}"})
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


async def _consume(engine: AsyncEngine, request_id: str) -> None:
    async for _ in engine.generate(EngineRequest(list(range(3, 40)), LONG, request_id)):
        pass


async def test_engine_state_under_vllm_names(backend: tuple[AsyncEngine, str]) -> None:
    engine, url = backend
    tasks = [asyncio.create_task(_consume(engine, "running"))]
    await eventually(lambda: engine.stats().num_running == 1)
    tasks.append(asyncio.create_task(_consume(engine, "queued")))
    await eventually(lambda: engine.stats().num_waiting == 1)
    try:
        samples = await _scrape(url)
        stats = engine.stats()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    model = (("model_name", engine.model_name),)
    assert samples[("vllm:num_requests_running", model)] == 1
    assert samples[("vllm:num_requests_waiting", model)] == 1
    usage = samples[("vllm:kv_cache_usage_perc", model)]
    assert 0 < usage <= 1  # a fraction, as vLLM reports it despite the name
    assert usage == pytest.approx(stats.kv_blocks_used / stats.kv_blocks_total, abs=0.2)
    config = (("block_size", str(stats.block_size)), ("num_gpu_blocks", str(stats.kv_blocks_total)))
    assert samples[("vllm:cache_config_info", config)] == 1
    assert samples[("vllm:prefix_cache_queries_total", model)] >= 37
    # Tollgate's own names are still there, with the same readings.
    assert samples[("tollgate_engine_requests_running", ())] == 1
    assert samples[("tollgate_engine_requests_waiting", ())] == 1


async def test_idle_engine_reports_zero(backend: tuple[AsyncEngine, str]) -> None:
    engine, url = backend
    samples = await _scrape(url)
    model = (("model_name", engine.model_name),)
    assert samples[("vllm:num_requests_running", model)] == 0
    assert samples[("vllm:num_requests_waiting", model)] == 0
    assert samples[("vllm:kv_cache_usage_perc", model)] == 0


async def test_keda_queries_name_exported_metrics(backend: tuple[AsyncEngine, str]) -> None:
    _, url = backend
    exported = {name for name, _ in await _scrape(url)}
    scaled = _one(_docs("autoscaling"), "ScaledObject", f"{FULLNAME}-backend")
    for trigger in scaled["spec"]["triggers"]:
        query = trigger["metadata"]["query"]
        metrics = re.findall(r"(vllm:[a-z_]+)\{", query)
        assert metrics and set(metrics) <= exported, query
