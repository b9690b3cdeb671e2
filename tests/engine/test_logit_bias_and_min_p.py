"""logit_bias and min_p (issue 32 item 16): batched on the device with the step's other
sampling inputs; OpenAI's and vLLM's semantics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.errors import InvalidParameterError
from backend.layers.sampler import SamplingTensors, sample_tokens
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import make_engine, run_to_completion, tokens_of

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def greedy_with(**fields: object) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **fields)  # type: ignore[arg-type]


def test_a_positive_bias_forces_a_token_and_a_negative_one_bans_it(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    engine.add_request(EngineRequest("the quick brown fox", GREEDY, "plain"))
    plain = tokens_of(run_to_completion(engine)["plain"])
    engine.add_request(
        EngineRequest("the quick brown fox", greedy_with(logit_bias={7: 100.0}), "forced")
    )
    engine.add_request(
        EngineRequest("the quick brown fox", greedy_with(logit_bias={plain[0]: -100}), "banned")
    )
    engine.add_request(
        EngineRequest("the quick brown fox", GREEDY, "beside")
    )  # same batch, no bias
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["forced"]) == [7] * 6
    assert tokens_of(outputs["banned"])[0] != plain[0]
    assert tokens_of(outputs["beside"]) == plain


def test_min_p_of_one_keeps_only_the_most_likely_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    params = [SamplingParams(temperature=1.0, min_p=1.0)] * 2 + [SamplingParams(temperature=1.0)]
    stage_params = SamplingTensors.build(params, 40, logits.device)
    for _ in range(10):
        tokens = sample_tokens(logits, [None] * 3, stage_params)
        assert tokens[:2].tolist() == logits[:2].argmax(dim=-1).tolist()


def test_min_p_drops_tokens_below_its_share_of_the_best() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = [SamplingParams(temperature=1.0, min_p=0.4)]  # keeps p >= 0.2: tokens 0, 1
    tensors = SamplingTensors.build(params, 4, logits.device)
    seen = {int(sample_tokens(logits, [None], tensors)[0]) for _ in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ],
)
def test_out_of_range_values_are_refused(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert refused.value.param == param


def test_a_bias_past_the_vocabulary_is_refused_by_the_engine(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidParameterError, match="logit_bias"):
        engine.add_request(EngineRequest("hello", greedy_with(logit_bias={vocab: 1.0}), "x"))
