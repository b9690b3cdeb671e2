"""A gateway over two backend replicas in subprocesses; one is killed mid-stream."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Completion
from sqlalchemy import create_engine, text

from backend.wire import SECRET_HEADER
from tests.e2e.processes import Process, free_port, running, start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@dataclass
class Cluster:
    gateway_url: str
    admin_key: str
    model: str
    database_url: str
    backends: list[tuple[str, Process]]
    secret: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    secret = secrets.token_hex(16)
    model = os.environ.get("TOLLGATE_TEST_MODEL", "")
    common = {"TOLLGATE_BACKEND_SECRET": secret, "TOLLGATE_MODEL": model}
    backends = []
    for _ in range(2):
        port = free_port()
        process = start(["backend", "serve", "--port", str(port)], common)
        backends.append((f"http://127.0.0.1:{port}", process))
    data_dir: Path = tmp_path_factory.mktemp("cluster")
    gateway_port = free_port()
    with running(*(process for _, process in backends)):
        for _, process in backends:
            process.wait_for("ready on")
        gateway = start(
            ["serve", "--port", str(gateway_port)],
            {
                **common,
                "TOLLGATE_BACKENDS": ",".join(url for url, _ in backends),
                "TOLLGATE_DATA_DIR": str(data_dir),
                "TOLLGATE_DATABASE_URL": "",
                "TOLLGATE_ADMIN_KEY": "",
            },
        )
        with running(gateway):
            banner = gateway.wait_for('"model"')
            key = banner.split("Admin key (new): ")[1].split()[0]
            served = banner.split('"model": "')[1].split('"')[0]
            yield Cluster(
                gateway_url=f"http://127.0.0.1:{gateway_port}/v1",
                admin_key=key,
                model=served,
                database_url=f"sqlite:///{data_dir / 'tollgate.db'}",
                backends=backends,
                secret=secret,
            )


def _running_on(cluster: Cluster, url: str) -> int:
    stats = httpx.get(f"{url}/internal/stats", headers={SECRET_HEADER: cluster.secret}).json()
    return int(stats["num_running"])


def _usage(cluster: Cluster) -> list[tuple[str, int, str]]:
    """(status, completion tokens, replica) of each usage row, oldest first."""
    engine = create_engine(cluster.database_url)
    try:
        with engine.connect() as connection:
            query = text(
                "SELECT status, completion_tokens, replica FROM usage_events ORDER BY created_at"
            )
            return [(row[0], int(row[1]), row[2]) for row in connection.execute(query)]
    finally:
        engine.dispose()


def test_backend_rejects_a_wrong_secret(cluster: Cluster) -> None:
    url = cluster.backends[0][0]
    assert httpx.get(f"{url}/internal/stats").status_code == 401
    assert httpx.get(f"{url}/internal/stats", headers={SECRET_HEADER: "nope"}).status_code == 401
    assert httpx.get(f"{url}/healthz").status_code == 200


def _read_killing_the_replica_after(
    count: int, stream: Iterable[Completion], cluster: Cluster, received: list[str]
) -> None:
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            received.append(chunk.choices[0].text)
        if len(received) == count:
            [victim] = [p for url, p in cluster.backends if _running_on(cluster, url) == 1]
            victim.kill()


def test_killing_a_replica_mid_stream(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.gateway_url, api_key=cluster.admin_key, max_retries=0)
    stream = client.completions.create(
        model=cluster.model,
        prompt="Return the",
        max_tokens=1000,  # still running when the 5th token is read, even on a fast machine
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received: list[str] = []
    with pytest.raises(openai.APIError) as info:
        _read_killing_the_replica_after(5, stream, cluster, received)
    assert "replica" in str(info.value)
    assert len(received) >= 5

    # Requests that start now go to the survivor (retried there if routed to the dead one).
    for word in ("The", "Return", "Create", "This"):
        reply = client.completions.create(model=cluster.model, prompt=word, max_tokens=4)
        assert reply.usage is not None and reply.usage.completion_tokens > 0

    rows = _usage(cluster)
    failed = [(tokens, replica) for status, tokens, replica in rows if status == "failed"]
    assert len(failed) == 1 and failed[0][0] >= 5  # billed for what was streamed
    [survivor] = {url for url, _ in cluster.backends} - {failed[0][1]}  # the row names its replica
    assert [(status, replica) for status, _, replica in rows[-4:]] == [("completed", survivor)] * 4


def test_no_replica_left_is_503(cluster: Cluster) -> None:
    """Runs last: with every replica gone, requests fail fast with 503 and Retry-After."""
    for _, process in cluster.backends:
        if process.popen.poll() is None:
            process.kill()
    client = openai.OpenAI(base_url=cluster.gateway_url, api_key=cluster.admin_key, max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=cluster.model, prompt="The", max_tokens=2)
    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"] == "1"
