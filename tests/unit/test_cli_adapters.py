"""`tollgate adapters add|list|remove` against an embedded SQLite database: the folder
checked against the engine's knobs as the environment sets them, the changes audited."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli.commands import main


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    assert main(["db", "upgrade"]) == 0
    assert main(["tenants", "create", "acme"]) == 0
    return tmp_path


def _folder(root: Path, rank: int, targets: list[str]) -> Path:
    """A PEFT folder as far as adding checks it (the engine reads the weights)."""
    root.mkdir()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": targets}
    (root / "adapter_config.json").write_text(json.dumps(config))
    (root / "adapter_model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")  # no tensors
    return root


def test_adapters_add_list_remove(
    cli_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    good = _folder(cli_env / "good", 8, ["q_proj", "v_proj"])
    add = ["adapters", "add", "support-ft", "--base", "tollgate-tiny", "--tenant", "acme"]
    assert main([*add, "--path", str(good)]) == 0
    assert "added support-ft\tacme\ttollgate-tiny\t8\tq_proj,v_proj" in capsys.readouterr().out
    assert main([*add, "--path", str(good)]) == 2
    assert "is taken" in capsys.readouterr().err
    assert main(["adapters", "list", "--json"]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert listed["name"] == "support-ft" and listed["path"] == str(good)
    assert main(["adapters", "remove", "support-ft"]) == 0
    assert main(["adapters", "list", "--tenant", "acme"]) == 0
    assert capsys.readouterr().out.strip().endswith("PATH")  # the header alone
    assert main(["audit", "list", "--action", "adapter.add"]) == 0
    assert "adapter:support-ft" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("rank", "targets", "error"),
    [
        (32, ["q_proj"], "rank 32 is above the engine's max_lora_rank 16"),
        (4, ["lm_head"], "the adapter targets ['lm_head']"),
    ],
)
def test_adapters_the_engine_cannot_serve_are_refused(
    cli_env: Path, capsys: pytest.CaptureFixture[str], rank: int, targets: list[str], error: str
) -> None:
    folder = _folder(cli_env / "bad", rank, targets)
    add = ["adapters", "add", "x", "--base", "m", "--tenant", "acme", "--path", str(folder)]
    assert main(add) == 2
    assert error in capsys.readouterr().err


def test_the_rank_limit_follows_the_engine_knob(
    cli_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOLLGATE_MAX_LORA_RANK", "64")
    folder = _folder(cli_env / "wide", 32, ["o_proj"])
    assert (
        main(["adapters", "add", "x", "--base", "m", "--tenant", "acme", "--path", str(folder)])
        == 0
    )
