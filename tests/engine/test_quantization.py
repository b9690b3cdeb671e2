"""Weight-only quantization (issue 34): the int8 layer against its torch reference, the
decoder swapped and the head kept, logits of the quantized model within a stated
tolerance of float32 on the oracle prompts, greedy agreement of the int8 engine with the
float32 one, and fp8 refused where there is no fp8 GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.layers.quant import QuantizationError, QuantizedLinear, check_quantization, quantize
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import make_engine, run_to_completion, tokens_of
from tests.engine.test_engine_oracle import oracle_prompts

# Relative to the largest logit of each prompt's last position: per-channel int8 keeps
# each weight within half a step (1/254 of its row's peak), and the CPU kernel rounds
# activations to bfloat16 (8 bits of mantissa).
# Measured 0.043-0.046 on the random test checkpoints (no dominant logit: the largest is
# small, so the ratio is pessimistic); bfloat16 activations alone give 0.015.
LOGIT_TOLERANCE = 0.08
GREEDY_AGREEMENT_FLOOR = 0.9  # of float32's tokens, each prompt up to its first divergence


def test_the_int8_layer_computes_its_dequantized_weight() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    layer = QuantizedLinear(linear, "int8")
    assert layer.weight.dtype == torch.int8 and layer.weight.element_size() == 1
    step = layer.scale.float()[:, None]  # one quantization step per output row
    assert ((layer.dequantized() - linear.weight).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(5, 256)
    reference = x @ layer.dequantized().T + linear.bias
    got = layer(x)
    assert got.dtype == x.dtype
    assert (got - reference).abs().max() <= 0.01 * reference.abs().max()


def test_a_zero_row_quantizes_to_zeros() -> None:
    linear = nn.Linear(8, 3, bias=False)
    with torch.no_grad():
        linear.weight[1] = 0
    layer = QuantizedLinear(linear, "int8")
    assert layer.weight[1].eq(0).all() and torch.isfinite(layer.scale).all()


def test_quantize_swaps_the_decoder_and_keeps_the_head(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, quantization="int8")
    model = engine.runner.model
    swapped = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    layers = engine.model_config.num_layers
    assert len(swapped) == 4 * layers  # qkv, o, gate_up, down
    assert not any(type(m) is nn.Linear and m is not model.lm_head for m in model.modules())
    assert "quantization=int8" in engine.describe()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_int8_logits_stay_within_tolerance_of_float32(
    kind: str, checkpoints: dict[str, Path]
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints[kind], dtype=torch.float32).eval()
    prompts = oracle_prompts(model.config.vocab_size)[:10]
    with torch.no_grad():
        exact = [model(torch.tensor([p])).logits[0, -1] for p in prompts]
        assert quantize(model, "int8") == 7 * model.config.num_hidden_layers  # HF: unfused
        approx = [model(torch.tensor([p])).logits[0, -1] for p in prompts]
    errors = [
        float((a - e).abs().max() / e.abs().max()) for a, e in zip(approx, exact, strict=True)
    ]
    print(f"{kind}: int8 logits' largest relative error {max(errors):.4f}")
    assert max(errors) < LOGIT_TOLERANCE


PYTHON_PROMPTS = [
    "def add(a, b):",
    "import json\n",
    "class Stack:\n    def",
    "for i in range(10):",
    "with open(path) as f:",
    'def parse(text):\n    """',
    "x = [i * i for i",
    "try:\n    import numpy",
    "if __name__ ==",
    "return sorted(items, key=",
]


def test_int8_engine_agrees_with_float32_greedy_on_the_trained_model() -> None:
    """The random test checkpoints have near-ties everywhere (their greedy tokens agree
    72-73% up to the first divergence under int8); the built-in model is trained, as a
    served model is: int8 keeps its float32 greedy tokens (240 of 240 when measured,
    where plain bfloat16 kept 211)."""
    from backend.builtin import BUILTIN_MODEL_DIR

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens = {}
    for method in ("none", "int8"):
        engine = Engine(
            BUILTIN_MODEL_DIR, EngineConfig(device="cpu", dtype="float32", quantization=method)
        )
        for i, prompt in enumerate(PYTHON_PROMPTS):
            engine.add_request(EngineRequest(prompt, params, f"p{i}"))
        outputs = run_to_completion(engine)
        tokens[method] = [tokens_of(outputs[f"p{i}"]) for i in range(len(PYTHON_PROMPTS))]
    pairs = zip(tokens["int8"], tokens["none"], strict=True)
    agreed = sum(_common_prefix(got, want) for got, want in pairs)
    total = sum(len(t) for t in tokens["none"])
    print(f"int8 greedy agreement on the built-in model: {agreed}/{total}")
    assert agreed / total >= GREEDY_AGREEMENT_FLOOR


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))


def test_fp8_is_refused_without_an_fp8_gpu(llama_dir: Path) -> None:
    with pytest.raises(QuantizationError, match="fp8 needs a GPU"):
        check_quantization("fp8", torch.device("cpu"))
    with pytest.raises(QuantizationError, match="fp8"):
        Engine(llama_dir, EngineConfig(quantization="fp8", device="cpu"))


def test_a_pre_quantized_checkpoint_is_refused_with_the_way_out(
    llama_dir: Path, tmp_path: Path
) -> None:
    """compressed-tensors / FP8 checkpoints carry scales this loader does not read: a
    clear refusal naming the method, rather than a shape or dtype error mid-load."""
    import json
    import shutil

    from backend.errors import CheckpointError

    copy = tmp_path / "fp8-checkpoint"
    shutil.copytree(llama_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
    }
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"compressed-tensors.*--quantization int8 or fp8"):
        make_engine(copy)
