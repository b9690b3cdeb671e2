"""Shared by the benchmarks: a random-weight Llama checkpoint in Hugging Face format,
built once into a cache folder, and small statistics helpers."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

CACHE = Path(__file__).resolve().parent.parent / ".bench_cache"


def truncated_draft(target: Path, folder: Path, layers: int) -> Path:
    """`target` (a Llama checkpoint: one safetensors file or shards) cut to its first
    `layers` decoder layers, everything else (embeddings, final norm, LM head, tokenizer)
    kept, in one file: a draft of the same vocabulary whose first layers are the
    target's own (an early exit, not a trained small model)."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config))
    kept = {}
    for file in sorted(target.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers:
                kept[name] = tensor
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).is_file():
            shutil.copy(target / name, folder / name)
    return folder


def build_random_llama(
    folder: Path,
    *,
    layers: int = 8,
    hidden: int = 512,
    heads: int = 8,
    kv_heads: int = 4,
    intermediate: int = 1408,
    vocab: int = 32000,
    max_positions: int = 2048,
) -> Path:
    """A Llama with random weights and a word-level tokenizer ("t0".."tN") of the same
    vocabulary, so both engines can run on token ids. Reused when already built."""
    spec: dict[str, Any] = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "max_position_embeddings": max_positions,
    }
    stamp = folder / "bench-spec.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(**spec, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    write_word_tokenizer(folder, vocab)
    stamp.write_text(json.dumps(spec))
    return folder


def write_word_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer "t0".."tN" (t0 BOS, t1 EOS) and a generation config."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "t0", "eos_token": "t1"})
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))


Workload = list[tuple[list[int], int]]  # (prompt ids, output tokens)


def static_batches(work: Workload, batch_size: int, by_length: bool) -> list[Workload]:
    """Fixed batches for generate(): in arrival order, or of similar prompt lengths
    (sorted), which wastes less padding."""
    items = sorted(work, key=lambda w: len(w[0])) if by_length else list(work)
    return [items[i : i + batch_size] for i in range(0, len(items), batch_size)]


def generate_static(
    model: Any, batch: Workload, device: torch.device, temperature: float = 0.0
) -> int:
    """One generate() call on a left-padded batch, every row generating until the
    batch's longest output is done (EOS ignored; greedy, or sampled at `temperature` with
    no top-k/top-p filter, as the engine samples). Returns the padded token slots."""
    steps = generate_steps(model, batch, device, temperature)
    longest = max(n for _, n in batch)
    if steps != longest:  # stopped early: that would flatter it
        raise RuntimeError(f"generate() made {steps} of {longest} tokens")
    return len(batch) * (max(len(p) for p, _ in batch) + longest)


def generate_steps(
    model: Any,
    batch: Workload,
    device: torch.device,
    temperature: float = 0.0,
    max_time: float | None = None,
) -> int:
    """generate_static's call, cut after `max_time` seconds if given (transformers checks
    it after every token); returns the tokens each row generated."""
    width = max(len(p) for p, _ in batch)
    longest = max(n for _, n in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, (prompt, _) in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=longest,
        **sampled(temperature),
        eos_token_id=None,
        pad_token_id=0,
        max_time=max_time,
    )
    return int(out.shape[1]) - width


def sampled(temperature: float) -> dict[str, Any]:
    """generate()'s sampling arguments: greedy at 0, else plain temperature sampling (the
    checkpoint's generation config could otherwise add a top-k of 50)."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def long_tailed(rng: Any, low: int, high: int, median: float, sigma: float) -> int:
    """A log-normal draw clipped to [low, high]: most short, a few near `high`."""
    return min(max(round(math.exp(rng.gauss(math.log(median), sigma))), low), high)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)]
