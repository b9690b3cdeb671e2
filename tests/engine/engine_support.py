"""Engine test support: tiny random-weight Hugging Face checkpoints built in a temp folder,
and helpers that drive an Engine. (The gateway tests use the committed built-in model.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from backend.builtin import BUILTIN_MODEL_DIR
from backend.config import EngineConfig
from backend.engine.engine import Engine
from backend.engine.model_runner import kv_bytes_per_block
from backend.loader import resolve_dtype
from backend.models.config import load_model_config
from backend.outputs import RequestOutput
from tests.unit.backend.accounting import check_accounting

BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tollgate sells tokens to tenants; every token is metered and billed.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "héllo wörld, naïve café — 日本語のテキスト 🙂 emoji and ünïcödé.",
    "def main():\n    return 42\n",
] * 4


def build_tokenizer(folder: Path, vocab_size: int = 320) -> Tokenizer:
    """Byte-level BPE with <s>/</s>; encode() adds <s> like Llama's post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": {"content": EOS}, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def build_checkpoint(folder: Path, kind: str = "llama", **overrides: Any) -> Path:
    """kind: "llama" (GQA, q/k/v/o biases, llama3 rope scaling), "qwen2" (tied
    embeddings, q/k/v bias, sharded safetensors) or "mistral"."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tok = build_tokenizer(folder)
    # Seed before construction: the constructor draws the weights, and init_weights may
    # leave modules it considers initialised alone, so a later seed is not enough.
    torch.manual_seed(0)
    common: dict[str, Any] = {
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": tok.token_to_id(EOS),
        # Sharper logits than the default 0.02 so greedy argmax has no near-ties.
        "initializer_range": 0.2,
    }
    common |= {key: overrides.pop(key) for key in list(overrides) if key in common}
    if kind == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        cfg: Any = LlamaConfig(**common, attention_bias=True, rope_parameters=rope, **overrides)
        model: Any = LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=True, **overrides)
        model = Qwen2ForCausalLM(cfg)
    elif kind == "mistral":
        cfg = MistralConfig(**common, sliding_window=None, **overrides)
        model = MistralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model.init_weights()
    _randomise_biases(model)
    shard = "150KB" if kind == "qwen2" else "1GB"
    model.save_pretrained(folder, max_shard_size=shard)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [cfg.eos_token_id]}))
    return folder


def _randomise_biases(model: Any) -> None:
    # Biases start at zero; make them matter so a loader that drops one fails the oracle.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.2)


# float32: the oracle is transformers in float32 ("auto" is bfloat16 on a CPU with AVX512-BF16)
SMALL = EngineConfig(
    block_size=4, num_kv_blocks=128, max_model_len=96, max_num_batched_tokens=256, dtype="float32"
)


def make_engine(path: Path, **overrides: object) -> Engine:
    fields = {**SMALL.__dict__, **overrides}
    return Engine(path, EngineConfig(**fields))  # type: ignore[arg-type]


def run_to_completion(engine: Engine) -> dict[str, list[RequestOutput]]:
    """Steps until idle, checking block accounting after every step."""
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        check_blocks(engine)
    return outputs


def check_blocks(engine: Engine) -> None:
    """free + cached + used == total; ref counts equal the tables holding each block."""
    check_accounting(engine.block_manager, (r.request_id for r in engine.scheduler.running))


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def builtin_kv_block(block_size: int = 16) -> tuple[torch.dtype, int]:
    """The dtype an engine on the CPU takes for the built-in model ("auto") and the bytes
    of one of its KV blocks, by the runner's own arithmetic."""
    model_config = load_model_config(BUILTIN_MODEL_DIR)
    dtype = resolve_dtype("auto", torch.device("cpu"), model_config)
    return dtype, kv_bytes_per_block(model_config, block_size, dtype)
