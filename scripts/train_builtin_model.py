"""Train Tollgate's built-in model, ``tollgate-tiny``, from text that ships with Python.

The checkpoint is a small Llama-architecture causal LM in Hugging Face format
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
with a chat template, ``generation_config.json``). It is trained on the docstrings of
the standard library (read from the ``.py`` sources with :mod:`ast`, nothing is
imported) plus the reference topics of ``pydoc_data``, and on chat-formatted
question/answer pairs built from the same docstrings, so both plain completion and
the chat template produce English-like text.

Everything is deterministic: the corpus is gathered in sorted path order, every
random choice comes from a seeded generator, torch runs with a fixed thread count and
deterministic algorithms, and the step count is fixed (never time-based). Two runs on
the same machine with the same Python and torch versions write byte-identical
``model.safetensors`` files; the script prints its sha256 at the end.

Usage::

    python scripts/train_builtin_model.py            # full run -> backend/builtin/tollgate-tiny
    python scripts/train_builtin_model.py --quick    # smoke run (few steps) -> a temp folder
    python scripts/train_builtin_model.py --out DIR --steps N
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Pin the intra-op thread pools before torch is imported; the count is part of what
# makes the floating point reductions (and so the weights) reproducible.
NUM_THREADS = 2
os.environ.setdefault("OMP_NUM_THREADS", str(NUM_THREADS))
os.environ.setdefault("MKL_NUM_THREADS", str(NUM_THREADS))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812
from tokenizers import (  # noqa: E402
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (  # noqa: E402
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "backend" / "builtin" / "tollgate-tiny"

SEED = 1234
VOCAB_SIZE = 4096
SEQ_LEN = 256
BATCH_SIZE = 8
DEFAULT_STEPS = 1200
QUICK_STEPS = 20
PEAK_LR = 3e-3
MIN_LR_RATIO = 0.1
WARMUP_FRACTION = 0.05
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
MAX_POSITIONS = 2048

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS, END_OF_TURN]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    # Tools (Hugging Face's `tools` variable) as a system block; calls in the Hermes format.
    "{% if tools %}{{ '<|system|>\\nTools you may call, each call as <tool_call>"
    '{"name": ..., "arguments": {...}}</tool_call>:\\n<tools>\\n\' }}'
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '</tools><|end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') | trim }}"
    "{% for call in message.get('tool_calls') or [] %}{{ '<tool_call>' }}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '</tool_call>' }}{% endfor %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Folders and modules of the standard library whose text we do not want: tests,
# GUI/demo code, vendored tools, generated data, easter eggs.
SKIP_PARTS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "ensurepip",
        "__pycache__",
        "lib-dynload",
        "pydoc_data",
        "__phello__",
        "encodings",
    }
)
SKIP_MODULES = frozenset({"antigravity", "this", "__hello__", "turtle"})

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are Tollgate's built-in model. Answer briefly.",
    "Answer questions about the Python standard library.",
)
FUNCTION_QUESTIONS = (
    "What does {name} do?",
    "Explain {name}.",
    "What is {name} for?",
    "How do I use {name}?",
    "Describe {name}.",
)
CLASS_QUESTIONS = (
    "What is {name}?",
    "Describe the {name} class.",
    "What is the {name} class for?",
)
MODULE_QUESTIONS = (
    "What is the {name} module?",
    "What does the {name} module do?",
    "Tell me about {name}.",
)
SMALL_TALK = (
    ("Hello!", "Hello! Ask me about the Python standard library."),
    ("Hi", "Hi! What would you like to know about Python?"),
    ("Who are you?", "I am tollgate-tiny, a small language model served by Tollgate."),
    ("What can you do?", "I can answer short questions about the Python standard library."),
    ("Thank you!", "You are welcome."),
    ("Say hello.", "Hello."),
)


# --------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class DocEntry:
    """One docstring of the standard library."""

    qualname: str  # e.g. "json.dumps", "json.JSONEncoder.encode", "json"
    kind: str  # "module" | "class" | "function"
    paragraphs: tuple[str, ...]


_ROLE_RE = re.compile(r":[\w:.+-]+:`~?([^`]*)`")
_TICKS_RE = re.compile(r"`+([^`]*)`+")
_SPACE_RE = re.compile(r"\s+")


def clean_paragraph(raw: str) -> str | None:
    """Reflow one docstring paragraph to a single line; None if it is not prose."""
    lines = [line.strip() for line in raw.splitlines()]
    if any(line.startswith((">>>", "...", "$ ", "%")) for line in lines):
        return None
    text = _SPACE_RE.sub(" ", " ".join(lines)).strip()
    text = _ROLE_RE.sub(r"\1", text)
    text = _TICKS_RE.sub(r"\1", text)
    if len(text) < 12 or len(text.split()) < 3 or not text.isascii():
        return None
    wordish = sum(ch.isalpha() or ch in " ,.;:'()-" for ch in text)
    if wordish / len(text) < 0.85:
        return None
    return text


def split_paragraphs(doc: str) -> tuple[str, ...]:
    out: list[str] = []
    for raw in re.split(r"\n\s*\n", doc):
        para = clean_paragraph(raw)
        if para is not None:
            out.append(para)
    return tuple(out)


def stdlib_sources(root: Path) -> list[tuple[str, Path]]:
    """(module name, path) for every standard library source file we read, sorted."""
    found: list[tuple[str, Path]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_PARTS or part.startswith("config-") for part in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or parts[0] in SKIP_MODULES or parts[0].startswith("_sysconfigdata"):
            continue
        found.append((".".join(parts), path))
    return found


def _walk_defs(body: Sequence[ast.stmt], prefix: str, out: list[DocEntry]) -> None:
    for node in body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}.{node.name}"
            doc = ast.get_docstring(node, clean=True)
            if doc:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                paragraphs = split_paragraphs(doc)
                if paragraphs:
                    out.append(DocEntry(name, kind, paragraphs))
            if isinstance(node, ast.ClassDef):
                _walk_defs(node.body, name, out)


def collect_docstrings(root: Path) -> list[DocEntry]:
    entries: list[DocEntry] = []
    for module, path in stdlib_sources(root):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, UnicodeDecodeError):
            continue
        doc = ast.get_docstring(tree, clean=True)
        if doc:
            paragraphs = split_paragraphs(doc)
            if paragraphs:
                entries.append(DocEntry(module, "module", paragraphs))
        _walk_defs(tree.body, module, entries)
    return entries


def collect_topics(root: Path) -> list[str]:
    """The language reference topics shipped in pydoc_data/topics.py (a dict literal)."""
    path = root / "pydoc_data" / "topics.py"
    if not path.is_file():
        return []
    tree = ast.parse(path.read_bytes(), filename=str(path))
    texts: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and isinstance(value, ast.Constant)
                    and isinstance(key.value, str)
                    and isinstance(value.value, str)
                ):
                    texts.append(value.value)
    docs: list[str] = []
    for text in texts:
        paragraphs = split_paragraphs(text)
        # Long topics are cut into documents of a few paragraphs each.
        for i in range(0, len(paragraphs), 4):
            docs.append("\n\n".join(paragraphs[i : i + 4]))
    return docs


def is_public(qualname: str) -> bool:
    return not any(part.startswith("_") for part in qualname.split("."))


def chat_answer(entry: DocEntry) -> str | None:
    first = entry.paragraphs[0]
    if not 20 <= len(first) <= 500:
        return None
    answer = first
    if len(entry.paragraphs) > 1 and len(answer) + len(entry.paragraphs[1]) < 400:
        answer += " " + entry.paragraphs[1]
    return answer


def build_chat_examples(
    entries: Sequence[DocEntry], rng: random.Random
) -> list[list[dict[str, str]]]:
    conversations: list[list[dict[str, str]]] = []
    questions = {
        "module": MODULE_QUESTIONS,
        "class": CLASS_QUESTIONS,
        "function": FUNCTION_QUESTIONS,
    }
    for entry in entries:
        if not is_public(entry.qualname):
            continue
        answer = chat_answer(entry)
        if answer is None:
            continue
        question = rng.choice(questions[entry.kind]).format(name=entry.qualname)
        messages: list[dict[str, str]] = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
        conversations.append(messages)
    for _ in range(8):
        for question, answer in SMALL_TALK:
            messages = []
            if rng.random() < 0.5:
                messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
            conversations.append(messages)
    return conversations


def plain_document(entry: DocEntry) -> str:
    return entry.qualname + "\n\n" + "\n\n".join(entry.paragraphs)


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: Sequence[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # Like Llama tokenizers: encoding with special tokens prepends BOS (a rendered chat
    # template already starts with it, so it is encoded without special tokens).
    bos_id = token_id(tokenizer, BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


def token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise KeyError(token)
    return int(found)


def hf_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[*ROLE_TOKENS, END_OF_TURN],
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def render_chat(
    fast: PreTrainedTokenizerFast, messages: list[dict[str, str]], *, generation_prompt: bool
) -> str:
    rendered = fast.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert isinstance(rendered, str)
    return rendered


# ---------------------------------------------------------------------------- model


def model_config(tokenizer: Tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=token_id(tokenizer, BOS),
        eos_token_id=token_id(tokenizer, EOS),
        pad_token_id=token_id(tokenizer, PAD),
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        attention_dropout=0.0,
    )


def lr_at(step: int, total: int) -> float:
    warmup = max(1, int(total * WARMUP_FRACTION))
    if step < warmup:
        return PEAK_LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return PEAK_LR * (MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * cosine)


class Progress:
    """A one-line progress bar on stderr: step/total, loss, tokens/s, ETA."""

    def __init__(self, total: int, width: int = 28) -> None:
        self.total = total
        self.width = width
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last_print = 0.0

    def update(self, step: int, loss: float, tokens: int) -> None:
        now = time.monotonic()
        if step < self.total and now - self._last_print < (0.2 if self.tty else 10.0):
            return
        self._last_print = now
        elapsed = max(now - self.start, 1e-9)
        rate = step / elapsed
        eta = (self.total - step) / rate if rate > 0 else 0.0
        filled = int(self.width * step / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        line = (
            f"[{bar}] {step}/{self.total} loss {loss:.3f} "
            f"{tokens / elapsed:,.0f} tok/s elapsed {_fmt(elapsed)} eta {_fmt(eta)}"
        )
        end = "\n" if step >= self.total or not self.tty else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


def _fmt(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:d}m{secs:02d}s"


def batches(data: torch.Tensor, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Random SEQ_LEN+1 windows of the packed token stream, from a seeded generator."""
    high = data.numel() - SEQ_LEN - 1
    offsets = torch.arange(SEQ_LEN + 1)
    for _ in range(steps):
        starts = torch.randint(0, high, (BATCH_SIZE,), generator=generator)
        yield data[starts[:, None] + offsets[None, :]]


