from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.engine.engine_support import build_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Tiny models on a shared 2-core machine: extra intra-op threads only add contention.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: build_checkpoint(root / kind, kind) for kind in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="session")
def llama_dir(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]
