"""An OpenAI-compatible upstream's health and load, from its own endpoints: `GET /health`
and the Prometheus exposition at `GET /metrics` (vLLM's and SGLang's names), read every
second for routing.

Only the few series routing uses are parsed: vLLM's exposition is tens of kilobytes of
histograms, and this runs on the event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.dispatch.routing import Replica

PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Signals:
    """The names one server family gives its queue, its batch and its KV-cache use."""

    waiting: str
    running: str
    kv_usage: tuple[str, ...]  # a fraction in [0, 1]; the first name present counts


VLLM = Signals(
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # the second: vLLM < 0.10
)
SGLANG = Signals("sglang:num_queue_reqs", "sglang:num_running_reqs", ("sglang:token_usage",))
FAMILIES = (VLLM, SGLANG)
LORA_INFO = "vllm:lora_requests_info"  # labels running_lora_adapters, waiting_lora_adapters
WANTED = frozenset(
    name for s in FAMILIES for name in (s.waiting, s.running, *s.kv_usage)
) | {LORA_INFO}  # fmt: skip


@dataclass(frozen=True)
class Load:
    waiting: int
    running: int
    kv_used_fraction: float
    adapters: frozenset[str] = frozenset()  # LoRA adapters running or waiting there


def parse_load(exposition: str) -> Load | None:
    """The load in a /metrics answer, summed over the server's engines (vLLM data
    parallelism labels each `engine`); the fullest engine's KV cache. None when it has
    none of the known names (not vLLM or SGLang)."""
    wanted = "\n".join(
        line for line in exposition.splitlines() if line.split("{", 1)[0].split(" ", 1)[0] in WANTED
    )
    values: dict[str, list[float]] = {}
    lora: list[Sample] = []
    for family in text_string_to_metric_families(wanted):
        values.setdefault(family.name, []).extend(sample.value for sample in family.samples)
        if family.name == LORA_INFO:
            lora += family.samples
    for signals in FAMILIES:
        if signals.waiting in values or signals.running in values:
            kv = next((values[n] for n in signals.kv_usage if n in values), [0.0])
            return Load(
                waiting=round(sum(values.get(signals.waiting, []))),
                running=round(sum(values.get(signals.running, []))),
                kv_used_fraction=min(1.0, max(kv)),
                adapters=_adapter_names(lora),
            )
    return None


def _adapter_names(samples: list[Sample]) -> frozenset[str]:
    """vLLM writes one sample per change, stamped with its time as the value: the latest
    says which adapters are running and waiting now."""
    if not samples:
        return frozenset()
    latest = max(samples, key=lambda sample: sample.value).labels
    names = f"{latest.get('running_lora_adapters', '')},{latest.get('waiting_lora_adapters', '')}"
    return frozenset(name for name in names.split(",") if name)


async def probe(http: httpx.AsyncClient, target: Replica) -> None:
    """One round for `target`: it is down when its connection is refused or /health answers
    5xx at once, or after a few probes in a row with no answer in time; it is back when
    both answer again. A server without /health or /metrics (404) is judged by the rest."""
    health, metrics = await asyncio.gather(
        _get(http, f"{target.url}/health"), _get(http, f"{target.url}/metrics")
    )
    if isinstance(health, httpx.TimeoutException) or isinstance(metrics, httpx.TimeoutException):
        target.missed()
        return
    if isinstance(health, Exception) or health.status_code >= 500:
        target.answered(healthy=False)
        return
    target.answered(healthy=True)
    load = None
    if isinstance(metrics, httpx.Response) and metrics.status_code == 200:
        load = parse_load(metrics.text)
    if load is not None:
        target.waiting, target.running = load.waiting, load.running
        target.kv_used_fraction = load.kv_used_fraction
        target.adapters = load.adapters


async def _get(http: httpx.AsyncClient, url: str) -> httpx.Response | httpx.HTTPError:
    try:
        return await http.get(url, timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return exc
