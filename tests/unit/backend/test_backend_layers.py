"""Layers against plain references: paged attention, rotary scaling, the sampler."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from backend.attention_metadata import AttentionMetadata
from backend.engine.model_runner import gpu_kv_budget
from backend.layers.attention import TorchPagedAttention
from backend.layers.rotary import inverse_frequencies
from backend.layers.sampler import sample, token_logprobs
from backend.sampling import SamplingParams


def test_paged_attention_equals_dense_causal_attention() -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    cache = torch.zeros(2, 16, bs, kv_heads, dim)
    backend = TorchPagedAttention()
    lens, tables = [7, 3], [[5, 2], [9]]  # scattered, non-contiguous blocks
    q = torch.randn(sum(lens), heads, dim)
    k, v = torch.randn(2, sum(lens), kv_heads, dim)
    slots = [t[p // bs] * bs + p % bs for t, n in zip(tables, lens, strict=True) for p in range(n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([[5, 2], [9, 0]]),
        seq_lens=lens,
        query_start_loc=[0, 7, 10],
        block_size=bs,
    )
    backend.write_kv(k, v, cache, meta)
    out = backend.attend(q, cache, meta, scale=dim**-0.5)
    for start, end in ((0, 7), (7, 10)):
        ref = functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            k[start:end].repeat_interleave(2, 1).transpose(0, 1),
            v[start:end].repeat_interleave(2, 1).transpose(0, 1),
            is_causal=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[start:end], ref)


def test_paged_attention_over_cached_and_new_keys() -> None:
    """Chunked prefill: a chunk's queries see the earlier chunks' keys (already in the
    cache) and their own, causally, at an offset; a decode row sees everything."""
    torch.manual_seed(1)
    heads, kv_heads, dim, bs, total = 6, 2, 8, 4, 11
    backend = TorchPagedAttention()
    cache = torch.zeros(2, 8, bs, kv_heads, dim)
    table = [6, 1, 4]  # 11 tokens in 3 scattered blocks
    q = torch.randn(total, heads, dim)
    k, v = torch.randn(2, total, kv_heads, dim)
    dense = functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(3, 1).transpose(0, 1),
        v.repeat_interleave(3, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    for start, end in ((0, 3), (3, 10), (10, 11)):  # chunk, chunk, then one decode token
        pos = range(start, end)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([table[p // bs] * bs + p % bs for p in pos]),
            block_tables=torch.tensor([table]),
            seq_lens=[end],
            query_start_loc=[0, end - start],
            block_size=bs,
        )
        backend.write_kv(k[start:end], v[start:end], cache, meta)
        out = backend.attend(q[start:end], cache, meta, scale=dim**-0.5)
        torch.testing.assert_close(out, dense[start:end])


def test_gpu_kv_budget_is_a_fraction_of_memory_less_what_is_used() -> None:
    gib = 2**30
    # 80 GiB device, 20 GiB in use after loading weights, 90%: 72 - 20 = 52 GiB for KV.
    assert gpu_kv_budget(total=80 * gib, free=60 * gib, utilization=0.9) == 52 * gib
    assert gpu_kv_budget(total=80 * gib, free=4 * gib, utilization=0.9) == 0
    # A profiled step's activations come out of the KV budget too (issue 33).
    assert gpu_kv_budget(total=80 * gib, free=60 * gib, utilization=0.9, activations=gib) == (
        51 * gib
    )


def test_token_logprobs_rank_and_top() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, 3.0], [0.0, 0.0, 5.0, 1.0]])
    lps = token_logprobs(logits, [0, 2], [2, 0])
    ref = torch.log_softmax(logits, -1)
    assert (lps[0].token_id, lps[0].rank) == (0, 2)
    assert lps[0].logprob == pytest.approx(ref[0, 0].item())
    assert [t for t, _ in lps[0].top] == [3, 0]
    assert lps[0].top[0][1] == pytest.approx(ref[0, 3].item())
    assert (lps[1].rank, lps[1].top) == (1, [])


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_rope_scaling_matches_transformers(scaling: dict[str, object]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=128, num_attention_heads=4, rope_parameters={"rope_theta": 500000.0, **scaling}
    )
    expected, _ = ROPE_INIT_FUNCTIONS[str(scaling["rope_type"])](cfg, "cpu")
    torch.testing.assert_close(inverse_frequencies(32, 500000.0, scaling), expected)


def test_greedy_top_k_1_and_tiny_top_p_pick_the_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(temperature=0.01, seed=3),
    ]
    gens = [None, None, None, torch.Generator().manual_seed(3)]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    top_k = sample(logits, [SamplingParams(top_k=2)] * 200, [None] * 200)
    assert set(top_k) == {0, 1}
    # softmax: 0.64, 0.24, 0.09, ... -> top_p 0.8 keeps the first two tokens.
    top_p = sample(logits, [SamplingParams(top_p=0.8)] * 200, [None] * 200)
    assert set(top_p) == {0, 1}


def test_a_seeded_row_ignores_its_neighbours() -> None:
    logits = torch.zeros(3, 1000)
    p = SamplingParams(seed=5)

    def draw(batch: int) -> int:
        gens = [torch.Generator().manual_seed(5)] + [None] * (batch - 1)
        return sample(logits[:batch], [p] * batch, gens)[0]

    assert draw(1) == draw(3)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_distribution_and_never_pick_a_masked_token(
    temperature: float,
) -> None:
    # Zero-probability tokens first, in between and last (where a draw rounding up to
    # the total would land): -inf as top-k/top-p leave them, finfo.min as a grammar does.
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    logits = probs.log()
    logits[2] = torch.finfo(torch.float32).min
    draws = 20_000
    torch.manual_seed(0)
    params = [SamplingParams(temperature=temperature)] * draws
    tokens = torch.tensor(sample(logits.repeat(draws, 1), params, [None] * draws))
    frequencies = torch.bincount(tokens, minlength=6).float() / draws
    expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
    assert frequencies[probs == 0].sum() == 0
    # A frequency's standard deviation here is at most 0.0036: 0.015 is four of them.
    torch.testing.assert_close(frequencies, expected, atol=0.015, rtol=0)


def test_a_row_without_a_distribution_samples_its_argmax_never_past_the_vocabulary() -> None:
    """Issue 32: a NaN row's inverse-CDF search once ran off the end (id == vocab), and
    the next step's embedding failed every request beside it."""
    logits = torch.randn(4, 50)
    logits[1, 7] = 30.0
    logits[1, 3] = float("nan")  # NaN in one row: its softmax is NaN throughout
    logits[2] = float("nan")
    params = [SamplingParams(temperature=1.0)] * 3 + [SamplingParams(temperature=0)]
    for _ in range(20):
        tokens = sample(logits, params, [None] * 4)
        assert all(0 <= t < 50 for t in tokens)
        assert tokens[1] == 7  # the argmax of what is left
        assert tokens[3] == int(logits[3].argmax())
