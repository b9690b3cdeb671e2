"""`tollgate capacity check` on a CUDA device: the engine's pool beside the planner's
arithmetic, and step times with peaks calibrated on the GPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from backend.builtin import BUILTIN_MODEL_DIR
from backend.capacity.check import check_in_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_check_on_the_gpu() -> None:
    facts, peaks, cal = check_in_process(BUILTIN_MODEL_DIR, "cuda")
    assert facts.device.startswith("cuda") and facts.dtype in ("bf16", "fp16")
    assert facts.bytes_per_block == facts.planner_bytes_per_block
    assert facts.kv_tensor_bytes == facts.num_blocks * facts.bytes_per_block
    assert peaks.flops > 1e12 and peaks.bandwidth > 1e11  # any datacenter GPU beats these
    assert all(p.measured_s > 0 for p in cal.points)
    assert cal.mean_abs_error <= cal.floor_error
