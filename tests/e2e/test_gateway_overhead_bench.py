"""bench/gateway_overhead.py: its instant upstreams and lean client in process, and a
`--dry-run` of the whole bench (processes, a real `tollgate serve`) as a smoke test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from bench.gateway_overhead import (
    MESSAGES,
    TOKENS,
    Client,
    chat_requests,
    openai_routes,
    prompt_tokens,
    replica_requests,
    replica_routes,
    serve_routes,
)
from tests.e2e.processes import free_port

ROOT = Path(__file__).resolve().parents[2]


async def test_instant_upstreams_answer_the_lean_client() -> None:
    openai_port, replica_port = free_port(), free_port()
    servers = [
        await serve_routes(openai_routes(), openai_port),
        await serve_routes(replica_routes(), replica_port),
    ]
    try:
        chat, replica = Client(openai_port), Client(replica_port)
        for stream in (False, True):
            sample = await chat.send(chat_requests(None)[stream])
            assert sample.ok
            assert 0 < sample.ttfb_s <= sample.latency_s
        assert len(chat.idle) == 1  # kept alive and reused
        assert (await replica.send(replica_requests()[False])).ok
        routes = replica_routes()
        body = msgspec.json.encode({"request_id": "r1", "prompt": [1, 2, 3]})
        status, _, lines = routes[(b"POST", b"/internal/generate")](body)
        assert status == 200
        assert isinstance(lines, list)
        outputs = [json.loads(line) for line in lines]
        assert len(outputs) == TOKENS
        assert {o["type"] for o in outputs} == {"output"}
        assert [o["output"]["finished"] for o in outputs] == [False] * (TOKENS - 1) + [True]
        assert {o["output"]["request_id"] for o in outputs} == {"r1"}
        chat.close()
        replica.close()
    finally:
        for server in servers:
            server.close()


async def test_the_openai_mock_reports_the_prompt_tokens_tollgate_counts() -> None:
    """Its usage agrees with the gateway's count (the built-in tokenizer, as the bench
    registers the model): no per-request "usage differs" line is measured as overhead."""
    from backend.builtin import BUILTIN_MODEL_DIR
    from backend.tokenizer import Tokenizer
    from gateway.dispatch.engine_client import LocalTokens

    counted = await LocalTokens(Tokenizer(BUILTIN_MODEL_DIR)).tokenize_chat(MESSAGES)
    status, _, whole = openai_routes()[(b"POST", b"/v1/chat/completions")](b"{}")
    assert status == 200 and isinstance(whole, bytes)
    assert msgspec.json.decode(whole)["usage"]["prompt_tokens"] == len(counted) == prompt_tokens()


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("upstream", "direct"),
    [
        ("replica", {"direct openai mock", "direct replica"}),
        ("openai", {"direct openai mock"}),  # Tollgate fronts the bare proxy's upstream
    ],
)
def test_dry_run_measures_every_target(tmp_path: Path, upstream: str, direct: set[str]) -> None:
    out = tmp_path / "overhead.json"
    command = [sys.executable, "-m", "bench.gateway_overhead", "--dry-run", "--skip-stack"]
    command += ["--tollgate-upstream", upstream]
    done = subprocess.run(
        [*command, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    names = {row["target"] for row in result["rows"]}
    assert names == {*direct, "bare proxy", "tollgate embedded"}
    assert all(row["errors"] == 0 for row in result["rows"])
    for gateway in ("bare proxy", "tollgate embedded"):  # /proc ticks are 10 ms: summed
        rows = [row for row in result["rows"] if row["target"] == gateway]
        assert sum(row["cpu_ms_per_request"] for row in rows) > 0
    assert set(result["sustained"]) == {"bare proxy", "tollgate embedded"}
    assert all(0 <= rate["core_busy"] <= 1.5 for rate in result["sustained"].values())
    assert "targets (issue 19)" in done.stdout
    assert 0 < result["disk_flush"]["p50_ms"] <= result["disk_flush"]["p90_ms"]
    assert "disk flush" in done.stdout