def train(model: LlamaForCausalLM, data: torch.Tensor, steps: int) -> float:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    generator = torch.Generator().manual_seed(SEED)
    progress = Progress(steps)
    smoothed = float("nan")
    model.train()
    for step, batch in enumerate(batches(data, steps, generator)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        value = float(loss.item())
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        progress.update(step + 1, smoothed, (step + 1) * BATCH_SIZE * SEQ_LEN)
    model.eval()  # type: ignore[no-untyped-call]
    return smoothed


# ----------------------------------------------------------------------------- main


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def set_determinism() -> None:
    random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)


def show_samples(
    model: LlamaForCausalLM, fast: PreTrainedTokenizerFast, eos_ids: list[int]
) -> None:
    prompts = [
        ("plain", "Return the"),
        (
            "chat",
            render_chat(
                fast,
                [{"role": "user", "content": "What does json.dumps do?"}],
                generation_prompt=True,
            ),
        ),
    ]
    for label, prompt in prompts:
        # A plain prompt gets BOS like any Llama prompt; a rendered chat already has it.
        ids = torch.tensor([fast.encode(prompt, add_special_tokens=label == "plain")])
        with torch.no_grad():
            out = model.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=48,
                do_sample=False,
                eos_token_id=eos_ids,
                pad_token_id=fast.pad_token_id,
            )
        text = fast.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
        shown = prompt if label == "plain" else "What does json.dumps do?"
        print(f"sample ({label}, greedy) {shown!r} -> {text!r}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=None, help=f"output folder (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help=f"training steps (default {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_STEPS} steps, written to a temporary folder unless --out is given",
    )
    args = parser.parse_args(argv)
    steps: int = (
        args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    )
    if steps < 1:
        parser.error("--steps must be positive")
    out: Path
    if args.out is not None:
        out = args.out
    elif args.quick:
        out = Path(tempfile.mkdtemp(prefix="tollgate-tiny-quick-"))
    else:
        out = DEFAULT_OUT

    t0 = time.monotonic()
    set_determinism()
    root = Path(sysconfig.get_paths()["stdlib"])
    entries = collect_docstrings(root)
    topics = collect_topics(root)
    rng = random.Random(SEED)
    conversations = build_chat_examples(entries, rng)
    print(
        f"corpus: {len(entries)} docstrings, {len(topics)} topic documents, "
        f"{len(conversations)} chat examples from {root}",
        file=sys.stderr,
    )

    plain = [plain_document(e) for e in entries] + topics
    chat_texts = [m["content"] for conv in conversations for m in conv]
    tokenizer = train_tokenizer(plain + chat_texts)
    fast = hf_tokenizer(tokenizer)
    eos_ids = [token_id(tokenizer, EOS), token_id(tokenizer, END_OF_TURN)]

    documents = [BOS + text + EOS for text in plain]
    documents += [render_chat(fast, conv, generation_prompt=False) + EOS for conv in conversations]
    rng.shuffle(documents)
    encoded = tokenizer.encode_batch(documents, add_special_tokens=False)
    data = torch.tensor([i for enc in encoded for i in enc.ids], dtype=torch.long)
    print(
        f"tokens: {data.numel():,} (vocab {tokenizer.get_vocab_size()}), "
        f"prep took {time.monotonic() - t0:.1f}s",
        file=sys.stderr,
    )

    config = model_config(tokenizer)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"heads {config.num_attention_heads}/{config.num_key_value_heads} kv, "
        f"{n_params / 1e6:.2f}M params; {steps} steps x {BATCH_SIZE}x{SEQ_LEN} tokens",
        file=sys.stderr,
    )
    t_train = time.monotonic()
    loss = train(model, data, steps)
    train_seconds = time.monotonic() - t_train

    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=token_id(tokenizer, BOS),
        eos_token_id=eos_ids,
        pad_token_id=token_id(tokenizer, PAD),
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    _tidy_files(out)
    _write_model_card(
        out,
        config=config,
        n_params=n_params,
        steps=steps,
        loss=loss,
        corpus=(
            f"{len(entries)} standard library docstrings and {len(topics)} pydoc topic "
            f"documents from Python {sys.version.split()[0]}, plus {len(conversations)} "
            f"chat examples built from them; {data.numel():,} tokens"
        ),
    )

    show_samples(model, fast, eos_ids)
    weights = out / "model.safetensors"
    print(
        f"done: loss {loss:.3f}, training {train_seconds:.0f}s, "
        f"total {time.monotonic() - t0:.0f}s; "
        f"{weights} {weights.stat().st_size / 1e6:.1f} MB sha256 {sha256_of(weights)}",
        file=sys.stderr,
    )
    return 0


