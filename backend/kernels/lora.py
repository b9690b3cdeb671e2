"""Batched LoRA: every row of a flat batch adds its own adapter's low-rank update,
y[t] += (x[t] @ A[s].T) @ B[s] for s = slots[t], and a row with slot -1 (the base
model) adds nothing. One launch pair (shrink, expand) for the whole batch, whatever
mix of adapters it holds (Punica's SGMV, in its simplest form).

Layout (backend/layers/lora.py fills it): A [L, W, in] and B [L, W, out] for L adapter
slots, W = the widest rank of a slot (an adapter of smaller rank is zero-padded, so
ranks mix freely); the scaling (lora_alpha / r) is folded into B at load time."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def lora_add_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """The definition, row by row through a gather: y [T, out] += x [T, in] @ A[s].T @ B[s]."""
    rows = (slots >= 0).nonzero().flatten()
    if rows.numel():
        s = slots[rows]
        shrunk = torch.bmm(x[rows, None, :], a[s].transpose(1, 2))  # [n, 1, W]
        y[rows] += torch.bmm(shrunk, b[s])[:, 0].to(y.dtype)
    return y


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, out_ptr,
    K, W,
    stride_xt, stride_al, stride_aw, stride_ot,
    BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[t, :W] = x[t] @ A[slot].T, accumulated in float32 over blocks of K."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
        a_tile = tl.load(
            a_ptr + slot * stride_al + w[:, None] * stride_aw + k[None, :],
            mask=(w[:, None] < W) & (k[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a_tile * xk[None, :], axis=1)
    tl.store(out_ptr + t * stride_ot + w, acc, mask=w < W)


@triton.jit
def _expand_kernel(
    shrunk_ptr, b_ptr, slots_ptr, y_ptr,
    N, W,
    stride_st, stride_bl, stride_bw, stride_yt,
    BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y[t, n-block] += shrunk[t, :W] @ B[slot][:, n-block]."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.arange(0, BLOCK_W)
    s = tl.load(shrunk_ptr + t * stride_st + w, mask=w < W, other=0.0)
    b_tile = tl.load(
        b_ptr + slot * stride_bl + w[:, None] * stride_bw + n[None, :],
        mask=(w[:, None] < W) & (n[None, :] < N),
        other=0.0,
    ).to(tl.float32)
    add = tl.sum(s[:, None] * b_tile, axis=0)
    y_row = y_ptr + t * stride_yt + n
    y_old = tl.load(y_row, mask=n < N, other=0.0)
    tl.store(y_row, (y_old.to(tl.float32) + add).to(y_old.dtype), mask=n < N)


def lora_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """In place: y [T, out] += x [T, in] @ A[slot].T @ B[slot] for rows with slot >= 0.
    x, y: row-major rows (unit stride in the last dimension); a [L, W, in], b [L, W, out]
    contiguous; slots [T] int on the same device."""
    num_rows, k = x.shape
    _, w, n = b.shape
    if num_rows == 0:
        return y
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    shrunk = torch.empty(num_rows, w, dtype=torch.float32, device=x.device)
    block_w = max(16, triton.next_power_of_2(w))
    _shrink_kernel[(num_rows,)](
        x, a, slots, shrunk,
        k, w,
        x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        BLOCK_W=block_w, BLOCK_K=64,
    )  # fmt: skip
    block_n = 64
    _expand_kernel[(num_rows, triton.cdiv(n, block_n))](
        shrunk, b, slots, y,
        n, w,
        shrunk.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_W=block_w, BLOCK_N=block_n,
    )  # fmt: skip
    return y
