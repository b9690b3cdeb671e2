"""The committed built-in checkpoint (backend/builtin/tollgate-tiny) is a complete,
small Hugging Face Llama checkpoint that loads with transformers and writes words."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from backend.builtin import BUILTIN_MODEL_DIR

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
MAX_BYTES = 20 * 1024 * 1024


def _json(name: str) -> dict[str, Any]:
    data = json.loads((BUILTIN_MODEL_DIR / name).read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(BUILTIN_MODEL_DIR / "tokenizer.json"))


def test_dir_is_a_path_to_the_checkpoint() -> None:
    assert isinstance(BUILTIN_MODEL_DIR, Path)
    assert BUILTIN_MODEL_DIR.name == "tollgate-tiny"
    for name in REQUIRED_FILES:
        assert (BUILTIN_MODEL_DIR / name).is_file(), name


def test_checkpoint_is_small() -> None:
    total = sum(p.stat().st_size for p in BUILTIN_MODEL_DIR.iterdir() if p.is_file())
    assert total <= MAX_BYTES, f"{total / 1e6:.1f} MB"


def test_config_is_a_gqa_llama() -> None:
    cfg = _json("config.json")
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] >= 1024
    assert cfg["hidden_act"] == "silu"


def test_special_tokens_agree_across_files(tokenizer: Tokenizer) -> None:
    tok_cfg = _json("tokenizer_config.json")
    gen = _json("generation_config.json")
    cfg = _json("config.json")
    bos = tokenizer.token_to_id(tok_cfg["bos_token"])
    eos = tokenizer.token_to_id(tok_cfg["eos_token"])
    end_of_turn = tokenizer.token_to_id("<|end|>")
    assert None not in (bos, eos, end_of_turn)
    assert gen["bos_token_id"] == cfg["bos_token_id"] == bos
    assert cfg["eos_token_id"] == eos
    assert set(gen["eos_token_id"]) == {eos, end_of_turn}
    assert tokenizer.get_vocab_size() == cfg["vocab_size"]


def test_tokenizer_round_trips(tokenizer: Tokenizer) -> None:
    text = "Return the number of items in the list.\n\n  Indented, with tabs\tand ümlauts."
    ids = tokenizer.encode(text).ids
    assert ids[0] == tokenizer.token_to_id("<s>")  # BOS, like Llama tokenizers
    assert len(ids) < len(text.encode())  # BPE merged something
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders(tokenizer: Tokenizer) -> None:
    tok_cfg = _json("tokenizer_config.json")
    template = ImmutableSandboxedEnvironment().from_string(tok_cfg["chat_template"])
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What does json.dumps do?"},
    ]
    rendered = template.render(
        messages=messages, add_generation_prompt=True, bos_token=tok_cfg["bos_token"]
    )
    assert rendered == (
        "<s><|system|>\nYou are a helpful assistant.<|end|>\n"
        "<|user|>\nWhat does json.dumps do?<|end|>\n<|assistant|>\n"
    )
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    specials = {tokenizer.token_to_id(t) for t in ("<s>", "<|user|>", "<|assistant|>")}
    assert specials <= set(ids)  # role markers are single special tokens
    no_prompt = template.render(
        messages=messages, add_generation_prompt=False, bos_token=tok_cfg["bos_token"]
    )
    assert not no_prompt.endswith("<|assistant|>\n")


def _mostly_words(text: str) -> bool:
    words = [w.strip(".,;:!?()'\"") for w in text.split()]
    words = [w for w in words if w]
    if len(words) < 5:
        return False
    alphabetic = sum(bool(re.fullmatch(r"[A-Za-z][A-Za-z'-]*", w)) for w in words)
    return text.isascii() and alphabetic / len(words) >= 0.6


def test_mostly_words_check_rejects_noise() -> None:
    assert _mostly_words("Return the number of bytes in the buffer.")
    assert not _mostly_words("x7 )) ]] 0x3f __ == 12 ;; {}")
    assert not _mostly_words("..............................")


def test_transformers_loads_and_writes_words() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    model = transformers.LlamaForCausalLM.from_pretrained(BUILTIN_MODEL_DIR)
    model.eval()

    prompt = tok("Return the", return_tensors="pt")
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What does os.path.join do?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert chat.endswith("<|assistant|>\n")
    chat_ids = tok(chat, add_special_tokens=False, return_tensors="pt")
    for inputs in (prompt, chat_ids):
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert len(new) > 3
        text = tok.decode(new, skip_special_tokens=True)
        assert _mostly_words(text), text
