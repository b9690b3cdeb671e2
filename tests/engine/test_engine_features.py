"""Engine features on a tiny random Llama: aborts against the step counter, n > 1,
logprobs, the per-tenant prefix cache, seeded sampling under chunking and preemption,
and the stats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine.engine import Engine
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import check_blocks, make_engine, run_to_completion, tokens_of

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = list(range(2, 40))  # 38 tokens: 9 full blocks of 4


def test_abort_frees_the_blocks_within_one_step(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    long = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest(PROMPT, long, "victim"))
    engine.add_request(EngineRequest([5, 6, 7], long, "bystander"))
    for _ in range(3):
        engine.step()
    held = len(engine.block_manager.block_ids("victim"))
    used = engine.stats().kv_blocks_used
    assert held > 0
    steps = engine.num_steps
    engine.abort("victim")
    outs = engine.step()
    assert engine.num_steps == steps + 1
    assert [o.finish_reason for o in outs if o.request_id == "victim"] == ["abort"]
    assert engine.block_manager.block_ids("victim") == []
    # Its blocks are released (the bystander grew by at most one block meanwhile).
    assert engine.stats().kv_blocks_used <= used - held + 1
    check_blocks(engine)


def test_abort_of_a_preempted_request(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, num_kv_blocks=24, max_model_len=96)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(EngineRequest([5 + i, 6, 7, 8, 9], params, f"r{i}"))
    while engine.stats().num_preemptions == 0:
        engine.step()
    [preempted] = list(engine.scheduler.waiting)
    engine.abort(preempted.request_id)
    engine.abort(preempted.request_id)
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == preempted.request_id] == ["abort"]
    check_blocks(engine)
    results = run_to_completion(engine)
    assert preempted.request_id not in results
    assert engine.stats().kv_blocks_used == 0


def test_n_completions_share_the_prompt_and_draw_apart(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, enable_prefix_caching=False)
    # ignore_eos: a sampled EOS would end a completion early under some random checkpoints.
    seeded = SamplingParams(max_tokens=10, seed=11, n=3, ignore_eos=True)
    engine.add_request(EngineRequest(PROMPT, seeded, "n3"))
    shared = []
    outputs = []
    while engine.has_work():
        outputs += engine.step()
        tables = [engine.block_manager.block_ids(r.request_id) for r in engine.scheduler.running]
        if len(tables) == 3:
            shared.append(len(set(tables[0]) & set(tables[1]) & set(tables[2])))
        check_blocks(engine)
    # The 9 full prompt blocks are computed once and held by all three completions.
    assert max(shared) == 9
    by_index = {i: [t for o in outputs if o.index == i for t in o.token_ids] for i in range(3)}
    assert all(o.request_id == "n3" for o in outputs)
    assert sum(o.finished for o in outputs) == 3
    assert all(len(tokens) == 10 for tokens in by_index.values())
    # Completion i draws with seed + i: it equals a lone request with that seed.
    for i in range(3):
        engine.add_request(
            EngineRequest(
                PROMPT, SamplingParams(max_tokens=10, seed=11 + i, ignore_eos=True), f"single{i}"
            )
        )
        assert tokens_of(run_to_completion(engine)[f"single{i}"]) == by_index[i]
    assert len({tuple(t) for t in by_index.values()}) > 1


def test_greedy_n_completions_are_identical(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    engine.add_request(EngineRequest(PROMPT, SamplingParams(max_tokens=8, temperature=0, n=2), "g"))
    outs = run_to_completion(engine)["g"]
    first = [t for o in outs if o.index == 0 for t in o.token_ids]
    assert first == [t for o in outs if o.index == 1 for t in o.token_ids]
    engine.add_request(EngineRequest(PROMPT, SamplingParams(max_tokens=8, temperature=0), "single"))
    assert tokens_of(run_to_completion(engine)["single"]) == first


def test_logprobs_match_transformers(llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = make_engine(llama_dir)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    engine.add_request(EngineRequest(PROMPT, params, "lp"))
    outs = run_to_completion(engine)["lp"]
    logprobs = [lp for o in outs for lp in o.logprobs or []]
    assert [lp.token_id for lp in logprobs] == tokens_of(outs)

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    model.eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        ids = torch.tensor([PROMPT + tokens_of(outs)])
        ref = torch.log_softmax(model(ids).logits[0, len(PROMPT) - 1 : -1].float(), dim=-1)
    for lp, row in zip(logprobs, ref, strict=True):
        top = row.topk(3)
        assert lp.rank == 1  # greedy
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_sampled_logprobs_rank_the_drawn_token(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    params = SamplingParams(max_tokens=20, temperature=1.5, seed=3, logprobs=0)
    engine.add_request(EngineRequest(PROMPT, params, "s"))
    outs = run_to_completion(engine)["s"]
    logprobs = [lp for o in outs for lp in o.logprobs or []]
    assert len(logprobs) == 20 and all(lp.top == [] for lp in logprobs)
    assert all(lp.logprob <= 0 and lp.rank >= 1 for lp in logprobs)
    assert any(lp.rank > 1 for lp in logprobs)  # a hot temperature leaves the argmax


def test_prefix_cache_hits_are_reported_and_salted_per_tenant(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    cached = {}
    for rid, tenant in (("a1", "acme"), ("a2", "acme"), ("b1", "bolt"), ("anon", None)):
        engine.add_request(EngineRequest(PROMPT, GREEDY, rid, tenant=tenant))
        cached[rid] = run_to_completion(engine)[rid][-1].cached_tokens
    assert cached == {"a1": 0, "a2": 36, "b1": 0, "anon": 0}
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 * 38, 36)
    assert stats.prefix_cache_hit_rate == pytest.approx(36 / 152)
    assert stats.kv_blocks_cached > 0 and stats.kv_blocks_used == 0


def test_tenants_may_share_the_cache_when_configured(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, share_prefix_cache=True)
    for rid, tenant in (("a", "acme"), ("b", "bolt")):
        engine.add_request(EngineRequest(PROMPT, GREEDY, rid, tenant=tenant))
        last = run_to_completion(engine)[rid][-1]
    assert last.cached_tokens == 36


def seeded_tokens(engine: Engine, rid: str) -> list[int]:
    return tokens_of(run_to_completion(engine)[rid])


def test_seeded_sampling_survives_chunking_and_preemption(llama_dir: Path) -> None:
    seeded = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
    alone_engine = make_engine(llama_dir)
    alone_engine.add_request(EngineRequest(PROMPT, seeded, "s"))
    alone = seeded_tokens(alone_engine, "s")

    # Chunks of 8 tokens and a pool too small for everyone: preemption is forced.
    engine = make_engine(llama_dir, num_kv_blocks=26, max_num_batched_tokens=8)
    noise = SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True)
    engine.add_request(EngineRequest(list(range(50, 80)), noise, "n1"))
    engine.add_request(EngineRequest(PROMPT, seeded, "s"))
    engine.add_request(EngineRequest(list(range(80, 100)), noise, "n2"))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["s"]) == alone
    assert engine.stats().num_preemptions > 0


def test_stats_count_prefill_and_decode_tokens(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    engine.add_request(EngineRequest(PROMPT, GREEDY, "a"))
    engine.step()
    stats = engine.stats()
    assert (stats.step_prefill_tokens, stats.step_decode_tokens) == (16, 0)
    assert (stats.num_running, stats.num_waiting, stats.num_steps) == (1, 0, 1)
    outputs = run_to_completion(engine)["a"]
    assert {o.prefill_chunks for o in outputs} == {3}  # every output reports its prompt's steps
    stats = engine.stats()
    # 38 prompt tokens in chunks of 16, then 11 decode steps (the 12th token ends it).
    assert (stats.total_prefill_tokens, stats.total_decode_tokens) == (38, 11)
    assert (stats.step_prefill_tokens, stats.step_decode_tokens) == (0, 1)
    assert stats.kv_blocks_free + stats.kv_blocks_cached + stats.kv_blocks_used == 128


def test_default_max_model_len_fits_the_pool(llama_dir: Path) -> None:
    # The checkpoint's context is 1024 tokens; 64 blocks of 4 hold 256.
    engine = make_engine(llama_dir, num_kv_blocks=64, max_model_len=None)
    assert engine.max_model_len == 256
    roomy = make_engine(llama_dir, num_kv_blocks=512, max_model_len=None)
    assert roomy.max_model_len == 1024  # beyond max_num_batched_tokens: chunked prefill
