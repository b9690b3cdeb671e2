"""A step's small host-side arrays (token ids, positions, slots, sampling parameters),
packed into one pinned buffer per dtype and copied to the device at once.

On CUDA the copies are non-blocking: a step's only wait is the read-back of its sampled
tokens. (A `torch.tensor(list, device="cuda")` instead waits for the GPU every time:
pageable memory makes the copy synchronous.) On the CPU nothing is copied."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


class Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: dict[torch.dtype, list[tuple[str, np.ndarray]]] = {}

    def add(
        self, name: str, data: Sequence[object] | np.ndarray, dtype: torch.dtype = torch.int64
    ) -> None:
        """A list, a list of equal-length lists (a 2-D array), or an array."""
        array = np.asarray(data, dtype=_NUMPY[dtype])
        self._parts.setdefault(dtype, []).append((name, array))

    def upload(self) -> dict[str, torch.Tensor]:
        """Every array added, on the device: one copy per dtype."""
        tensors: dict[str, torch.Tensor] = {}
        for parts in self._parts.values():
            flat = np.concatenate([a.reshape(-1) for _, a in parts])
            on_device = to_device(torch.from_numpy(flat), self.device)
            offset = 0
            for name, array in parts:
                tensors[name] = on_device[offset : offset + array.size].view(array.shape)
                offset += array.size
        self._parts.clear()
        return tensors


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a wait: pinned (PyTorch's caching host allocator
    keeps the block until the copy is done), then copied asynchronously."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Device tensors on the host, after one wait for all of them: the step's read-back."""
    if not tensors or tensors[0].device.type != "cuda":
        return list(tensors)
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host


class Readback:
    """Device tensors on their way to the host: the copies start at once (into pinned
    memory) and `wait` waits for them alone, by an event recorded after them, not for the
    stream: work enqueued later (the next step, under async scheduling) keeps running."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if not tensors or tensors[0].device.type != "cuda":
            self._host = list(tensors)
            return
        self._host = [
            torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors
        ]
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(tensors[0].device))

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
