"""Tokenizer: chat templates, special tokens, and streaming detokenization."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.errors import CheckpointError
from backend.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.engine.engine_support import BOS, EOS, build_tokenizer


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1]}))
    return folder


@pytest.fixture(scope="session")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer(tok_dir)


def test_special_tokens_and_stop_ids(tok: Tokenizer) -> None:
    assert tok.bos_token == BOS and tok.eos_token == EOS
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == {1, 7}  # tokenizer_config eos + generation_config list


def test_bos_is_added_once(tok: Tokenizer) -> None:
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.encode(BOS + "hello") == ids
    assert tok.encode("hello", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == BOS + "hello"


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)
    assert text == f"{BOS}<|system|>be brief{EOS}<|user|>hi{EOS}<|assistant|>"
    without_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert without_prompt == text.removesuffix("<|assistant|>")
    assert tok.encode(text).count(0) == 1  # one BOS


def test_chat_template_raise_exception_becomes_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed(tok_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (folder / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template failed"):
        Tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])
    (folder / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(CheckpointError, match="invalid chat template"):
        Tokenizer(folder)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(folder).apply_chat_template([])


def stream(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.step(i) for i in ids]
    return [*deltas, detok.flush()]


def test_multibyte_characters_are_held_back_until_complete(tok: Tokenizer) -> None:
    # Byte-level BPE: an emoji not in the merges comes out as four byte tokens.
    ids = tok.encode("a🙂", add_special_tokens=False)
    deltas = stream(tok, tok.encode("x"), ids)
    assert "".join(deltas) == "a🙂"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas.count("") >= 3


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.text(alphabet="ab é日🙂\n", max_size=8),
    text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30),
)
def test_streamed_text_equals_full_decode(tok: Tokenizer, prefix: str, text: str) -> None:
    prompt = tok.encode(prefix)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_long_text_is_encoded_without_holding_the_gil() -> None:
    """A thread tokenizing a long prompt (the gateway's off-loop tokenizing) lets other
    threads run meanwhile: `tokenizers` holds the GIL through encode(), which froze the
    event loop for a second on 1.7 MB. Proven by order, not time: with forced GIL
    switches off, the main thread can run before the encode returns only if the encode
    released the GIL."""
    from backend.builtin import BUILTIN_MODEL_DIR

    tokenizer = Tokenizer(BUILTIN_MODEL_DIR)
    text = tokenizer.apply_chat_template([{"role": "user", "content": ""}] * 20_000)
    expected = tokenizer._tok.encode(text, add_special_tokens=False).ids
    started = threading.Event()
    order: list[str] = []
    encoded: list[list[int]] = []

    def encode() -> None:
        started.set()  # wakes the main thread, which then waits for the GIL
        encoded.append(tokenizer.encode(text))
        order.append("encoded")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no forced switches: the GIL moves only when released
    try:
        worker = threading.Thread(target=encode)
        worker.start()
        started.wait(timeout=30)
        order.append("main ran")
        worker.join(timeout=30)
    finally:
        sys.setswitchinterval(interval)
    assert order == ["main ran", "encoded"]
    assert encoded == [expected]  # the same ids as encode() gives
