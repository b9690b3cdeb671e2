"""The CLI against an embedded SQLite database."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from tenants import db


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    assert main(["db", "upgrade"]) == 0
    return tmp_path


def test_tenants_and_keys_lifecycle(cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["tenants", "create", "acme"]) == 0
    assert "created tenant acme" in capsys.readouterr().out
    assert main(["keys", "create", "--tenant", "acme", "--name", "ci"]) == 0
    captured = capsys.readouterr()
    secret = captured.out.strip()
    assert secret.startswith("tg-")
    assert "shown only once" in captured.err
    assert main(["keys", "list", "--tenant", "acme"]) == 0
    listing = capsys.readouterr().out
    prefix = secret.split("_")[0]
    assert prefix in listing and secret not in listing and "active" in listing
    assert main(["keys", "revoke", prefix]) == 0
    assert main(["keys", "list"]) == 0
    assert "revoked" in capsys.readouterr().out


def test_errors_are_reported_not_raised(cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "create", "--tenant", "ghost"]) == 2
    assert "no tenant named 'ghost'" in capsys.readouterr().err
    assert main(["tenants", "create", "acme"]) == 0
    assert main(["tenants", "create", "acme"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_db_current(cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["db", "current"]) == 0
    assert capsys.readouterr().out.strip() == db.head_revision()
