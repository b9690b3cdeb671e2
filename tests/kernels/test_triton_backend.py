"""TritonPagedAttention behind the AttentionBackend protocol, the backend selector, and
the engine served with attention_backend="triton" (in the interpreter) against
transformers' greedy tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.attention_metadata import AttentionMetadata
from backend.config import EngineConfig
from backend.kernels.triton_attention import TritonPagedAttention
from backend.layers.attention import TorchPagedAttention, attention_backend
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import build_checkpoint, make_engine, run_to_completion, tokens_of
from tests.engine.test_engine_oracle import NEW_TOKENS, hf_greedy
from tests.kernels.kernel_support import MIXED, Batch, make_batch

pytestmark = pytest.mark.interpreter

CPU = torch.device("cpu")


def test_auto_is_torch_on_the_cpu_and_names_are_checked() -> None:
    assert isinstance(attention_backend("auto", CPU), TorchPagedAttention)
    assert isinstance(attention_backend("torch", CPU), TorchPagedAttention)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        attention_backend("flash", CPU)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention_backend("triton", CPU)


def _meta(batch_seqs: list[tuple[int, int]], block_size: int) -> tuple[AttentionMetadata, Batch]:
    batch = make_batch(batch_seqs, 8, 2, 64, block_size, seed=5)
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch.q.shape[0],), -1),
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        block_size=block_size,
    )
    return meta, batch


@pytest.mark.parametrize("split_min_seq_len", [1, 10**6])  # split path, then unsplit
def test_backend_attend_equals_the_torch_backend(split_min_seq_len: int) -> None:
    backend = TritonPagedAttention(split_min_seq_len=split_min_seq_len)
    for seqs in (MIXED, [(90, 1), (17, 1), (300, 1)]):
        meta, batch = _meta(seqs, 16)
        kv_cache = torch.stack([batch.k_cache, batch.v_cache])
        split = backend.segments(meta, kv_heads=2) > 1
        assert split == (split_min_seq_len == 1 and meta.max_query_len == 1)
        got = backend.attend(batch.q, kv_cache, meta, 0.125)
        want = TorchPagedAttention().attend(batch.q, kv_cache, meta, 0.125)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_decode_metadata_reads_lengths_from_tensors_alone() -> None:
    """What a CUDA graph replays: metadata whose host-side lengths are placeholders gives
    the same attention as the real lengths, long contexts included."""
    backend = TritonPagedAttention()
    meta, batch = _meta([(90, 1), (17, 1), (1300, 1)], 16)
    kv_cache = torch.stack([batch.k_cache, batch.v_cache])
    graphable = backend.decode_metadata(
        meta.slot_mapping,
        meta.block_tables,
        torch.tensor(meta.seq_lens),
        torch.tensor(meta.query_start_loc),
        16,
    )
    assert graphable.max_seq_len == 1 and graphable.captured
    # Issue 33: a captured step used one segment whatever its contexts (8 programs on 132
    # SMs at batch 1); now its split is sized to the SMs: 3 rows x 2 KV heads -> 16.
    assert backend.segments(graphable, kv_heads=2) == 16
    got = backend.attend(batch.q, kv_cache, graphable, 0.125)
    want = TorchPagedAttention().attend(batch.q, kv_cache, meta, 0.125)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_captured_steps_split_by_their_grid_alone() -> None:
    backend = TritonPagedAttention(sm_count=132)
    assert backend.captured_segments(rows=1, kv_heads=8) == 16  # 132 / 8 -> 32, capped
    assert backend.captured_segments(rows=4, kv_heads=8) == 8  # 132 / 32 -> 4.1 -> 8
    assert backend.captured_segments(rows=16, kv_heads=8) == 2
    assert backend.captured_segments(rows=32, kv_heads=8) == 1  # the rows fill the SMs


def test_backend_write_kv_skips_padding_slots() -> None:
    backend = attention_backend("triton", CPU)
    assert isinstance(backend, TritonPagedAttention)
    cache = torch.zeros(2, 4, 16, 2, 8)
    k, v = torch.randn(2, 3, 2, 8)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([17, -1, 40]),
        block_tables=torch.tensor([[1, 2]]),
        seq_lens=[3],
        query_start_loc=[0, 3],
        block_size=16,
    )
    backend.write_kv(k, v, cache, meta)
    flat = cache.view(2, -1, 2, 8)
    assert torch.equal(flat[0, [17, 40]], k[[0, 2]])
    assert torch.equal(flat[1, [17, 40]], v[[0, 2]])
    assert int(flat.ne(0).any(-1).any(-1).sum()) == 4  # two slots each in K and V, no more


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("triton") / "llama", "llama")


def test_engine_on_triton_gives_transformers_greedy_tokens(llama: Path) -> None:
    """Batched short prompts in chunks of at most 16 tokens, then one whose first block
    is a prefix-cache hit: decode rows, whole prefills and chunks over a cached prefix."""
    rng = random.Random(3)
    shared = [rng.randrange(2, 300) for _ in range(16)]
    prompts = [[rng.randrange(2, 300) for _ in range(n)] for n in (5, 9, 30)]
    prompts += [shared + [rng.randrange(2, 300) for _ in range(n)] for n in (3, 20)]
    engine = make_engine(
        llama, block_size=16, max_num_batched_tokens=16, attention_backend="triton"
    )
    assert type(engine.runner.attention).__name__ == "TritonPagedAttention"
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = {}
    for wave in (prompts[:-1], prompts[-1:]):  # the last one reuses the cached shared block
        for prompt in wave:
            engine.add_request(EngineRequest(prompt, greedy, f"r{prompts.index(prompt)}"))
        outputs.update(run_to_completion(engine))
    got = [tokens_of(outputs[f"r{i}"]) for i in range(len(prompts))]
    assert got == hf_greedy(llama, prompts)
    assert engine.stats().prefix_cache_hits == 16


class VariantRecorder:
    """Stands in for a @triton.jit kernel under the interpreter and records, per launch,
    the key Triton compiles a variant for on a GPU: each integer argument's class (== 1,
    divisible by 16), each pointer's 16-byte alignment, and the constexprs; arguments
    the kernel marks do_not_specialize are left out, as Triton leaves them out."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.plain = set(kernel.kwargs.get("do_not_specialize") or ())
        self.variants: set[tuple[object, ...]] = set()

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def run(*args: Any, **constexprs: Any) -> Any:
            named = zip(self.kernel.arg_names, args, strict=False)
            key = [_class_of(value) for name, value in named if name not in self.plain]
            self.variants.add((*key, *sorted(constexprs.items())))
            return launch(*args, **constexprs)

        return run


