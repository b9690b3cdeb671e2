"""The batched LoRA kernel against its torch reference and a float64 row-by-row
definition, under the interpreter: mixed adapters, mixed ranks (zero-padded), base rows."""

from __future__ import annotations

import pytest
import torch

from backend.kernels.lora import lora_add, lora_add_reference

pytestmark = pytest.mark.interpreter


def _adapters(
    ranks: list[int], width: int, k: int, n: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [L, width, k] and B [L, width, n], slot i of rank ranks[i] (the rest zeros)."""
    a = torch.zeros(len(ranks), width, k)
    b = torch.zeros(len(ranks), width, n)
    for i, r in enumerate(ranks):
        a[i, :r] = torch.randn(r, k, generator=gen)
        b[i, :r] = torch.randn(r, n, generator=gen) * 0.1
    return a, b


def _definition(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    out = y.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] += (x[t].double() @ a[s].double().T) @ b[s].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(64, 96), (100, 300)])
def test_mixed_adapters_ranks_and_base_rows(dtype: torch.dtype, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k + n)
    a, b = _adapters([8, 4, 16, 1], 16, k, n, gen)
    slots = [0, -1, 2, 1, 1, -1, 3, 0, 2, -1, 3]
    x = torch.randn(len(slots), k, generator=gen)
    y = torch.randn(len(slots), n, generator=gen)
    want = _definition(y, x, a, b, slots)
    index = torch.tensor(slots)
    x, y, a, b = x.to(dtype), y.to(dtype), a.to(dtype), b.to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    ref = lora_add_reference(y.clone(), x, a, b, index)
    got = lora_add(y.clone(), x, a, b, index)
    torch.testing.assert_close(ref.double(), _definition(y, x, a, b, slots), atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), _definition(y, x, a, b, slots), atol=tol, rtol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    base = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base], y[base])  # base rows untouched, bit for bit


def test_all_base_rows_and_an_empty_batch_change_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = _adapters([4, 4], 16, 32, 48, gen)
    x, y = torch.randn(5, 32, generator=gen), torch.randn(5, 48, generator=gen)
    assert torch.equal(lora_add(y.clone(), x, a, b, torch.full((5,), -1)), y)
    empty = torch.empty(0, 48)
    assert lora_add(empty, torch.empty(0, 32), a, b, torch.empty(0, dtype=torch.long)).shape == (
        0,
        48,
    )


def test_rows_of_a_wider_tensor_are_read_and_written_in_place() -> None:
    """x and y as column slices of wider buffers (a fused projection's output)."""
    gen = torch.Generator().manual_seed(1)
    a, b = _adapters([8, 2], 8, 40, 24, gen)
    wide_x, wide_y = torch.randn(6, 70, generator=gen), torch.randn(6, 50, generator=gen)
    x, y = wide_x[:, 10:50], wide_y[:, 20:44]
    slots = [1, 0, -1, 1, 0, 0]
    want = _definition(y, x, a, b, slots)
    lora_add(y, x, a, b, torch.tensor(slots))
    torch.testing.assert_close(wide_y[:, 20:44].double(), want, atol=1e-4, rtol=1e-4)


def test_a_fused_lora_layer_on_the_kernels_equals_its_cpu_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LoRALinear over a fused projection (three shards) as CUDA runs it (the kernels,
    one launch pair per shard into its columns) and as the CPU runs it (masked matmuls)."""
    from torch import nn

    from backend.layers import lora as layer_module
    from backend.layers.lora import LoRALinear, LoRARows

    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    base = nn.Linear(32, 48)
    rows = LoRARows()
    layer = LoRALinear(base, [32, 8, 8], 3, 8, rows, base.weight.detach())
    for slot, rank in ((0, 8), (2, 3)):
        shards = {i: (torch.randn(rank, 32, generator=gen), torch.randn(n, rank, generator=gen))
                  for i, n in ((0, 32), (2, 8))}  # fmt: skip
        layer.fill(slot, shards, 0.5)
    x = torch.randn(6, 32, generator=gen)
    rows.set(torch.tensor([0, -1, 2, 2, 0, -1]))
    with torch.no_grad():
        cpu = layer(x)
        monkeypatch.setattr(layer_module, "use_fused", lambda _: True)
        kernels = layer(x)
        plain = base(x)
    torch.testing.assert_close(kernels, cpu, atol=1e-4, rtol=1e-4)
    assert torch.equal(cpu[[1, 5]], plain[[1, 5]])
    assert not torch.allclose(cpu[[0, 2]], plain[[0, 2]])
