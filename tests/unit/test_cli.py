"""The CLI against an embedded SQLite database."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.commands import main
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


def test_plans_set_their_batch_token_and_file_storage_caps(
    cli_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plans", "create", "gold", "--rpm", "10", "--max-batch-tokens", "5000"]
    assert main([*argv, "--max-file-bytes", "1048576"]) == 0
    assert "max_batch_tokens=5000\tmax_file_bytes=1048576" in capsys.readouterr().out
    assert main(["plans", "update", "gold", "--max-file-bytes", "none"]) == 0  # the default
    updated = capsys.readouterr().out
    assert "max_batch_tokens=5000\tmax_file_bytes=-" in updated and "rpm=10" in updated
    with pytest.raises(SystemExit):  # argparse refuses it
        main(["plans", "update", "gold", "--max-batch-tokens", "-1"])


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


MODELS_ADD = ["models", "add", "llama", "--kind", "openai"]


def _models(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["models", "list", "--json"]) == 0
    return list(json.loads(capsys.readouterr().out))


def test_models_add_update_list_remove(cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    targets = ["--target", "http://127.0.0.1:8001=3", "--target", "http://127.0.0.1:8002/"]
    assert (
        main(
            [
                *MODELS_ADD,
                *targets,
                "--api-key-env",
                "TOLLGATE_UPSTREAM_KEY_VLLM",
                "--context",
                "8192",
            ]
        )
        == 0
    )
    added = capsys.readouterr().out
    assert "added llama\topenai\thttp://127.0.0.1:8001=3,http://127.0.0.1:8002=1" in added
    assert "no price" in added and "tollgate prices set --model llama" in added
    [model] = _models(capsys)
    assert model["targets"] == [
        {"url": "http://127.0.0.1:8001", "weight": 3},
        {"url": "http://127.0.0.1:8002", "weight": 1},
    ]

    update = ["models", "update", "llama"]
    assert main([*update, "--upstream-model", "meta/llama", "--context", "none"]) == 0
    [model] = _models(capsys)
    assert (model["upstream_model"], model["context_length"]) == ("meta/llama", None)
    assert model["api_key_env"] == "TOLLGATE_UPSTREAM_KEY_VLLM"  # not given: unchanged
    weighed = ["--target", "http://a:1", "--target", "http://b:2", "--weight", "2", "--weight", "5"]
    assert main([*update, *weighed]) == 0
    assert [t["weight"] for t in _models(capsys)[0]["targets"]] == [2, 5]

    assert main(["models", "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("NAME\tKIND") and table[1].startswith("llama\topenai\t")
    assert main(["audit", "list", "--action", "model.update"]) == 0
    assert "\tcli:" in capsys.readouterr().out

    assert main(["models", "remove", "llama"]) == 0
    assert _models(capsys) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*MODELS_ADD, "--target", "ftp://h"], "must be an http(s) URL"),
        ([*MODELS_ADD, "--target", "http://h=x"], "weight must be a whole number"),
        ([*MODELS_ADD, "--target", "http://h", "--weight", "1", "--weight", "2"], "one each"),
        ([*MODELS_ADD, "--target", "http://h", "--context", "lots"], "must be a whole number"),
        ([*MODELS_ADD, "--target", "http://h", "--api-key-env", "sk-abc"], "variable"),
        (
            [*MODELS_ADD, "--target", "http://h", "--api-key-env", "TOLLGATE_BACKEND_SECRET"],
            "TOLLGATE_UPSTREAM_KEY_<NAME>",
        ),
        ([*MODELS_ADD, "--target", "http://h", "--tokenizer", "rel/dir"], "absolute"),
        (["models", "update", "ghost", "--context", "5"], "no model named 'ghost'"),
        (["models", "update", "ghost"], "nothing to change"),
        (["models", "remove", "ghost"], "no model named 'ghost'"),
    ],
)
def test_models_bad_input_exits_2_with_one_line(
    cli_env: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_models_add_twice_is_refused(cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MODELS_ADD, "--target", "http://h"]) == 0
    assert main([*MODELS_ADD, "--target", "http://h"]) == 2
    assert "already exists" in capsys.readouterr().err
