"""Batched LoRA: every row of a flat batch adds its own adapter's low-rank update,
y[t] += (x[t] @ A[s].T) @ B[s] for s = slots[t], and a row with slot -1 (the base
model) adds nothing. Two launches for the whole batch, whatever mix of adapters it holds
(Punica's SGMV, in its simplest form): shrink (x @ A[s].T, all of a fused layer's shards
at once) and expand (into y, which may be a column slice: one shard of a fused output).

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


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, W] float32: x [T, in] @ A[slot].T per row (rows with slot -1 left unwritten)."""
    num_rows, k = x.shape
    w = a.shape[1]
    shrunk = torch.empty(num_rows, w, dtype=torch.float32, device=x.device)
    if num_rows:
        assert x.stride(1) == 1 and a.is_contiguous()
        _shrink_kernel[(num_rows,)](
            x, a, slots, shrunk,
            k, w,
            x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
            BLOCK_W=_block_w(w), BLOCK_K=64,
        )  # fmt: skip
    return shrunk


def lora_expand(
    y: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """In place: y [T, out] += shrunk [T, W] @ B[slot] for rows with slot >= 0. y and
    shrunk may be column slices of wider tensors (unit stride in the last dimension)."""
    num_rows, n = y.shape
    w = b.shape[1]
    if num_rows:
        assert y.stride(1) == 1 and shrunk.stride(1) == 1 and b.is_contiguous()
        block_n = 64
        _expand_kernel[(num_rows, triton.cdiv(n, block_n))](
            shrunk, b, slots, y,
            n, w,
            shrunk.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_W=_block_w(w), BLOCK_N=block_n,
        )  # fmt: skip
    return y


def lora_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """In place: y [T, out] += x [T, in] @ A[slot].T @ B[slot] for rows with slot >= 0.
    a [L, W, in], b [L, W, out] contiguous; slots [T] int on the same device."""
    return lora_expand(y, lora_shrink(x, a, slots), b, slots)


def _block_w(w: int) -> int:
    return max(16, int(triton.next_power_of_2(w)))
