"""`tollgate capacity check --url`: the same check against a running backend replica over
its internal API (backend/server.py): the KV pool and the model's shapes from
/internal/kv, step times from the engine's own token timestamps on /internal/generate.

A prefill step is first_scheduled_time to first_token_time of a one-token request; a
decode step at batch B is the median gap between tokens while B requests all decode. The
backend should be otherwise idle. Peaks: a GPU preset, or a calibration on this machine
(right for a backend on this host, the loopback case)."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import uuid
from typing import Any

import httpx
import msgspec
import torch

from backend.capacity.calibration import Calibration
from backend.capacity.check import (
    DECODE_BATCHES,
    DECODE_STEPS,
    PREFILL_LENGTHS,
    PROMPT_FOR_DECODE,
    EngineFacts,
    Peaks,
    Sample,
    calibrate,
    calibration,
    floor_model,
)
from backend.capacity.errors import CapacityInputError
from backend.capacity.model import TORCH_NAMES, Architecture, Hardware
from backend.models.config import ModelConfig
from backend.outputs import RequestOutput
from backend.sampling import SamplingParams
from backend.wire import LINES, SECRET_HEADER, ErrorLine, GenerateBody

TIMEOUT_S = 60.0
DECODE_TOKENS = (16, 64, 256)  # output lengths tried until a batch overlaps long enough


def _facts(kv: dict[str, Any]) -> tuple[EngineFacts, Architecture]:
    arch = Architecture.of(str(kv["model"]), ModelConfig(**kv["config"]))
    dtype = TORCH_NAMES[kv["dtype"]]
    kv_dtype = TORCH_NAMES[kv.get("kv_dtype", kv["dtype"])]  # an older backend: the compute's
    planned = arch.kv_bytes_per_token(kv_dtype) * kv["block_size"]
    engine_per_block = kv["tensor_bytes"] // kv["num_blocks"]
    sized_by_bytes = kv["device"] == "cpu" and kv["num_kv_blocks"] is None
    facts = EngineFacts(
        model=str(kv["model"]),
        device=kv["device"],
        dtype=dtype,
        kv_dtype=kv_dtype,
        block_size=kv["block_size"],
        num_blocks=kv["num_blocks"],
        bytes_per_block=engine_per_block,
        kv_tensor_bytes=kv["tensor_bytes"],
        kv_budget_bytes=kv["kv_cache_bytes"],
        max_model_len=int(kv["max_model_len"]),
        planner_bytes_per_block=planned,
        planner_num_blocks=int(kv["kv_cache_bytes"] // planned) if sized_by_bytes else None,
    )
    return facts, arch


async def _generate(
    http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    body = GenerateBody(prompt, params, f"capacity-check-{uuid.uuid4().hex[:12]}")
    outputs = []
    content = msgspec.json.encode(body)
    async with http.stream("POST", f"{url}/internal/generate", content=content) as response:
        if response.status_code != 200:
            raise CapacityInputError("--url", f"--url: generate answered {response.status_code}")
        async for line in response.aiter_lines():
            if line.strip():
                decoded = LINES.decode(line)
                if isinstance(decoded, ErrorLine):
                    raise CapacityInputError("--url", f"--url: the backend refused: {line}")
                outputs.append(decoded.output)
    return outputs


def _prompt(count: int, vocab: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % (vocab - 3) for i in range(count)]


async def _decode_sample(
    http: httpx.AsyncClient, url: str, vocab: int, batch: int, seed: int
) -> Sample:
    """`batch` requests at once; the gaps between tokens of the first while all of them
    decode. Requests reach the engine over HTTP at slightly different times, so the
    outputs grow until they overlap for a few steps."""
    for max_tokens in DECODE_TOKENS:
        prompts = [_prompt(PROMPT_FOR_DECODE, vocab, seed + i) for i in range(batch)]
        runs = await asyncio.gather(*(_generate(http, url, p, max_tokens) for p in prompts))
        times = [[t for out in run for t in out.token_times] for run in runs]
        start, end = max(ts[0] for ts in times), min(ts[-1] for ts in times)
        steps = [
            (k, b - a)
            for k, (a, b) in enumerate(itertools.pairwise(times[0]))
            if a >= start and b <= end
        ]
        if len(steps) >= DECODE_STEPS:
            # Gap k follows token k + 1: that step read PROMPT + k + 1 positions of KV.
            context = PROMPT_FOR_DECODE + round(statistics.fmean(k for k, _ in steps)) + 1
            gap = statistics.median(g for _, g in steps)
            return Sample("decode", batch, context, [(context - 1, 1)] * batch, gap)
    raise CapacityInputError("--url", f"--url: {batch} requests never decoded together")


async def _measure(http: httpx.AsyncClient, url: str, vocab: int) -> list[Sample]:
    samples = [
        await _decode_sample(http, url, vocab, batch, seed=1000 * batch) for batch in DECODE_BATCHES
    ]
    for seed, length in enumerate(PREFILL_LENGTHS, 1):
        outs = await _generate(http, url, _prompt(length, vocab, seed), 1)
        last = outs[-1]
        if last.first_token_time is None or last.first_scheduled_time is None:
            raise CapacityInputError("--url", "--url: the backend reported no step times")
        samples.append(
            Sample(
                "prefill",
                1,
                length,
                [(0, length)],
                last.first_token_time - last.first_scheduled_time,
            )
        )
    return samples


async def check_remote_async(
    url: str, secret: str, gpu: Hardware | None = None
) -> tuple[EngineFacts, Peaks, Calibration]:
    url = url.rstrip("/")
    try:
        async with httpx.AsyncClient(headers={SECRET_HEADER: secret}, timeout=TIMEOUT_S) as http:
            response = await http.get(f"{url}/internal/kv")
            if response.status_code != 200:
                raise CapacityInputError(
                    "--url",
                    f"--url {url}: /internal/kv answered {response.status_code} "
                    "(is TOLLGATE_BACKEND_SECRET the backend's?)",
                )
            facts, arch = _facts(response.json())
            samples = await _measure(http, url, arch.vocab_size)
    except httpx.HTTPError as exc:
        raise CapacityInputError("--url", f"--url {url}: {exc!r}") from None
    if gpu is not None:
        peaks = Peaks(gpu.peak_flops(facts.dtype), gpu.hbm_bandwidth, f"the {gpu.name} preset")
    else:
        here = await asyncio.to_thread(calibrate, torch.device("cpu"), torch.float32)
        peaks = Peaks(here.flops, here.bandwidth, here.how + " here, not on the backend's host")
    floor = floor_model(arch, facts.dtype, peaks, facts.device, facts.kv_dtype)
    return facts, peaks, calibration(floor, peaks, samples, f"{facts.device} at {url}")


def check_remote(
    url: str, secret: str, gpu: Hardware | None = None
) -> tuple[EngineFacts, Peaks, Calibration]:
    return asyncio.run(check_remote_async(url, secret, gpu))
