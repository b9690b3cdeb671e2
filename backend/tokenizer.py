"""tokenizer.json through `tokenizers`, chat templates through sandboxed jinja2, and
incremental detokenization for streaming."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from backend.errors import CheckpointError, InvalidParameterError
from backend.models.config import read_json

# `tokenizers` holds the GIL through encode() (a thread encoding 1.7 MB froze the
# gateway's event loop for a second), but releases it in encode_batch(): a text longer
# than this goes through the latter, so a thread tokenizing it stalls no one else.
GIL_FREE_ENCODE_CHARS = 4096


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(path, "file not found")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise CheckpointError(path, f"unreadable tokenizer: {exc}") from exc
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = read_json(cfg_path) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_ids = frozenset(self._eos_ids(model_dir))
        self.chat_template = _chat_template(model_dir, cfg)
        self._template = _compile(self.chat_template, cfg_path)
        self.tool_call_parser = cfg.get("tool_call_parser") or _tool_format(self.chat_template)
        self._source = model_dir
        self._max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for: its vocabulary entry's
        length (a byte-level entry has one character per byte, never fewer than the text
        it decodes to). A text of more than n x this many characters is more than n tokens,
        which the gateway checks before spending time on tokenizing it."""
        if self._max_token_chars is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_chars = max(map(len, vocab), default=1)
        return self._max_token_chars

    @property
    def knows_tools(self) -> bool:
        """The chat template renders `tools` (else it would leave them out of the count)."""
        return self.chat_template is not None and "tools" in self.chat_template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)  # type: ignore[no-any-return]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Adds BOS (through the tokenizer's post-processor) unless the text already starts
        with it, as a rendered chat template does."""
        if self.bos_token and text.startswith(self.bos_token):
            add_special_tokens = False
        if len(text) > GIL_FREE_ENCODE_CHARS:  # the same ids, with the GIL released
            (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
            return encoding.ids  # type: ignore[no-any-return]
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids  # type: ignore[no-any-return]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)  # type: ignore[no-any-return]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """`tools` and messages with `tool_calls` / `tool_call_id` follow Hugging Face's
        convention, which chat templates that know tools expect."""
        if self._template is None:
            raise InvalidParameterError(f"{self._source} has no chat template", "messages")
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise InvalidParameterError(f"chat template failed: {exc}", "messages") from exc

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _eos_ids(self, model_dir: Path) -> set[int]:
        ids = {self._id(self.eos_token)}
        for name in ("generation_config.json", "config.json"):
            if (model_dir / name).is_file():
                value = read_json(model_dir / name).get("eos_token_id")
                ids.update(value if isinstance(value, list) else [value])
        return {i for i in ids if isinstance(i, int)}


class IncrementalDetokenizer:
    """Turns one token at a time into text deltas. Decodes a small window that starts a few
    tokens back (so leading spaces and merges come out right) and holds text back while it
    ends in U+FFFD, i.e. while a multi-byte character is still incomplete."""

    _CONTEXT = 6

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-self._CONTEXT :])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens before this have been emitted

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (at the end of a request)."""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialised AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tool_format(template: str | None) -> str:
    """The tool-call format a chat template writes (tokenizer_config.json's
    `tool_call_parser` overrides it): Llama 3.1's JSON after `<|python_tag|>`, else Hermes."""
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


def _chat_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"  # where newer transformers save it
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _compile(source: str | None, path: Path) -> Template | None:
    if source is None:
        return None
    try:
        return _jinja_env().from_string(source)
    except TemplateError as exc:
        raise CheckpointError(path, f"invalid chat template: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Same settings as transformers, so templates written for it render the same here.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