def _write_model_card(
    out: Path, *, config: LlamaConfig, n_params: int, steps: int, loss: float, corpus: str
) -> None:
    import tokenizers
    import transformers

    card = f"""# tollgate-tiny

Tollgate's built-in model: a {n_params / 1e6:.2f}M-parameter Llama-architecture causal LM
({config.num_hidden_layers} layers, hidden {config.hidden_size}, \
{config.num_attention_heads} attention heads / {config.num_key_value_heads} key-value heads,
{config.vocab_size}-token byte-level BPE, tied embeddings, float32). It writes English-like
text about Python; it knows little and is wrong often. It exists so that a trial install
serves real completions with no download and no GPU.

- Corpus: {corpus}.
- Training: {steps} steps of {BATCH_SIZE} x {SEQ_LEN} tokens, AdamW, peak learning rate
  {PEAK_LR}, cosine schedule, seed {SEED}; final smoothed loss {loss:.3f}.
- Built with torch {torch.__version__}, transformers {transformers.__version__}, \
tokenizers {tokenizers.__version__}.
- Chat format: `<s><|user|>\\n...<|end|>\\n<|assistant|>\\n`; generation stops at `</s>`
  or `<|end|>`. Tools render as a system block; calls use the Hermes
  `<tool_call>{...}</tool_call>` format.

Regenerate (identical weights on the same machine, Python and torch versions):

    python scripts/train_builtin_model.py
"""
    (out / "README.md").write_text(card)


def _tidy_files(out: Path) -> None:
    """Keep only the files a serving stack needs, readable by transformers 4.x and 5.x.

    transformers 5 writes ``rope_parameters`` and a ``TokenizersBackend`` tokenizer
    class; older loaders (and hand-written ones) look for ``rope_theta``,
    ``torch_dtype`` and ``PreTrainedTokenizerFast``, so both spellings are written.
    """
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        (out / extra).unlink(missing_ok=True)

    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", float(rope.get("rope_theta", 10000.0)))
    config.setdefault("torch_dtype", "float32")
    config.setdefault("dtype", "float32")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    tok_path = out / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    tok.pop("extra_special_tokens", None)
    tok.pop("backend", None)
    tok.update(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "additional_special_tokens": [*ROLE_TOKENS, END_OF_TURN],
            "chat_template": CHAT_TEMPLATE,
            "add_bos_token": True,
            "add_eos_token": False,
        }
    )
    tok_path.write_text(json.dumps(tok, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
