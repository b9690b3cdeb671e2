"""LoRA adapters in the engine: an adapter's greedy output equals the base checkpoint
with the adapter merged into its weights (W + B @ A * scaling) on the oracle prompts;
a batch mixing adapters and the base model equals each run alone; fewer slots than
adapters in use evict and reload (least recently used, never one running); the prefix
cache is keyed by adapter; adapters the engine cannot serve are refused, typed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.engine.engine import Engine
from backend.errors import AdapterRankError, UnknownAdapterError
from backend.requests import EngineRequest, LoRARequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import make_engine, run_to_completion, tokens_of
from tests.engine.test_engine_oracle import oracle_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LARGE = {"num_kv_blocks": 512, "max_model_len": 1024, "block_size": 16}


def _shapes(cfg: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head
    return {
        "q_proj": (hidden, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def _module(target: str) -> str:
    return "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"


def build_adapter(
    folder: Path,
    base: Path,
    rank: int,
    targets: tuple[str, ...] = ALL,
    seed: int = 0,
    alpha: int = 16,
    **config: object,
) -> Path:
    """A random PEFT LoRA adapter of `base` (B non-zero, so it changes the output)."""
    cfg = json.loads((base / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for target in targets:
            out, inp = _shapes(cfg)[target]
            key = f"base_model.model.model.layers.{layer}.{_module(target)}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.1
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    peft = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets)}
    (folder / "adapter_config.json").write_text(json.dumps(peft | config))
    return folder


def merge(base: Path, adapter: Path, folder: Path) -> Path:
    """`base` with the adapter folded into its weights: the reference output."""
    shutil.copytree(base, folder)
    peft = json.loads((adapter / "adapter_config.json").read_text())
    scaling = peft["lora_alpha"] / peft["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    weights = load_file(str(folder / "model.safetensors"))
    for key in lora:
        if ".lora_A." in key:
            name = key.removeprefix("base_model.model.").replace(".lora_A", "")
            b = lora[key.replace("lora_A", "lora_B")]
            weights[name] = weights[name] + (b.double() @ lora[key].double() * scaling).float()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all8": build_adapter(root / "all8", llama_dir, 8, seed=1),
        "qv4": build_adapter(root / "qv4", llama_dir, 4, ("q_proj", "v_proj"), seed=2, alpha=8),
        "mlp2": build_adapter(root / "mlp2", llama_dir, 2, ("up_proj", "down_proj"), seed=3),
        "o16": build_adapter(root / "o16", llama_dir, 16, ("o_proj",), seed=4),
    }


def lora(name: str, adapters: dict[str, Path]) -> LoRARequest:
    return LoRARequest(name, str(adapters[name]))


def run(
    engine: Engine, jobs: list[tuple[list[int], LoRARequest | None]], tenant: str | None = None
) -> list[list[int]]:
    """Greedy outputs of (prompt, adapter) jobs submitted together."""
    for i, (prompt, adapter) in enumerate(jobs):
        engine.add_request(EngineRequest(prompt, GREEDY, f"r{i}", tenant=tenant, lora=adapter))
    outputs = run_to_completion(engine)
    return [tokens_of(outputs[f"r{i}"]) for i in range(len(jobs))]


def test_adapter_equals_its_merged_checkpoint_on_the_oracle_prompts(
    llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    prompts = oracle_prompts(json.loads((llama_dir / "config.json").read_text())["vocab_size"])
    adapted = make_engine(llama_dir, max_loras=2, **LARGE)
    ref = lora("all8", adapters)
    got = run(adapted, [(p, ref) for p in prompts])
    merged = make_engine(merge(llama_dir, adapters["all8"], tmp_path / "merged"), **LARGE)
    want = run(merged, [(p, None) for p in prompts])
    assert got == want
    base = run(make_engine(llama_dir, **LARGE), [(p, None) for p in prompts])
    assert sum(g != b for g, b in zip(got, base, strict=True)) >= len(prompts) // 2


def test_a_mixed_batch_equals_each_adapter_alone(
    llama_dir: Path, adapters: dict[str, Path]
) -> None:
    prompts = oracle_prompts(json.loads((llama_dir / "config.json").read_text())["vocab_size"])
    names = [None, "all8", "qv4", "mlp2", "o16"]
    jobs = [
        (prompts[i], None if names[i % 5] is None else lora(names[i % 5] or "", adapters))
        for i in range(10)
    ]
    mixed = run(make_engine(llama_dir, max_loras=4, **LARGE), jobs)
    for job, got in zip(jobs, mixed, strict=True):
        alone = run(make_engine(llama_dir, max_loras=1, max_lora_rank=16, **LARGE), [job])
        assert got == alone[0]
    assert len({tuple(t) for t in mixed[:5]}) == 5  # every adapter changed its row


def test_fewer_slots_than_adapters_evict_the_least_recently_used_and_reload(
    llama_dir: Path, adapters: dict[str, Path]
) -> None:
    prompts = oracle_prompts(json.loads((llama_dir / "config.json").read_text())["vocab_size"])
    names = ["all8", "qv4", "mlp2", "o16", "all8", None]
    jobs = [(prompts[i], None if n is None else lora(n, adapters)) for i, n in enumerate(names)]
    wide = run(make_engine(llama_dir, max_loras=4, **LARGE), jobs)
    engine = make_engine(llama_dir, max_loras=2, **LARGE)
    assert run(engine, jobs) == wide  # waited for a slot whose adapter was idle
    slots = engine.adapters
    assert slots is not None and len(slots.resident) == 2 and slots.num_loads >= 4
    # A third adapter takes the least recently used slot; a resident one loads nothing.
    _older, newer = list(slots.resident)  # least recent first
    absent = next(n for n in names if n and lora(n, adapters) not in slots.resident)
    before = slots.num_loads
    index = names.index(absent)
    assert run(engine, [jobs[index]]) == [wide[index]]
    assert slots.num_loads == before + 1
    assert list(slots.resident) == [newer, lora(absent, adapters)]
    assert run(engine, [(prompts[0], newer)]) == run(
        make_engine(llama_dir, max_loras=1, **LARGE), [(prompts[0], newer)]
    )
    assert slots.num_loads == before + 1


def test_the_prefix_cache_is_keyed_by_adapter(llama_dir: Path, adapters: dict[str, Path]) -> None:
    engine = make_engine(llama_dir, max_loras=2, **LARGE)
    prompt = list(range(3, 67))  # four full blocks
    a, b = lora("all8", adapters), lora("qv4", adapters)

    def cached(adapter: LoRARequest | None) -> int:
        engine.add_request(EngineRequest(prompt, GREEDY, "c", tenant="t", lora=adapter))
        return run_to_completion(engine)["c"][-1].cached_tokens

    assert cached(a) == 0
    assert cached(a) == 48  # the same adapter hits (the last block recomputes its token)
    assert cached(b) == 0
    assert cached(None) == 0
    assert cached(b) == 48


def test_adapters_the_engine_cannot_serve_are_refused(
    llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = make_engine(llama_dir, max_loras=1, max_lora_rank=8)
    ask = EngineRequest([3, 4, 5], GREEDY, "x", lora=LoRARequest("gone", str(tmp_path / "no")))
    with pytest.raises(UnknownAdapterError, match=r"adapter_config\.json"):
        engine.add_request(ask)
    with pytest.raises(AdapterRankError, match="rank 16 is above max_lora_rank 8"):
        engine.add_request(EngineRequest([3], GREEDY, "x", lora=lora("o16", adapters)))
    head = build_adapter(tmp_path / "head", llama_dir, 2, ("q_proj",))
    peft = json.loads((head / "adapter_config.json").read_text())
    (head / "adapter_config.json").write_text(json.dumps(peft | {"target_modules": ["lm_head"]}))
    with pytest.raises(UnknownAdapterError, match="lm_head"):
        engine.add_request(EngineRequest([3], GREEDY, "x", lora=LoRARequest("h", str(head))))
    plain = make_engine(llama_dir)
    with pytest.raises(UnknownAdapterError, match="max_loras is 0"):
        plain.add_request(EngineRequest([3], GREEDY, "x", lora=lora("qv4", adapters)))
    assert not engine.has_work() and not plain.has_work()


def test_an_adapter_the_engine_would_misread_is_its_requests_400(
    llama_dir: Path, tmp_path: Path
) -> None:
    """A weights file that is no safetensors file is the request's UnknownAdapterError (a
    400), not an engine failure (a 500); PEFT options the engine does not apply and target
    modules that are not names are refused, not served wrong or crashed on."""
    engine = make_engine(llama_dir, max_loras=1, max_lora_rank=8)
    garbage = build_adapter(tmp_path / "garbage", llama_dir, 2, ("q_proj",))
    (garbage / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    dora = build_adapter(tmp_path / "dora", llama_dir, 2, ("q_proj",), use_dora=True)
    nested = build_adapter(tmp_path / "nested", llama_dir, 2, ("q_proj",))
    peft = json.loads((nested / "adapter_config.json").read_text())
    (nested / "adapter_config.json").write_text(json.dumps(peft | {"target_modules": [["q"]]}))
    for folder, error in [
        (garbage, r"unreadable adapter_model\.safetensors"),
        (dora, "use_dora"),
        (nested, "target_modules must be module names"),
    ]:
        ask = EngineRequest([3], GREEDY, "x", lora=LoRARequest(folder.name, str(folder)))
        with pytest.raises(UnknownAdapterError, match=error):
            engine.add_request(ask)
    assert not engine.has_work()


def test_lora_requests_info_reaches_the_gateway_metrics(
    llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """vLLM's gauge, its labels the engine's state: one slot, held by a running request's
    adapter, so the other adapter's request waits."""
    from gateway.telemetry.metrics import GatewayMetrics

    engine = make_engine(llama_dir, max_loras=1, **LARGE)
    for i, name in enumerate(("all8", "qv4")):
        engine.add_request(EngineRequest([3, 4, 5], GREEDY, f"m{i}", lora=lora(name, adapters)))
    engine.step()
    metrics = GatewayMetrics()
    metrics.watch_engine(engine.stats)
    text = metrics.exposition().decode()
    labels = 'max_lora="1",running_lora_adapters="all8",waiting_lora_adapters="qv4"'
    assert f"vllm:lora_requests_info{{{labels}}}" in text
    assert "tollgate_engine_lora_loads_total 1.0" in text
    run_to_completion(engine)
    plain = GatewayMetrics()
    plain.watch_engine(make_engine(llama_dir).stats)
    assert "lora" not in plain.exposition().decode()


