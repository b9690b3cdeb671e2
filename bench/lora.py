"""Multi-LoRA serving (issue 34): output tok/s of one batch of 16 requests spread over 8
adapters (two each, rank 16 on every projection) against the same batch on the base model
alone; target at least 70% of it on the CPU.

--http (the product path): two `tollgate serve` processes on loopback (bench/serve.py,
embedded default), the same checkpoint, one plain (max_loras 0) and one with
--max-loras 8; a tenant gets the 8 adapters through the admin API and names them in
`model`. The batch is 16 concurrent POST /v1/completions (token-id prompts), timed from
the first request to the last answer. Sides: the base model on the plain server, the base
model on the LoRA server, the 8 adapters on the LoRA server, alternated, best round kept.

In process (the default: the engine's step loop, no HTTP): three sides, built in the same
run and measured alternately: the base model on a plain engine (max_loras 0), the base
batch on the LoRA engine (max_loras 8: the wrapped layers with no adapter row), and the
adapter batch on the LoRA engine.

Both modes: the checkpoint is a random Llama the script builds (bench/_common.py: 8
layers, 512 wide, ~50M parameters); adapters are random PEFT folders written to a
temporary directory and loaded once in an untimed warm-up. Greedy, EOS ignored, 32-token
prompts, 128 new tokens each.

    python -m bench.lora [--http] [--repeat 2] [--tokens 128] [--rank 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.requests import EngineRequest, LoRARequest
from backend.sampling import SamplingParams
from bench._common import CACHE, build_random_llama
from bench.serve import Server, serving

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BATCH, ADAPTERS = 16, 8


def write_adapter(folder: Path, base: Path, rank: int, seed: int) -> LoRARequest:
    """A random PEFT LoRA adapter of `base` on every projection."""
    cfg = json.loads((base / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]
    shapes = {
        "q_proj": (hidden, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target, (out, inp) in shapes.items():
            part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return LoRARequest(f"adapter-{seed}", str(folder))


def tokens_per_second(
    engine: Engine, adapters: list[LoRARequest | None], tokens: int, tag: str
) -> float:
    """One batch of BATCH requests, request i on adapters[i % len(adapters)]: completion
    tokens over the wall time from submission to the last token (prefill included)."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    for i in range(BATCH):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(32)]
        lora = adapters[i % len(adapters)]
        engine.add_request(EngineRequest(prompt, params, f"{tag}{i}", lora=lora))
    produced = 0
    while engine.has_work():
        produced += sum(len(out.token_ids) for out in engine.step())
    if produced != BATCH * tokens:
        raise RuntimeError(f"{tag}: {produced} of {BATCH * tokens} tokens")
    return produced / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", action="store_true", help="through tollgate serve's API")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per run")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    if args.http:
        asyncio.run(through_http(args))
    else:
        in_process(args)


def in_process(args: argparse.Namespace) -> None:
    checkpoint = build_random_llama(CACHE / "lora-llama")
    config = EngineConfig(max_num_seqs=BATCH, enable_prefix_caching=False)
    plain = Engine(checkpoint, config)
    multi = Engine(checkpoint, replace(config, max_loras=ADAPTERS, max_lora_rank=args.rank))
    runner = plain.runner
    print(f"device {runner.device}, dtype {runner.dtype}, torch threads {torch.get_num_threads()}")
    print("in process (engine.step loop), not through the HTTP API")
    with tempfile.TemporaryDirectory() as tmp:
        adapters: list[LoRARequest | None] = [
            write_adapter(Path(tmp) / f"a{i}", checkpoint, args.rank, i) for i in range(ADAPTERS)
        ]
        sides: dict[str, tuple[Engine, list[LoRARequest | None]]] = {
            "base (max_loras 0)": (plain, [None]),
            "base on the LoRA engine": (multi, [None]),
            f"{ADAPTERS} adapters, rank {args.rank}": (multi, adapters),
        }
        for name, (engine, which) in sides.items():  # warm-up: adapters loaded, fit ready
            tokens_per_second(engine, which, 8, f"warm-{name}-")
        for run in range(1, args.repeat + 1):
            # Sides alternate, best round kept: a burst from another process on a shared
            # machine slows one round of one side, not the best of several.
            best = dict.fromkeys(sides, 0.0)
            for round_ in range(args.rounds):
                for name, (engine, which) in sides.items():
                    tps = tokens_per_second(engine, which, args.tokens, f"{run}-{round_}-{name}-")
                    best[name] = max(best[name], tps)
            base = best["base (max_loras 0)"]
            print(f"run {run}: batch of {BATCH}, {args.tokens} new tokens each, "
                  f"best of {args.rounds} alternated rounds")  # fmt: skip
            for name, value in best.items():
                print(f"  {name:<28} {value:8.1f} tok/s  {value / base:6.1%} of base")


