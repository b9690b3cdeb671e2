"""Shared by the benchmarks: a random-weight Llama checkpoint in Hugging Face format,
built once into a cache folder, and small statistics helpers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

CACHE = Path(__file__).resolve().parent.parent / ".bench_cache"


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
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(**spec, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "t0", "eos_token": "t1"})
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    stamp.write_text(json.dumps(spec))
    return folder


def long_tailed(rng: Any, low: int, high: int, median: float, sigma: float) -> int:
    """A log-normal draw clipped to [low, high]: most short, a few near `high`."""
    return min(max(round(math.exp(rng.gauss(math.log(median), sigma))), low), high)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)]
