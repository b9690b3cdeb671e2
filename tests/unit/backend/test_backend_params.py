"""EngineConfig and SamplingParams validate with ValueErrors that name the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backend import EngineConfig, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"num_kv_blocks": -1}, "num_kv_blocks"),
        ({"kv_cache_bytes": 1.5}, "kv_cache_bytes"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
        ({"share_prefix_cache": "yes"}, "share_prefix_cache"),
        ({"dtype": "float64"}, "dtype"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_engine_config_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_engine_config_accepts_the_defaults_and_cuda() -> None:
    assert EngineConfig().block_size == 16
    # Chunked prefill: the context is no longer capped by the per-step token budget.
    assert EngineConfig(max_model_len=8192, max_num_batched_tokens=512).max_model_len == 8192
    assert EngineConfig(device="cuda:1", dtype="bfloat16", num_kv_blocks=10).device == "cuda:1"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"stop": "###"}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_sampling_params_reject(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_defaults_follow_the_interface() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, 0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.greedy) == ([], [], False, False)
    assert (p.n, p.logprobs) == (1, None)
    assert SamplingParams(temperature=0).greedy


def test_importing_backend_does_no_work() -> None:
    code = (
        "import sys, backend; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "backend.SamplingParams(); backend.EngineConfig(); "
        "assert backend.AsyncEngine.__name__ == 'AsyncEngine'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_gateway_loads_torch_only_to_run_an_engine() -> None:
    """A gateway that fronts replicas or upstreams starts without torch (seconds of CPU
    per start, hundreds of MB resident); the in-process engine brings it in."""
    code = (
        "import sys, gateway.app, gateway.cli.commands, backend.tokenizer; "
        "import backend.capacity.presets; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "from backend.models.config import load_model_config; "
        "from backend.builtin import BUILTIN_MODEL_DIR; "
        "assert load_model_config(BUILTIN_MODEL_DIR).num_layers > 0; "
        "assert 'torch' not in sys.modules, 'torch imported by the config reader'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_replica_starts_without_the_gateway_or_torch_dynamo() -> None:
    """`tollgate backend serve` (gateway/cli/__init__.py) imports none of the gateway's database,
    quota and billing modules, and building the engine never imports torch._dynamo (a
    random init of the embedding on the meta device did): ~3 s less at every start."""
    code = (
        "import sys, gateway.cli, gateway.cli.backend, gateway.cli.serve; "
        "heavy = {'gateway.app', 'gateway.cli.commands', 'tenants.db', 'sqlalchemy.orm'}; "
        "heavy.add('alembic'); "
        "assert not heavy & set(sys.modules), heavy & set(sys.modules); "
        "from backend import AsyncEngine; "
        "from backend.builtin import BUILTIN_MODEL_DIR; "
        "from backend.config import EngineConfig; "
        "engine = AsyncEngine.from_pretrained(BUILTIN_MODEL_DIR, EngineConfig()); "
        "assert 'torch._dynamo' not in sys.modules, 'the engine imported torch._dynamo'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
