"""`tollgate capacity`: the planner against the seeds' worked examples (computed here from
the seeds' own figures), against the engine's KV arithmetic and model, and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from backend.builtin import BUILTIN_MODEL_DIR
from backend.capacity.model import GIB
from backend.capacity.planner import Inputs, plan
from backend.capacity.presets import MODELS_DIR, gpu_preset, model_preset, model_presets
from backend.config import EngineConfig
from backend.engine.model_runner import kv_bytes_per_block
from backend.layers.attention import TorchPagedAttention
from backend.models.config import load_model_config
from backend.models.llama import LlamaForCausalLM
from backend.sim.cost import CostModel
from backend.sim.simulator import Simulator
from gateway.cli.commands import main

TORCH_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,  # the engine's --kv-cache-dtype: one byte plus a float32 scale
    "fp8": torch.float8_e4m3fn,
}


def capacity(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, object]:
    assert main(["capacity", *flags, "--json"]) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


def failure(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["capacity", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


@pytest.mark.parametrize("name", model_presets())
def test_parameters_are_counted_exactly_as_the_engine_builds_the_model(name: str) -> None:
    cfg = load_model_config(MODELS_DIR / name)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, 16, TorchPagedAttention())  # positions: buffers only
    assert model_preset(name).param_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", model_presets())
@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
def test_kv_bytes_agree_with_the_engine(name: str, dtype: str) -> None:
    cfg = load_model_config(MODELS_DIR / name)
    block = kv_bytes_per_block(cfg, 16, TORCH_DTYPES[dtype])
    assert model_preset(name).kv_bytes_per_token(dtype) * 16 == block
    p = plan(
        Inputs(
            gpu_preset("H200"), model_preset(name), kv_dtype=dtype, context=1024, tensor_parallel=4
        )
    )
    assert p.value("kv_bytes_per_token") == block / 16


def test_a_checkpoint_folder_counts_a_tied_head_once(capsys: pytest.CaptureFixture[str]) -> None:
    """The built-in model ties its LM head to the embeddings: its count is exactly the
    tensors stored in its safetensors file."""
    with safe_open(str(BUILTIN_MODEL_DIR / "model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    data = capacity(capsys, "--model-dir", str(BUILTIN_MODEL_DIR), "--gpu", "L4")
    assert data["params"] == stored
    assert data["inputs"]["context"] == 2048  # type: ignore[index]
    assert data["inputs"]["dtype"] == "fp32"  # type: ignore[index]
    assert "--model-dir" in failure(capsys, "--model-dir", "/nonexistent", "--gpu", "L4")


def test_published_parameter_counts() -> None:
    """Meta's and Mistral's model cards: Llama-2-7B 6.74B, Llama-3-8B 8.03B, Mistral 7.24B;
    and the seeds' approximation 12 L H^2 + 2 V H lands within 2% for Llama-2-7B."""
    assert model_preset("Llama-2-7B").param_count() == 6_738_415_616
    assert model_preset("llama-3-8b").param_count() == 8_030_261_248
    assert model_preset("mistral-7b").param_count() == 7_241_732_096
    approx = 12 * 32 * 4096**2 + 2 * 32000 * 4096
    assert abs(model_preset("llama-2-7b").param_count() / approx - 1) < 0.02