def _class_of(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value).__name__
    return (value == 1, value % 16 == 0)


def test_varying_batches_compile_no_new_kernel_variant_after_warm_up(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: the packed step buffer's slices moved in alignment with the batch, the
    block-table width and num_seqs took any value, so a GPU compiled new variants of the
    attention kernel mid-run. After a warm-up of one decode row, several, and prompt
    chunks, batches of every other shape reuse the variants already seen."""
    from backend.kernels import paged_attention

    recorder = VariantRecorder(paged_attention._paged_attention_kernel)
    monkeypatch.setattr(paged_attention, "_paged_attention_kernel", recorder)
    engine = make_engine(
        llama, block_size=16, max_num_batched_tokens=32, attention_backend="triton"
    )
    rng = random.Random(5)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    def wave(tag: str, lengths: list[int]) -> None:
        for i, n in enumerate(lengths):
            engine.add_request(
                EngineRequest([rng.randrange(2, 300) for _ in range(n)], greedy, f"{tag}{i}")
            )
        run_to_completion(engine)

    wave("warm-one", [5])
    wave("warm-two", [9, 40])
    warmed = set(recorder.variants)
    for tag, lengths in (("a", [3, 17, 33]), ("b", [60]), ("c", [2, 2, 2, 2, 2]), ("d", [31, 7])):
        wave(tag, lengths)
    assert recorder.variants == warmed, recorder.variants - warmed
