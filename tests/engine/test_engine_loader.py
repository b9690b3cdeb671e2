"""Checkpoint problems raise CheckpointError naming the file and the problem."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.errors import CheckpointError
from backend.models.config import load_model_config
from tests.engine.engine_support import make_engine


@pytest.fixture
def llama_copy(llama_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llama_dir, tmp_path / "model"))


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_parses_the_llama_family(checkpoints: dict[str, Path]) -> None:
    llama = load_model_config(checkpoints["llama"])
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 16)
    assert llama.qkv_bias and llama.o_bias and not llama.tie_word_embeddings
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    qwen = load_model_config(checkpoints["qwen2"])
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    assert qwen.rope_scaling is None


def test_legacy_rope_keys_and_sliding_window(llama_copy: Path) -> None:
    edit_config(
        llama_copy,
        architectures=["MistralForCausalLM"],
        rope_parameters=None,
        rope_theta=5e5,
        rope_scaling={"type": "linear", "factor": 2.0},
        sliding_window=64,
    )
    cfg = load_model_config(llama_copy)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {
        "type": "linear",
        "factor": 2.0,
        "rope_type": "linear",
    }
    assert cfg.max_position_embeddings == 64


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"hidden_size": None}, "invalid or missing field"),
    ],
)
def test_bad_config_names_the_file(
    llama_copy: Path, changes: dict[str, object], problem: str
) -> None:
    edit_config(llama_copy, **changes)
    with pytest.raises(CheckpointError, match=problem) as err:
        load_model_config(llama_copy)
    assert err.value.path == llama_copy / "config.json"
    assert str(llama_copy / "config.json") in str(err.value)


def test_missing_files(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="file not found") as err:
        make_engine(llama_copy)
    assert err.value.path.name == "model.safetensors"
    (llama_copy / "config.json").unlink()
    with pytest.raises(CheckpointError) as err:
        make_engine(llama_copy)
    assert err.value.path.name == "config.json"


def test_shape_mismatch_names_file_and_tensor(llama_copy: Path) -> None:
    edit_config(llama_copy, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'model\.layers\.0\.mlp") as err:
        make_engine(llama_copy)
    assert err.value.path == llama_copy / "model.safetensors"


def test_missing_and_unexpected_tensors(llama_copy: Path) -> None:
    file = llama_copy / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(
        CheckpointError, match=re.escape("model.layers.1.self_attn.qkv_proj.weight")
    ):
        make_engine(llama_copy)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=re.escape("unexpected tensor 'model.extra.weight'")):
        make_engine(llama_copy)


def test_sharded_index_with_a_missing_shard(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(checkpoints["qwen2"], tmp_path / "qwen"))
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(
        CheckpointError, match=re.escape("listed in model.safetensors.index.json")
    ) as err:
        make_engine(folder)
    assert err.value.path == shard


def test_unreadable_safetensors(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        make_engine(llama_copy)


def test_missing_tokenizer(llama_copy: Path) -> None:
    (llama_copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="file not found") as err:
        make_engine(llama_copy)
    assert err.value.path.name == "tokenizer.json"


def test_kv_pool_must_hold_one_full_sequence(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="too few"):
        make_engine(llama_dir, num_kv_blocks=4, max_model_len=96)


def test_the_model_reaches_its_device_in_its_final_dtype(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: the loader materialised every parameter in float32 on the device and
    then converted (32 GB on the GPU for an 8B model in bfloat16). Now the dtype is set on
    the meta device: what to_empty materialises is already bfloat16."""
    from torch import nn

    materialised: list[torch.dtype] = []
    to_empty = nn.Module.to_empty

    def recording(self: nn.Module, *, device: Any, recurse: bool = True) -> nn.Module:
        materialised.extend(p.dtype for p in self.parameters())
        return to_empty(self, device=device, recurse=recurse)

    monkeypatch.setattr(nn.Module, "to_empty", recording)
    engine = make_engine(llama_dir, dtype="bfloat16")
    assert materialised and set(materialised) == {torch.bfloat16}
    assert {p.dtype for p in engine.runner.model.parameters()} == {torch.bfloat16}


def test_the_profiling_step_runs_and_leaves_the_kv_cache(llama_dir: Path) -> None:
    """The step a GPU's KV budget is measured with (max_num_batched_tokens of prompt,
    then max_num_seqs rows of logits), here on the CPU: it runs on a scratch cache and
    puts the engine's own back."""
    engine = make_engine(llama_dir, max_num_batched_tokens=96, max_model_len=64)
    runner = engine.runner
    cache = runner.kv_cache
    before = cache.clone()
    runner.profile_step(engine.max_model_len)
    assert runner.kv_cache is cache and torch.equal(cache, before)