def test_an_adapter_gone_from_disk_fails_its_request_alone(
    llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Checked at submission, removed before its load: that request fails
    (request_failed), the engine and the other requests go on."""
    folder = shutil.copytree(adapters["qv4"], tmp_path / "doomed")
    engine = make_engine(llama_dir, max_loras=2, **LARGE)
    engine.add_request(EngineRequest([3, 4, 5], GREEDY, "gone", lora=LoRARequest("d", str(folder))))
    engine.add_request(EngineRequest([3, 4, 5], GREEDY, "base"))
    (folder / "adapter_model.safetensors").unlink()
    outputs = run_to_completion(engine)
    assert outputs["gone"][-1].error == "request_failed"
    assert len(tokens_of(outputs["base"])) == GREEDY.max_tokens
    assert run(engine, [([3, 4, 5], lora("qv4", adapters))])[0]


def _running(engine: Engine) -> set[str]:
    return {r.request_id for r in engine.scheduler.running}


def test_a_request_waiting_for_an_adapter_slot_does_not_hold_back_the_queue(
    llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """One slot, held by a running adapter: a request on another adapter waits for it,
    the base-model request behind it starts at once; a request on the running adapter
    that arrives then waits too (that adapter drains for the parked one), and the parked
    one runs next."""
    # No express lane (it would start the short prompts before the queue is walked).
    engine = make_engine(llama_dir, max_loras=1, adaptive_step_budget=False, **LARGE)
    long = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest([3, 4, 5], long, "holder", lora=lora("all8", adapters)))
    engine.step()
    engine.add_request(EngineRequest([6, 7, 8], GREEDY, "parked", lora=lora("qv4", adapters)))
    engine.add_request(EngineRequest([9, 10, 11], GREEDY, "base"))
    engine.step()
    assert _running(engine) == {"holder", "base"}
    engine.add_request(EngineRequest([9, 10], GREEDY, "same", lora=lora("all8", adapters)))
    engine.step()
    assert _running(engine) == {"holder", "base"}
    order: list[str] = []
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
    assert order.index("holder") < order.index("parked") < order.index("same")
    assert order.index("base") < order.index("holder")


def test_the_gateways_list_of_target_modules_is_the_engines() -> None:
    """tenants/adapters.py checks a folder with the torch-free copy of TARGETS."""
    from backend.layers.lora import TARGETS
    from backend.requests import LORA_TARGET_MODULES

    assert set(TARGETS) == LORA_TARGET_MODULES


def test_a_replicas_stats_name_its_loaded_adapters_for_routing(
    llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """What a gateway's affinity routing reads from GET /internal/stats."""
    import msgspec

    from backend.wire import StatsReply, stats_reply

    engine = make_engine(llama_dir, max_loras=1, **LARGE)
    run(engine, [([3, 4, 5], lora("qv4", adapters))])
    run(engine, [([3, 4, 5], lora("all8", adapters))])  # evicts qv4: idle, one slot
    reply = msgspec.convert(stats_reply(True, engine.stats()), StatsReply)
    assert reply.loaded_lora_adapters == ["all8"]