def test_seed_70b_fp16_reads_140_gb_a_step_42_ms_on_an_h100(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Fact 2: 70B FP16 -> 140 GB read per decode step; at 3.35 TB/s a 42 ms floor. (The
    weights alone do not fit one 80 GB H100, so a roomier device with its bandwidth.)"""
    data = capacity(
        capsys,
        "--params",
        "70e9",
        "--dtype",
        "fp16",
        "--gpu-memory-gb",
        "200",
        "--bandwidth-tbs",
        "3.35",
        "--tflops",
        "989",
    )
    assert data["weights_bytes"] == 140e9
    assert data["kv_bytes_per_token"] is None and data["max_concurrent_sequences"] is None
    assert round(float(data["decode_step_floor_s"]) * 1000) == 42  # type: ignore[arg-type]
    err = failure(capsys, "--params", "70e9", "--dtype", "fp16", "--gpu", "H100-SXM")
    assert "--tensor-parallel 2" in err and "do not fit" in err


def test_seed_80_layers_8_kv_heads_at_8k_is_2_5_gib_per_sequence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = capacity(
        capsys,
        "--preset",
        "llama-3-70b",
        "--gpu",
        "H100-SXM",
        "--tensor-parallel",
        "4",
        "--context",
        "8192",
    )
    assert data["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert data["kv_bytes_per_sequence"] == 2.5 * GIB


def test_seed_7b_on_an_a100_80gb_serves_27_at_4k_and_13_at_8k(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Chapter 10: 80 GB A100, 7B fp16 (14 GB), 8 GB activations, 4 GB margin -> 54 GB for
    KV at 512 KB a token: 27 concurrent sequences at 4K context, 13 at 8K."""
    seven_b = [
        "--layers",
        "32",
        "--hidden",
        "4096",
        "--heads",
        "32",
        "--intermediate",
        "11008",
        "--vocab",
        "32000",
        "--params",
        "7e9",
        "--dtype",
        "fp16",
    ]
    reserve = ["--gpu", "A100-80GB", "--activation-gb", "8", "--margin-gb", "4"]
    at_4k = capacity(capsys, *seven_b, *reserve, "--context", "4096")
    assert at_4k["kv_bytes_per_token"] == 512 * 2**10
    assert at_4k["kv_bytes_per_sequence"] == 2 * GIB
    assert at_4k["weights_bytes"] == 14e9
    assert at_4k["kv_budget_bytes"] == (80 - 8 - 4) * GIB - 14e9
    assert at_4k["max_concurrent_sequences"] == 27
    assert (
        capacity(capsys, *seven_b, *reserve, "--context", "8192")["max_concurrent_sequences"] == 13
    )
    # The preset (6.74B parameters) gives the same answers.
    preset = capacity(capsys, "--preset", "llama-2-7b", *reserve, "--context", "4096")
    assert preset["max_concurrent_sequences"] == 27


def test_seed_exercise_13b_max_context_for_20_sequences(capsys: pytest.CaptureFixture[str]) -> None:
    """Exercise 1: 80 GB A100, 13B fp16 (26 GB), 8 GB activations: the context 20
    sequences can each hold is the KV tokens / 20."""
    data = capacity(
        capsys,
        "--preset",
        "llama-2-13b",
        "--params",
        "13e9",
        "--gpu",
        "A100-80GB",
        "--activation-gb",
        "8",
        "--context",
        "2048",
    )
    per_token = 2 * 40 * 5120 * 2
    assert data["kv_bytes_per_token"] == per_token
    tokens = math.floor((80 * GIB - 8 * GIB - 26e9) / per_token)
    assert data["max_kv_tokens"] == tokens and data["max_concurrent_sequences"] == tokens // 2048
    assert 2807 <= tokens // 20 <= 3200  # the seeds' 2,807 counts GB as 10^9 bytes


def test_seed_littles_law(capsys: pytest.CaptureFixture[str]) -> None:
    """10 requests/s of 5 s each need 50 concurrent sequences; 100 requests a minute of
    200 ms TTFT + 500 tokens at 50 tokens/s need about 17."""
    base = ["--preset", "llama-3-8b", "--gpu", "H100-SXM", "--context", "2048"]
    data = capacity(capsys, *base, "--rate", "10", "--duration-s", "5")
    assert data["required_concurrency"] == 50 and data["fits"] is True
    data = capacity(capsys, *base, "--rate", str(100 / 60), "--duration-s", str(0.2 + 500 / 50))
    assert round(float(data["required_concurrency"])) == 17  # type: ignore[arg-type]
    too_many = capacity(capsys, *base, "--rate", "1000", "--duration-s", "10")
    assert too_many["fits"] is False


def test_little_from_lengths_is_a_fixed_point_of_the_cost_model() -> None:
    i = Inputs(
        gpu_preset("H100-SXM"),
        model_preset("llama-3-8b"),
        prompt_tokens=1000,
        output_tokens=200,
        rate=30,
    )
    p = plan(i)
    required = p.number("required_concurrency")
    batch = math.ceil(required)
    service = p.cost.prefill_step(1000) + 199 * p.cost.decode_step(batch, p.context)
    assert required == pytest.approx(30 * service)
    assert p.context == 1200


def test_decode_floor_and_the_compute_bound_batch_come_from_the_simulators_cost_model() -> None:
    p = plan(Inputs(gpu_preset("H100-SXM"), model_preset("llama-3-8b"), context=128))
    assert isinstance(p.cost, CostModel)
    assert isinstance(Simulator(EngineConfig(), p.cost, num_kv_blocks=8).cost, CostModel)
    assert p.value("decode_step_floor_s") == p.cost.decode_step(1, 128)
    weights_only = p.cost.model.weight_bytes / 3.35e12
    assert p.number("decode_step_floor_s") > weights_only
    turn = int(p.number("compute_bound_batch"))
    assert p.cost.roofs(p.cost.decode_chunks(turn, 128)).bound == "compute"
    assert p.cost.roofs(p.cost.decode_chunks(turn - 1, 128)).bound == "memory"
    total = p.number("decode_tokens_per_s_ceiling")
    seqs = int(p.number("max_concurrent_sequences"))
    assert total == pytest.approx(seqs / p.cost.decode_step(seqs, 128))


def test_fp8_weights_use_the_fp8_peak_and_half_the_bytes() -> None:
    bf16 = plan(Inputs(gpu_preset("H100-SXM"), model_preset("llama-3-8b"), context=4096))
    fp8 = plan(
        Inputs(gpu_preset("H100-SXM"), model_preset("llama-3-8b"), context=4096, dtype="fp8")
    )
    assert fp8.value("weights_bytes") == bf16.number("weights_bytes") / 2
    assert fp8.cost.gpu.peak_flops == gpu_preset("H100-SXM").fp8_flops
    assert fp8.cost.gpu.peak_flops > bf16.cost.gpu.peak_flops
    # Weight-only: the KV cache stays in the compute dtype, as the engine keeps it.
    assert fp8.value("kv_bytes_per_token") == bf16.number("kv_bytes_per_token")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_a_one_byte_kv_cache_counts_its_scales(kv_dtype: str) -> None:
    """Llama 3 8B (head_dim 128): 2 x 32 x 8 x (128 + 4) = 67,584 B a token against
    131,072 in bf16, so 2 x 128 / 132 = 1.94x the sequences at a context."""
    arch = model_preset("llama-3-8b")
    bf16 = plan(Inputs(gpu_preset("H100-SXM"), arch, context=2048))
    one = plan(Inputs(gpu_preset("H100-SXM"), arch, context=2048, kv_dtype=kv_dtype))
    assert one.value("kv_bytes_per_token") == 2 * 32 * 8 * (128 + 4) == 67_584
    assert bf16.value("kv_bytes_per_token") == 131_072
    ratio = one.number("max_concurrent_sequences") / bf16.number("max_concurrent_sequences")
    assert ratio == pytest.approx(2 * 128 / 132, rel=0.01)
    assert (
        "scale bytes" in one.lines[[x.key for x in one.lines].index("kv_bytes_per_token")].formula
    )


def test_text_output_shows_each_formula_with_its_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "capacity",
                "--preset",
                "llama-2-7b",
                "--gpu",
                "A100-80GB",
                "--context",
                "4096",
                "--rate",
                "2",
                "--output-tokens",
                "100",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "2 x layers x kv_heads x head_dim x bytes = 2 x 32 x 32 x 128 x 2 (fp16)" in out
    assert "params x bytes per weight = 6,738,415,616 x 2 (fp16)" in out
    assert "roofline model" in out


def test_json_has_the_listed_keys(capsys: pytest.CaptureFixture[str]) -> None:
    data = capacity(
        capsys,
        "--preset",
        "qwen2.5-7b",
        "--gpu",
        "L4",
        "--context",
        "8192",
        "--rate",
        "1",
        "--output-tokens",
        "50",
    )
    for key in (
        "params",
        "weights_bytes",
        "kv_bytes_per_token",
        "kv_bytes_per_sequence",
        "kv_budget_bytes",
        "max_kv_tokens",
        "max_concurrent_sequences",
        "decode_step_floor_s",
        "decode_tokens_per_s_ceiling",
        "prefill_s",
        "required_concurrency",
        "fits",
    ):
        assert data[key] is not None, key


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--preset", "llama-3-8b", "--gpu", "H100-SXM", "--context", "-5"], "--context"),
        (
            [
                "--layers",
                "32",
                "--hidden",
                "4096",
                "--heads",
                "30",
                "--intermediate",
                "1",
                "--vocab",
                "10",
                "--gpu",
                "L4",
            ],
            "--heads",
        ),
        (
            [
                "--layers",
                "32",
                "--hidden",
                "4096",
                "--heads",
                "32",
                "--kv-heads",
                "5",
                "--intermediate",
                "1",
                "--vocab",
                "10",
                "--gpu",
                "L4",
            ],
            "--kv-heads",
        ),
        (["--layers", "32", "--hidden", "4096", "--gpu", "L4"], "--heads"),
        (["--preset", "llama-3-8b", "--gpu", "B300"], "--gpu"),
        (["--preset", "llama-9", "--gpu", "L4"], "--preset"),
        (["--preset", "llama-3-8b", "--gpu", "L4", "--tensor-parallel", "3"], "--tensor-parallel"),
        (["--preset", "llama-3-8b", "--gpu", "L4", "--activation-gb", "-1"], "--activation-gb"),
        (
            ["--preset", "llama-3-8b", "--gpu", "L4", "--gpu-memory-utilization", "1.5"],
            "--gpu-memory-utilization",
        ),
        (
            [
                "--preset",
                "llama-3-8b",
                "--gpu-memory-gb",
                "-80",
                "--bandwidth-tbs",
                "1",
                "--tflops",
                "1",
            ],
            "--gpu-memory-gb",
        ),
        (["--preset", "llama-3-8b", "--gpu", "L4", "--rate", "3"], "--rate"),
        (["--preset", "llama-3.1-8b", "--gpu", "L4"], "--context"),
        (["--preset", "llama-3-70b", "--gpu", "A100-80GB"], "--tensor-parallel 2"),
        (["--params", "-7", "--gpu", "L4"], "--params"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], flags: list[str], flag: str
) -> None:
    assert flag in failure(capsys, *flags)


