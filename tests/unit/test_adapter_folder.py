"""An adapter's folder as adding one checks it (tenants/adapters.py read_folder), found by
probing a live gateway: what the engine would serve silently wrong, or fail on at every
request, or what would stall the gateway, is refused when the admin adds it."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from tenants.adapters import read_folder
from tenants.errors import InvalidInputError

RANK = 4


def _header(tensors: dict[str, list[int]]) -> bytes:
    """A safetensors file's bytes: the header's length, the header, no data (shapes only
    matter to the check; the engine reads the data)."""
    header = json.dumps(
        {k: {"dtype": "F32", "shape": s, "data_offsets": [0, 0]} for k, s in tensors.items()}
    )
    return struct.pack("<Q", len(header)) + header.encode()


def _folder(root: Path, weights: bytes | None = None, **config: Any) -> Path:
    root.mkdir()
    base = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (root / "adapter_config.json").write_text(json.dumps(base | config))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    shapes = {f"{key}.lora_A.weight": [RANK, 192], f"{key}.lora_B.weight": [192, RANK]}
    (root / "adapter_model.safetensors").write_bytes(
        _header(shapes) if weights is None else weights
    )
    return root


def test_a_plain_lora_folder_is_accepted(tmp_path: Path) -> None:
    folder = read_folder(str(_folder(tmp_path / "ok")))
    assert (folder.rank, folder.target_modules) == (RANK, ("q_proj",))


@pytest.mark.parametrize(
    "config",
    [
        {"use_dora": True},
        {"bias": "all"},
        {"modules_to_save": ["lm_head"]},
        {"rank_pattern": {"q_proj": 8}},
    ],
)
def test_peft_options_the_engine_ignores_are_refused(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    with pytest.raises(InvalidInputError, match="the engine serves plain LoRA"):
        read_folder(str(_folder(tmp_path / "x", None, **config)))


def test_target_modules_that_are_not_names_are_a_400_not_a_crash(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="target_modules must be module names"):
        read_folder(str(_folder(tmp_path / "x", target_modules=[["q_proj"]])))


@pytest.mark.parametrize("weights", [b"not a safetensors file", b"", struct.pack("<Q", 1 << 40)])
def test_weights_that_are_no_safetensors_file_are_refused(tmp_path: Path, weights: bytes) -> None:
    with pytest.raises(InvalidInputError, match=r"no readable adapter_model\.safetensors"):
        read_folder(str(_folder(tmp_path / "x", weights)))


def test_tensors_of_another_rank_than_the_config_says_are_refused(tmp_path: Path) -> None:
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    folder = _folder(tmp_path / "x", _header({key: [64, 192]}))
    with pytest.raises(InvalidInputError, match=r"is \[64, 192\], not of rank 4"):
        read_folder(str(folder))


def test_a_fifo_as_config_is_refused_without_blocking(tmp_path: Path) -> None:
    """Reading a FIFO blocks until a writer comes: in the gateway, its whole event loop."""
    folder = _folder(tmp_path / "x")
    config = folder / "adapter_config.json"
    config.unlink()
    os.mkfifo(config)
    outcome: list[BaseException | None] = []

    def check() -> None:
        try:
            read_folder(str(folder))
            outcome.append(None)
        except InvalidInputError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=check, daemon=True)
    reader.start()
    reader.join(timeout=30)  # a bound on a failure, not synchronisation: it returns at once
    if reader.is_alive():  # release the blocked reader so the test process can end
        config.write_text("{}")
        reader.join()
    assert outcome and isinstance(outcome[0], InvalidInputError)
    assert "no readable adapter_config.json" in str(outcome[0])


def test_an_oversized_config_is_refused_unread(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "x")
    (folder / "adapter_config.json").write_text(json.dumps({"r": RANK, "pad": "x" * (2 << 20)}))
    with pytest.raises(InvalidInputError, match=r"no readable adapter_config\.json"):
        read_folder(str(folder))
