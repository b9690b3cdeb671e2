"""Repetition, presence and frequency penalties and min_tokens, checked token for token
against transformers: its own generate() for the repetition penalty, and a plain greedy
loop over its logits with the OpenAI formulas for the others."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine.engine import Engine
from backend.layers.sampler import apply_penalties, apply_penalties_batch
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import make_engine, run_to_completion, text_of, tokens_of

NEW_TOKENS = 10
RP = 10.0  # strong: a seen token that greedy would pick loses to an unseen one
Adjust = Callable[[torch.Tensor, list[int]], None]  # logits row, output so far


def prompts(vocab: int, lengths: tuple[int, ...] = (5, 12, 33)) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def run(engine: Engine, batch: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, prompt in enumerate(batch):
        engine.add_request(EngineRequest(prompt, params, f"r{i}"))
    outputs = run_to_completion(engine)
    return [tokens_of(outputs[f"r{i}"]) for i in range(len(batch))]


@pytest.fixture(scope="module")
def hf_model(llama_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def reference(model: Any, prompt: list[int], adjust: Adjust, stop: set[int]) -> list[int]:
    """Greedy decoding with transformers' logits, adjusted by `adjust` before the argmax."""
    output: list[int] = []
    with torch.no_grad():
        while len(output) < NEW_TOKENS:
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
            adjust(logits, output)
            output.append(int(logits.argmax()))
            if output[-1] in stop:
                break
    return output


def test_repetition_penalty_matches_transformers(llama_dir: Path, hf_model: Any) -> None:
    """Long prompts cover a quarter of the vocabulary, so greedy picks tokens already seen
    and a strong penalty must change the answer."""
    engine = make_engine(llama_dir)
    batch = prompts(engine.model_config.vocab_size, lengths=(60, 72, 85))
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, repetition_penalty=RP
    )
    got = run(engine, batch, params)
    with torch.no_grad():
        want = [
            hf_model.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                repetition_penalty=RP,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in batch
        ]
    assert got == want
    plain = run(engine, batch, replace(params, repetition_penalty=1.0))
    assert plain != got  # the penalty changed something, so the check above means something


def test_presence_and_frequency_penalties_follow_the_openai_formula(
    llama_dir: Path, hf_model: Any
) -> None:
    engine = make_engine(llama_dir)
    batch = prompts(engine.model_config.vocab_size)
    params = SamplingParams(
        max_tokens=NEW_TOKENS,
        temperature=0,
        ignore_eos=True,
        presence_penalty=0.7,
        frequency_penalty=1.5,
    )

    def openai_formula(logits: torch.Tensor, output: list[int]) -> None:
        for token, count in Counter(output).items():
            logits[token] -= 1.5 * count + 0.7

    assert run(engine, batch, params) == [
        reference(hf_model, p, openai_formula, set()) for p in batch
    ]


def test_min_tokens_masks_stop_tokens_until_reached(llama_dir: Path, hf_model: Any) -> None:
    engine = make_engine(llama_dir)
    batch = prompts(engine.model_config.vocab_size)
    plain = run(
        engine, batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    )
    # Each prompt's first two greedy tokens are stop tokens: without min_tokens every
    # output would end at once.
    stops = sorted({t for out in plain for t in out[:2]})
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, stop_token_ids=stops, min_tokens=4
    )
    got = run(engine, batch, params)

    def mask_stops(logits: torch.Tensor, output: list[int]) -> None:
        if len(output) < 4:
            logits[stops] = float("-inf")

    assert got == [reference(hf_model, p, mask_stops, set(stops)) for p in batch]
    assert all(len(out) >= 5 or len(out) == NEW_TOKENS for out in got)
    assert all(not set(out[:4]) & set(stops) for out in got)
    no_min = run(
        engine,
        batch,
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, stop_token_ids=stops),
    )
    assert [len(out) for out in no_min] == [1, 1, 1]


def test_min_tokens_masks_eos_unless_it_is_ignored(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    eos = sorted(engine.tokenizer.eos_token_ids)
    logits = torch.zeros(1, engine.model_config.vocab_size)
    runner, batch = engine.runner, _scheduled(engine, min_tokens=2)
    assert runner._process_logits(logits, batch)[0, eos].eq(float("-inf")).all()
    batch = _scheduled(engine, min_tokens=2, ignore_eos=True)
    assert runner._process_logits(logits, batch) is logits  # nothing to do: no copy


def _scheduled(engine: Engine, **params: Any) -> list[Any]:
    from backend.engine.batch import ScheduledRequest

    return [
        ScheduledRequest(
            request_id="x",
            token_ids=[5],
            start_pos=3,
            block_ids=[0],
            params=SamplingParams(max_tokens=4, **params),
            sample=True,
            prompt_token_ids=[3, 4, 5],
            output_token_ids=[],
        )
    ]


def test_min_tokens_defers_stop_strings(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    prompt = prompts(engine.model_config.vocab_size)[1]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest(prompt, greedy, "free"))
    text = text_of(run_to_completion(engine)["free"])
    stop = text.strip()[:1]
    assert stop, "the greedy output has visible text to stop on"
    for name, min_tokens in (("early", 0), ("late", 6)):
        engine.add_request(
            EngineRequest(
                prompt,
                SamplingParams(
                    max_tokens=NEW_TOKENS,
                    temperature=0,
                    ignore_eos=True,
                    stop=[stop],
                    min_tokens=min_tokens,
                ),
                name,
            )
        )
    outputs = run_to_completion(engine)
    early, late = tokens_of(outputs["early"]), tokens_of(outputs["late"])
    assert len(early) < 6 <= len(late)


def test_penalties_math_on_one_row() -> None:
    row = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5])
    in_prompt = torch.tensor([True, True, False, False, False])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(row, params, in_prompt, [2, 2, 3])
    # token 0, 1: prompt only; 2: twice in the output; 3: once; 4: never seen.
    want = [1.0, -4.0, 0.5 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 0.5]
    assert row.tolist() == pytest.approx(want)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_tokens", 17),  # above max_tokens=16
        ("min_tokens", -1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", float("nan")),
    ],
)
def test_out_of_range_values_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_batched_penalties_match_the_one_row_form() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(4, vocab, generator=gen) * 3
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=2.0),
    ]
    outputs = [[1, 1, 7], [], [3, 49, 3, 3, 0]]
    prompts = torch.rand(3, vocab, generator=gen) < 0.2
    rows = [0, 2, 3]  # row 1 has no penalties
    want = logits.clone()
    for row, p, mask, out in zip(rows, params, prompts, outputs, strict=True):
        apply_penalties(want[row], p, mask, out)
    got = logits.clone()
    longest = max(map(len, outputs))
    padded = torch.tensor([o + [-1] * (longest - len(o)) for o in outputs])
    values = torch.tensor(
        [[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in params]
    )
    apply_penalties_batch(got, torch.tensor(rows), prompts, padded, values)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], logits[1])