def test_seed_llama_3_8b_at_128k_holds_about_its_weights_in_kv_per_sequence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Overview, exercise B: one 128k-token sequence of Llama-3-8B needs 2 x 32 x 8 x 128
    x 2 bytes a token, 16 GiB, about the size of its bf16 weights (16.06 GB)."""
    data = capacity(capsys, "--preset", "llama-3.1-8b", "--gpu", "H200", "--context", "131072")
    assert data["kv_bytes_per_sequence"] == 16 * GIB
    ratio = float(data["kv_bytes_per_sequence"]) / float(data["weights_bytes"])  # type: ignore[arg-type]
    assert 1.0 < ratio < 1.1


def test_seed_ttft_budget_of_a_7b_model_on_an_a100(capsys: pytest.CaptureFixture[str]) -> None:
    """Chapter 10: a 500 ms-1 s TTFT budget lets a 7B model on an A100 take prompts of
    roughly 4,000 tokens; prefill is compute-bound, so at half the peak it lands there."""
    data = capacity(
        capsys,
        "--preset",
        "llama-2-7b",
        "--gpu",
        "A100-80GB",
        "--context",
        "4096",
        "--prompt-tokens",
        "4000",
        "--mfu",
        "0.5",
    )
    prefill = float(data["prefill_s"])  # type: ignore[arg-type]
    flops = 2 * 6_738_415_616 * 4000 + 4 * 32 * 4096 * (4000 * 4001 / 2)
    assert prefill == pytest.approx(flops / (312e12 * 0.5))
    assert 0.2 < prefill < 1.0


def test_speculative_decoding_multiplies_tokens_per_step_at_the_verify_steps_cost(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """8B on an H100, 4 drafts a step keeping 2.5 tokens: batch 1 is memory-bound, so a
    step of 5 tokens costs about one of 1 and a sequence decodes ~2.5x faster; the
    service time of Little's law shrinks with it."""
    flags = ["--preset", "llama-3-8b", "--gpu", "H100-SXM", "--context", "4096"]
    load = ["--rate", "2", "--output-tokens", "256", "--prompt-tokens", "512"]
    plain = capacity(capsys, *flags, *load)
    spec = capacity(capsys, *flags, *load, "--spec-tokens-per-step", "2.5")
    ratio = spec["decode_tokens_per_s_per_sequence"] / plain["decode_tokens_per_s_per_sequence"]  # type: ignore[operator]
    assert 2.3 < ratio <= 2.5
    step = spec["decode_step_floor_s"] / plain["decode_step_floor_s"]  # type: ignore[operator]
    assert 1 <= step < 1.05
    assert spec["required_concurrency"] < plain["required_concurrency"]  # type: ignore[operator]
    assert spec["inputs"]["spec_tokens_per_step"] == 2.5  # type: ignore[index]
    err = failure(capsys, *flags, "--spec-tokens-per-step", "6")
    assert "--spec-tokens-per-step" in err


