"""The kernel section of bench/gpu_check.py: each kernel of backend/kernels against its
torch reference on fresh random inputs, error as ||out - ref|| / ||ref||. Each check is
separate, so a kernel whose signature changed is one failed entry, not a lost section."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

Check = dict[str, Any]


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 1.5e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def run_all(device: torch.device, dtype: torch.dtype) -> list[Check]:
    small = device.type == "cpu"  # the dry run: the interpreter is slow
    hidden = [64] if small else [2048, 4096]
    heads = [(4, 2, 16)] if small else [(32, 8, 64), (32, 8, 128)]
    checks: list[tuple[str, Callable[[], Check]]] = [
        ("write_kv", partial(check_write_kv, device, dtype, small)),
    ]
    for h in hidden:
        checks += [
            (f"rms_norm h={h}", partial(check_rms_norm, device, dtype, h, False)),
            (f"rms_norm+residual h={h}", partial(check_rms_norm, device, dtype, h, True)),
            (f"silu_and_mul w={h * 4}", partial(check_silu, device, dtype, h * 4)),
        ]
    for cfg in heads:
        for segments in (1, 4):
            name = f"paged_attention heads={cfg[0]}/{cfg[1]} d={cfg[2]} segments={segments}"
            checks.append((name, partial(check_attention, device, dtype, cfg, segments, small)))
    return [_guarded(name, work) for name, work in checks]


def _guarded(name: str, work: Callable[[], Check]) -> Check:
    try:
        return {"name": name, **work()}
    except Exception as exc:  # a missing kernel or a changed signature: this check fails
        return {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _module(name: str) -> Any:
    return importlib.import_module(f"backend.kernels.{name}")


def check_write_kv(device: torch.device, dtype: torch.dtype, small: bool) -> Check:
    mod = _module("kv_cache")
    blocks, block_size, kv_heads, dim = (16, 16, 2, 16) if small else (4096, 16, 8, 128)
    tokens = 37 if small else 1000
    k, v = (torch.randn(tokens, kv_heads, dim, device=device).to(dtype) for _ in range(2))
    slots = torch.randperm(blocks * block_size, device=device)[:tokens]
    slots[::7] = -1  # padded rows of a CUDA-graph batch: not stored
    k_cache, v_cache = (
        torch.randn(blocks, block_size, kv_heads, dim, device=device).to(dtype) for _ in range(2)
    )
    caches = [k_cache, v_cache, k_cache.clone(), v_cache.clone()]
    mod.write_kv(k, v, caches[0], caches[1], slots)
    mod.write_kv_reference(k, v, caches[2], caches[3], slots)
    equal = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    return {"ok": equal, "exact": equal}


def check_rms_norm(device: torch.device, dtype: torch.dtype, hidden: int, residual: bool) -> Check:
    mod = _module("norm")
    x = torch.randn(37, hidden, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    res = torch.randn(37, hidden, device=device).to(dtype) if residual else None
    res_ref = None if res is None else res.clone()
    out = mod.rms_norm(x, weight, 1e-5, res)
    ref = mod.rms_norm_reference(x, weight, 1e-5, res_ref)
    errors = [rel_err(out, ref)]
    if res is not None and res_ref is not None:
        errors.append(rel_err(res, res_ref))
    return {"ok": max(errors) <= tolerance(dtype), "rel_err": max(errors)}


def check_silu(device: torch.device, dtype: torch.dtype, width: int) -> Check:
    mod = _module("norm")
    gate_up = torch.randn(37, 2 * width, device=device).to(dtype)
    err = rel_err(mod.silu_and_mul(gate_up), mod.silu_and_mul_reference(gate_up))
    return {"ok": err <= tolerance(dtype), "rel_err": err}


def check_attention(
    device: torch.device,
    dtype: torch.dtype,
    cfg: tuple[int, int, int],
    segments: int,
    small: bool,
) -> Check:
    """A ragged batch of decode rows (long contexts among them), whole prefills and chunks
    over a cached prefix, over blocks shuffled through the pool."""
    mod = _module("paged_attention")
    heads, kv_heads, dim = cfg
    block_size = 16
    seqs = [(37, 1), (23, 23), (150, 40), (300, 1), (5, 1), (70, 70)]
    seqs += [(200, 1)] if small else [(4000, 1), (2000, 512), (8000, 1)]
    widths = [-(-n // block_size) for n, _ in seqs]
    num_blocks = sum(widths) + 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, device=device).to(dtype)
    pool = torch.randperm(num_blocks, device=device)
    tables = torch.randint(0, num_blocks, (len(seqs), max(widths) + 2), device=device)
    taken = 0
    for i, w in enumerate(widths):
        tables[i, :w] = pool[taken : taken + w]
        taken += w
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], heads, dim, device=device).to(dtype)
    lens = [n for n, _ in seqs]
    scale = dim**-0.5
    out, lse = mod.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(lens, device=device),
        torch.tensor(starts, device=device),
        scale,
        max(new for _, new in seqs),
        num_segments=segments,
    )
    ref, ref_lse = mod.paged_attention_reference(q, k_cache, v_cache, tables, lens, starts, scale)
    err, lse_err = rel_err(out, ref), float((lse - ref_lse).abs().max())
    return {
        "ok": err <= tolerance(dtype) and lse_err <= 1e-2,
        "rel_err": err,
        "lse_abs_err": lse_err,
    }
