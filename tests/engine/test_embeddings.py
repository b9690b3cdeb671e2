"""Embeddings: the mean of the final (normed) hidden states, as Hugging Face computes
them, whether the prompt fits one pass or is chunked, and never in the way of the step
loop's requests."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from backend import AsyncEngine, SamplingParams
from backend.errors import OverloadedError, PromptTooLongError
from backend.requests import EngineRequest
from tests.engine.engine_support import check_blocks, make_engine, run_to_completion, tokens_of

TEXTS = ["Paged attention stores keys and values in fixed-size blocks.", "The quick fox."]


def _reference(path: Path, ids: list[int]) -> list[float]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state  # after the final norm
    values: list[float] = hidden[0].mean(dim=0).tolist()
    return values


def test_embedding_is_the_mean_of_the_final_hidden_states(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    ids = engine.embedding_prompt(TEXTS[0])
    [vector] = engine.embed([ids])
    assert len(vector) == engine.model_config.hidden_size
    torch.testing.assert_close(torch.tensor(vector), torch.tensor(_reference(llama_dir, ids)))
    check_blocks(engine)  # the borrowed blocks are back
    assert engine.block_manager.num_used_blocks == 0


def test_a_chunked_prompt_embeds_as_one_pass(llama_dir: Path) -> None:
    whole = make_engine(llama_dir)
    chunked = make_engine(llama_dir, max_num_batched_tokens=5)
    ids = whole.embedding_prompt(TEXTS[0])
    assert len(ids) > 10  # at least three chunks
    torch.testing.assert_close(torch.tensor(chunked.embed([ids])), torch.tensor(whole.embed([ids])))


def test_a_batch_embeds_in_one_pass_as_each_prompt_alone(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ragged prompts, a one-token one among them, in one flat batch: each vector is
    its prompt's alone, and the pass borrowed and gave back its blocks."""
    engine = make_engine(llama_dir)
    prompts = [engine.embedding_prompt(t) for t in TEXTS] + [[9], [5, 6, 7]]
    assert min(len(p) for p in prompts) == 1 < max(len(p) for p in prompts)
    passes: list[int] = []
    forward = engine.runner.model.forward

    def counted(*args: Any) -> Any:
        passes.append(1)
        return forward(*args)

    monkeypatch.setattr(engine.runner.model, "forward", counted)
    batched = engine.embed(prompts)
    assert len(passes) == 1
    alone = [engine.embed([p])[0] for p in prompts]
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(alone), atol=1e-5, rtol=1e-5)
    check_blocks(engine)
    assert engine.block_manager.num_used_blocks == 0


def test_a_pass_takes_a_steps_budget_of_whole_blocks(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, max_num_batched_tokens=16)  # 4 blocks of 4
    assert engine.take_embedding_batch([[1]] * 10) == 4  # one block each
    assert engine.take_embedding_batch([[1] * 5, [1] * 4, [1] * 8]) == 2  # 2 + 1 blocks, not 5
    assert engine.take_embedding_batch([[1] * 40, [1]]) == 1  # a long one goes alone


async def test_many_inputs_take_few_turns_of_the_step_loop(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,048 one-token inputs (the API's most) in passes of a step's budget, not one pass
    each: a client's big batch must not hold the loop for thousands of passes."""
    engine = AsyncEngine(make_engine(llama_dir))  # a budget of 256 tokens, 64 blocks
    passes: list[int] = []
    inner = engine.engine.runner.embed

    def counted(prompts: list[list[int]], blocks: list[list[int]]) -> list[list[float]]:
        passes.append(len(prompts))
        return inner(prompts, blocks)

    monkeypatch.setattr(engine.engine.runner, "embed", counted)
    try:
        vectors = await engine.embed([[7]] * 2048)
    finally:
        await engine.shutdown()
    assert len(vectors) == 2048 and vectors[0] == vectors[-1]
    assert passes == [64] * 32


def test_a_full_kv_cache_sheds_the_embedding(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, num_kv_blocks=24, max_model_len=96)
    engine.add_request(
        EngineRequest(list(range(3, 90)), SamplingParams(max_tokens=4, temperature=0), "long")
    )
    engine.step()  # the prompt holds 22 of the 24 blocks
    with pytest.raises(OverloadedError):
        engine.embed([engine.embedding_prompt(TEXTS[0])])
    run_to_completion(engine)


def test_an_input_longer_than_the_context_is_refused(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    with pytest.raises(PromptTooLongError):
        engine.embedding_prompt(list(range(3, 200)))


async def test_embeddings_run_between_steps_without_changing_generations(
    llama_dir: Path,
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = make_engine(llama_dir)
    alone.add_request(EngineRequest(TEXTS[1], params, "r"))
    expected = tokens_of(run_to_completion(alone)["r"])
    reference = [alone.embed([alone.embedding_prompt(t)])[0] for t in TEXTS]

    engine = AsyncEngine(make_engine(llama_dir))
    try:

        async def generate() -> list[int]:
            return [
                t
                async for out in engine.generate(EngineRequest(TEXTS[1], params, "r"))
                for t in out.token_ids
            ]

        tokens, vectors = await asyncio.gather(generate(), engine.embed([*TEXTS, TEXTS[0]]))
    finally:
        await engine.shutdown()
    assert tokens == expected
    assert vectors[0] == vectors[2] != vectors[1]
    torch.testing.assert_close(torch.tensor(vectors[:2]), torch.tensor(reference))