@pytest.mark.parametrize("name", model_presets())
def test_lora_slots_are_counted_as_the_engine_allocates_them(name: str) -> None:
    from backend.layers.lora import add_lora_layers

    cfg = load_model_config(MODELS_DIR / name)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, 16, TorchPagedAttention()).to(torch.bfloat16)
    layers = add_lora_layers(model, 3, 16)
    held = sum(
        b.numel() * b.element_size()
        for layer in layers.values()
        for key, b in layer.named_buffers()
        if key.startswith("lora_")
    )
    assert model_preset(name).lora_bytes_per_slot(16, "bf16") * 3 == held
    base = plan(Inputs(gpu_preset("H200"), model_preset(name), context=1024, tensor_parallel=4))
    slots = plan(
        Inputs(gpu_preset("H200"), model_preset(name), context=1024, tensor_parallel=4, max_loras=3)
    )
    assert slots.number("lora_bytes") == held
    assert slots.number("kv_budget_bytes") == base.number("kv_budget_bytes") - held


def test_the_lora_flags_take_the_slots_off_the_kv_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ("--preset", "llama-3-8b", "--gpu", "H100-SXM", "--context", "4096")
    plain = capacity(capsys, *flags)
    slots = capacity(capsys, *flags, "--max-loras", "8", "--max-lora-rank", "32")
    held = model_preset("llama-3-8b").lora_bytes_per_slot(32, "bf16") * 8
    assert slots["lora_bytes"] == held
    assert slots["kv_budget_bytes"] == plain["kv_budget_bytes"] - held  # type: ignore[operator]
    assert slots["max_concurrent_sequences"] < plain["max_concurrent_sequences"]  # type: ignore[operator]
    assert "--max-loras" in failure(capsys, *flags, "--max-loras", "-1")