def _env(checkpoint: Path, max_loras: int, rank: int) -> dict[str, str]:
    """The in-process sides' engine, as `tollgate serve` variables."""
    return {
        "TOLLGATE_MODEL": str(checkpoint),
        "TOLLGATE_MAX_NUM_SEQS": str(BATCH),
        "TOLLGATE_ENABLE_PREFIX_CACHING": "false",
        "TOLLGATE_MAX_LORAS": str(max_loras),
        "TOLLGATE_MAX_LORA_RANK": str(rank),
    }


async def _add_adapters(server: Server, folders: list[Path], tenant: str) -> list[str]:
    """A tenant owning the adapters (admin API), once the server routes them."""
    http, admin = server.http, server.admin_headers
    names = [f"ft-{i}" for i in range(len(folders))]
    for name, folder in zip(names, folders, strict=True):
        body = {"name": name, "base_model": server.model, "path": str(folder), "tenant": tenant}
        reply = await http.post(f"{server.base}/admin/api/adapters", json=body, headers=admin)
        reply.raise_for_status()
    return names


async def _tenant(server: Server, name: str) -> str:
    http, admin = server.http, server.admin_headers
    created = await http.post(
        f"{server.base}/admin/api/tenants", json={"name": name}, headers=admin
    )
    created.raise_for_status()
    key = await http.post(f"{server.base}/admin/api/tenants/{name}/keys", json={}, headers=admin)
    return str(key.json()["key"])


async def _routed(server: Server, key: str, names: list[str]) -> None:
    """Every gateway re-reads adapters within a few seconds: poll /v1/models for them."""
    for _ in range(200):
        listed = await server.http.get(
            f"{server.base}/v1/models", headers={"Authorization": f"Bearer {key}"}
        )
        if set(names) <= {m["id"] for m in listed.json()["data"]}:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the adapters never appeared in /v1/models")


async def http_batch(server: Server, key: str, models: list[str], tokens: int) -> float:
    """BATCH concurrent completions, request i on models[i % len(models)]: completion
    tokens over the wall time from the first request to the last answer."""
    headers = {"Authorization": f"Bearer {key}"}

    async def one(i: int) -> int:
        body = {
            "model": models[i % len(models)],
            "prompt": [(7 * i + j) % 1000 + 10 for j in range(32)],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = await server.http.post(f"{server.base}/v1/completions", json=body, headers=headers)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    produced = sum(await asyncio.gather(*(one(i) for i in range(BATCH))))
    if produced != BATCH * tokens:
        raise RuntimeError(f"{produced} of {BATCH * tokens} tokens")
    return produced / (time.perf_counter() - started)


async def through_http(args: argparse.Namespace) -> None:
    checkpoint = build_random_llama(CACHE / "lora-llama")
    print("through the HTTP API: two tollgate serve processes, torch threads as serve sets them")
    with tempfile.TemporaryDirectory() as tmp:
        folders = [
            Path(write_adapter(Path(tmp) / f"a{i}", checkpoint, args.rank, i).path)
            for i in range(ADAPTERS)
        ]
        async with httpx.AsyncClient(timeout=1800) as http, contextlib.AsyncExitStack() as stack:
            plain = await stack.enter_async_context(serving(http, _env(checkpoint, 0, args.rank)))
            multi = await stack.enter_async_context(
                serving(http, _env(checkpoint, ADAPTERS, args.rank))
            )
            print(f"plain: {plain.startup_line()}\nlora:  {multi.startup_line()}", flush=True)
            plain_key = await _tenant(plain, "bench")
            key = await _tenant(multi, "bench")
            names = await _add_adapters(multi, folders, "bench")
            await _routed(multi, key, names)
            sides = {
                "base (max_loras 0)": (plain, plain_key, [plain.model]),
                "base on the LoRA server": (multi, key, [multi.model]),
                f"{ADAPTERS} adapters, rank {args.rank}": (multi, key, names),
            }
            for server, side_key, models in sides.values():  # warm-up: adapters loaded
                await http_batch(server, side_key, models, 8)
            for run in range(1, args.repeat + 1):
                best = dict.fromkeys(sides, 0.0)
                for _ in range(args.rounds):
                    for name, (server, side_key, models) in sides.items():
                        tps = await http_batch(server, side_key, models, args.tokens)
                        best[name] = max(best[name], tps)
                _report(run, best, args)


def _report(run: int, best: dict[str, float], args: argparse.Namespace) -> None:
    base = best["base (max_loras 0)"]
    print(f"run {run}: batch of {BATCH}, {args.tokens} new tokens each, "
          f"best of {args.rounds} alternated rounds")  # fmt: skip
    for name, value in best.items():
        print(f"  {name:<28} {value:8.1f} tok/s  {value / base:6.1%} of base", flush=True)


if __name__ == "__main__":
    main()
