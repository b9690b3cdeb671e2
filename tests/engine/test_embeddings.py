"""Embeddings: the mean of the final (normed) hidden states, as Hugging Face computes
them, whether the prompt fits one pass or is chunked, and never in the way of the step
loop's requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

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
    vector = engine.embed(ids)
    assert len(vector) == engine.model_config.hidden_size
    torch.testing.assert_close(torch.tensor(vector), torch.tensor(_reference(llama_dir, ids)))
    check_blocks(engine)  # the borrowed blocks are back
    assert engine.block_manager.num_used_blocks == 0


def test_a_chunked_prompt_embeds_as_one_pass(llama_dir: Path) -> None:
    whole = make_engine(llama_dir)
    chunked = make_engine(llama_dir, max_num_batched_tokens=5)
    ids = whole.embedding_prompt(TEXTS[0])
    assert len(ids) > 10  # at least three chunks
    torch.testing.assert_close(torch.tensor(chunked.embed(ids)), torch.tensor(whole.embed(ids)))


def test_a_full_kv_cache_sheds_the_embedding(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, num_kv_blocks=24, max_model_len=96)
    engine.add_request("long", list(range(3, 90)), SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # the prompt holds 22 of the 24 blocks
    with pytest.raises(OverloadedError):
        engine.embed(engine.embedding_prompt(TEXTS[0]))
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
    alone.add_request("r", TEXTS[1], params)
    expected = tokens_of(run_to_completion(alone)["r"])
    reference = [alone.embed(alone.embedding_prompt(t)) for t in TEXTS]

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
