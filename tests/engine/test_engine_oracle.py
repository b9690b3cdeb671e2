"""The correctness oracle: greedy tokens equal transformers' generate(do_sample=False)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.sampling import SamplingParams
from tests.engine.engine_support import make_engine, run_to_completion, tokens_of

# Lengths straddle the 4-token test blocks; the longest spans many of them.
PROMPT_LENGTHS = (1, 4, 5, 13, 30)
NEW_TOKENS = 10


def prompts(vocab: int) -> list[list[int]]:
    return [[(i * 37 + n * 11) % (vocab - 2) + 2 for i in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(path: Path, prompt_list: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()  # type: ignore[no-untyped-call]
    refs = []
    with torch.no_grad():
        for p in prompt_list:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            refs.append(out[0, len(p) :].tolist())
    return refs


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_matches_transformers_alone_and_batched(
    kind: str, checkpoints: dict[str, Path]
) -> None:
    path = checkpoints[kind]
    engine = make_engine(path)
    prompt_list = prompts(engine.model_config.vocab_size)
    expected = hf_greedy(path, prompt_list)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

    for i, p in enumerate(prompt_list):  # alone
        engine.add_request(f"alone-{i}", p, params)
        assert tokens_of(run_to_completion(engine)[f"alone-{i}"]) == expected[i]

    for i, p in enumerate(prompt_list):  # all in one batch
        engine.add_request(f"batch-{i}", p, params)
    outputs = run_to_completion(engine)
    assert [tokens_of(outputs[f"batch-{i}"]) for i in range(len(prompt_list))] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_staggered_arrivals_match_transformers(checkpoints: dict[str, Path]) -> None:
    """Requests join while others decode: prefill and decode share steps."""
    path = checkpoints["llama"]
    engine = make_engine(path)
    prompt_list = prompts(engine.model_config.vocab_size)
    expected = hf_greedy(path, prompt_list)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for i, p in enumerate(prompt_list):
        engine.add_request(f"r{i}", p, params)
        for _ in range(3):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
    for rid, outs in run_to_completion(engine).items():
        outputs.setdefault(rid, []).extend(tokens_of(outs))
    assert [outputs[f"r{i}"] for i in range(len(prompt_list))] == expected
