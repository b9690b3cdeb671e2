"""The engine as remote backend replicas over the internal HTTP API (backend/server.py).

A request is retried on another replica only while nothing of it has reached the
client, so no client ever sees a token twice: a stream until its first output (which is
sent at once), a whole response (restartable) until its end: the retry then starts with
a RESTART output that tells the caller to drop what it collected. A replica that dies
mid-stream fails that stream with EngineUnavailable, which the gateway turns into a
clean error event.

A replica's refusal (4xx: the request is invalid) is never retried elsewhere, and a
request on which replicas failed MAX_REPLICA_FAILURES times (it may be what kills them)
is not sent to another one: it fails with `replica_failed`. A replica that refuses the
connection never saw the request, so that is no failure of the request: it leaves
routing and the next one is tried; with none left the answer is 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec

from backend import RequestOutput
from backend.errors import EngineError
from backend.tokenizer import Tokenizer
from backend.wire import (
    ERRORS,
    LINES,
    SECRET_HEADER,
    AbortBody,
    EmbedBody,
    EmbedReply,
    ErrorLine,
    GenerateBody,
    OutputLine,
    StatsReply,
)
from gateway.core.errors import EngineUnavailable, InvalidRequest, Overloaded
from gateway.core.tasks import Periodic, TaskSet
from gateway.dispatch.engine_client import (
    ENGINE_REFUSALS,
    RESTART,
    GenerateRequest,
    LocalTokens,
    refusal,
)
from gateway.dispatch.routing import Replica, affinity_key, pick
from gateway.telemetry import tracing
from gateway.telemetry.request import current_request

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 1.0
CONNECT_TIMEOUT_S = 2.0
MAX_REPLICA_FAILURES = 2  # one retry after a replica died under a request, no more
EMBEDDINGS = msgspec.json.Decoder(EmbedReply)
STATS = msgspec.json.Decoder(StatsReply)
UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout)  # the request was never sent


class ReplicaFailed(EngineError):
    """The replica broke the stream (connection lost, engine dead, bad reply)."""


class ReplicaDown(ReplicaFailed):
    """The replica could not be reached: the request never got there."""


class ReplicaRefused(EngineError):
    """The replica answered 4xx: the request itself is at fault, so no retry."""


def _leave_routing(replica: Replica, exc: ReplicaDown) -> None:
    """Until the health check brings it back."""
    replica.healthy = False
    log.warning("replica %s is unreachable: %s", replica.url, exc)


def _give_up_unless_retryable(
    replica: Replica,
    request_id: str,
    exc: ReplicaFailed,
    failures: int,
    started: bool,
    restartable: bool,
) -> None:
    """A replica broke a request's stream: it leaves routing (the health check brings it
    back), and the request fails unless another replica may run it afresh."""
    replica.healthy = False
    log.warning("replica %s failed request %s: %s", replica.url, request_id, exc)
    if failures >= MAX_REPLICA_FAILURES:
        raise EngineUnavailable(
            f"the request failed on {failures} backend replicas; it is not "
            "retried further (it may be what made them fail)",
            code="replica_failed",
        ) from exc
    if started and not restartable:
        raise EngineUnavailable(
            "the backend replica serving this request failed", code="replica_failed"
        ) from exc


def restart_output(request_id: str) -> RequestOutput:
    """The marker a restartable request's retry begins with: drop what came before."""
    return RequestOutput(request_id, "", [], False, RESTART, 0, 0)


class RemoteEngineClient(LocalTokens):
    def __init__(
        self,
        replicas: Sequence[str],
        secret: str,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        hidden_size: int | None = None,
        weights: Mapping[str, int] | None = None,  # a registry pool's routing weights
    ) -> None:
        super().__init__(tokenizer)
        self.replicas = [Replica(url, weight=(weights or {}).get(url, 1)) for url in replicas]
        self.hidden_size = hidden_size
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._http = httpx.AsyncClient(
            headers={SECRET_HEADER: secret},
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._placements: dict[str, Replica] = {}
        self._health = Periodic([(self.refresh, HEALTH_INTERVAL_S)])  # started by connect
        self._aborts = TaskSet()  # finished before the HTTP client closes

    @classmethod
    async def connect(
        cls,
        replicas: Sequence[str],
        secret: str,
        cache_dir: Path,
        weights: Mapping[str, int] | None = None,
    ) -> RemoteEngineClient:
        """Learn the model and its tokenizer from the first replica that answers."""
        info = await _fetch_info(replicas, secret)
        folder = cache_dir / "tokenizers" / info["model"]
        folder.mkdir(parents=True, exist_ok=True)
        for name, content in info["files"].items():
            _write_atomically(folder / Path(name).name, content)
        client = cls(
            replicas,
            secret,
            Tokenizer(folder),
            info["model"],
            info["max_model_len"],
            info.get("hidden_size"),
            weights,
        )
        await client.refresh()
        client._health.start()
        return client

    def is_ready(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def is_alive(self) -> bool:
        return True  # a dead replica is its own supervisor's to restart

    def interactive_work(self) -> int:
        """From each replica's last stats poll (every HEALTH_INTERVAL_S)."""
        return sum(r.interactive for r in self.replicas if r.healthy)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Replicas run the gateway's tokens, not `source`."""
        request_id = request.request_id
        body = msgspec.json.encode(GenerateBody.sent(request))
        key = affinity_key(request.tenant, request.prompt)
        adapter = None if request.lora is None else request.lora.name
        tried: set[str] = set()
        shed: Overloaded | None = None  # every replica tried so far was overloaded
        failures = 0
        handed_back = False  # outputs of an earlier attempt reached the caller
        while True:
            replica = self._next_replica(key, tried, shed, adapter)
            started = False
            replica.in_flight += 1
            self._placements[request_id] = replica
            try:
                async for out in self._stream(replica, body, request.params.n):
                    if handed_back and not started:
                        yield restart_output(request_id)
                    started = True
                    yield out
                return
            except Overloaded as exc:  # nothing was handed back: another replica may have room
                if started:
                    raise
                shed = exc
            except ReplicaRefused as exc:
                raise EngineUnavailable(
                    f"the backend replica refused this request: {exc}", code="replica_refused"
                ) from exc
            except ReplicaDown as exc:
                _leave_routing(replica, exc)
            except ReplicaFailed as exc:
                failures += 1
                _give_up_unless_retryable(
                    replica, request_id, exc, failures, started, request.restartable
                )
                handed_back = handed_back or started
            finally:
                replica.in_flight -= 1
                self._placements.pop(request_id, None)

    def _next_replica(
        self, key: bytes, tried: set[str], shed: Overloaded | None, adapter: str | None = None
    ) -> Replica:
        """The next replica to try, routed to; none left: the last shedding, or 503."""
        replica = pick(self.replicas, key, exclude=tried, adapter=adapter)
        if replica is None:
            raise shed or _no_replica()
        tried.add(replica.url)
        current_request().route(replica.url)
        return replica

    async def _stream(self, replica: Replica, body: bytes, n: int) -> AsyncIterator[RequestOutput]:
        """The outputs of one attempt, until each of the request's n completions finished."""
        unfinished = n
        try:
            async with self._http.stream(
                "POST",
                f"{replica.url}/internal/generate",
                content=body,
                headers=tracing.trace_headers(),  # the backend's spans join this trace
            ) as response:
                if response.status_code in (400, 413, 422):
                    raise _invalid(await response.aread())
                if 400 <= response.status_code < 500:
                    raise ReplicaRefused(f"HTTP {response.status_code}")
                if response.status_code != 200:
                    raise ReplicaFailed(f"HTTP {response.status_code}")
                async for line in response.aiter_lines():
                    out = self._decode(line)
                    yield out
                    if out.finished:
                        unfinished -= 1
                        if not unfinished:
                            return
        except UNREACHABLE as exc:
            raise ReplicaDown(repr(exc)) from exc
        except httpx.TransportError as exc:
            raise ReplicaFailed(repr(exc)) from exc
        raise ReplicaFailed("the stream ended before the request finished")

    @staticmethod
    def _decode(line: str) -> RequestOutput:
        """One line of a generate stream: the output, or the replica's error raised."""
        try:
            decoded = LINES.decode(line)
        except msgspec.DecodeError as exc:
            raise ReplicaFailed(f"unreadable reply: {exc}") from exc
        if isinstance(decoded, OutputLine):
            return decoded.output
        raise _replica_error(decoded)

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """Nothing reaches the client before the vectors, so a replica that sheds or fails
        them is replaced by another (at most MAX_REPLICA_FAILURES failures)."""
        body = msgspec.json.encode(EmbedBody(prompts))
        key = affinity_key(None, prompts[0])
        tried: set[str] = set()
        shed: Overloaded | None = None
        failures = 0
        while True:
            replica = self._next_replica(key, tried, shed)
            try:
                return await self._embed_on(replica, body)
            except Overloaded as exc:
                shed = exc
            except ReplicaDown as exc:
                _leave_routing(replica, exc)
            except ReplicaFailed as exc:
                replica.healthy = False  # the health check brings it back when it answers
                failures += 1
                log.warning("replica %s failed an embedding: %s", replica.url, exc)
                if failures >= MAX_REPLICA_FAILURES:
                    raise EngineUnavailable(
                        f"the embedding failed on {failures} backend replicas",
                        code="replica_failed",
                    ) from exc

    async def _embed_on(self, replica: Replica, body: bytes) -> list[list[float]]:
        replica.in_flight += 1
        try:
            response = await self._http.post(
                f"{replica.url}/internal/embed", content=body, headers=tracing.trace_headers()
            )
        except UNREACHABLE as exc:
            raise ReplicaDown(repr(exc)) from exc
        except httpx.TransportError as exc:
            raise ReplicaFailed(repr(exc)) from exc
        finally:
            replica.in_flight -= 1
        if response.status_code == 400:
            raise _invalid(response.content)
        if response.status_code != 200:
            try:
                error = ERRORS.decode(response.content)
            except msgspec.DecodeError:
                raise ReplicaFailed(f"HTTP {response.status_code}") from None
            raise _replica_error(error)
        try:
            return EMBEDDINGS.decode(response.content).embeddings
        except msgspec.DecodeError as exc:
            raise ReplicaFailed(f"unreadable reply: {exc}") from exc

    def abort(self, request_id: str) -> None:
        """Closing the stream already aborts on the replica; this says it explicitly."""
        replica = self._placements.get(request_id)
        if replica is not None:
            self._aborts.spawn(self._abort(replica, request_id))

    async def _abort(self, replica: Replica, request_id: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post(
                f"{replica.url}/internal/abort",
                content=msgspec.json.encode(AbortBody(request_id)),
                timeout=2.0,
            )

    async def refresh(self) -> None:
        """Poll every replica's stats: health and load for routing."""
        await asyncio.gather(*(self._poll(r) for r in self.replicas))

    async def _poll(self, replica: Replica) -> None:
        try:
            response = await self._http.get(
                f"{replica.url}/internal/stats", timeout=HEALTH_TIMEOUT_S
            )
            stats = STATS.decode(response.content) if response.status_code == 200 else None
        except httpx.TimeoutException:  # late, to connect or to answer: busy, not down
            replica.missed()
            return
        except (httpx.HTTPError, msgspec.DecodeError):
            stats = None
        replica.answered(healthy=stats is not None and stats.running)
        if stats is None or not replica.healthy:
            return
        replica.waiting = stats.num_waiting
        replica.running = stats.num_running
        replica.interactive = stats.num_interactive
        replica.kv_used_fraction = stats.kv_blocks_used / max(1, stats.kv_blocks_total)
        queries = max(1, stats.prefix_cache_queries)
        replica.prefix_cache_hit_rate = stats.prefix_cache_hits / queries
        replica.busy_s, replica.batch_busy_s = stats.busy_s, stats.batch_busy_s
        replica.adapters = frozenset(stats.loaded_lora_adapters + stats.running_lora_adapters)

    async def close(self) -> None:
        await self._health.close()
        await self._aborts.drain()
        await self._http.aclose()


async def _fetch_info(replicas: Sequence[str], secret: str) -> dict[str, Any]:
    async with httpx.AsyncClient(headers={SECRET_HEADER: secret}, timeout=5.0) as http:
        for url in replicas:
            try:
                response = await http.get(f"{url}/internal/info")
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                info: dict[str, Any] = response.json()
                return info
    raise EngineUnavailable(f"no backend replica answered: {', '.join(replicas)}")


def _no_replica() -> EngineUnavailable:
    return EngineUnavailable("no backend replica is available", headers={"Retry-After": "1"})


def _replica_error(line: ErrorLine) -> Exception:
    """The error a replica sent, as the gateway's; a dead engine's is a replica failure
    (another replica may serve the request), a failed request's is not (the replica is
    fine, and retrying could repeat it)."""
    exc = line.exception()
    if isinstance(exc, ENGINE_REFUSALS):
        return refusal(exc)
    return ReplicaFailed(line.message)


def _invalid(body: bytes) -> InvalidRequest:
    """The replica's 400 (an invalid_request ErrorLine: message and parameter) as ours."""
    try:
        error = ERRORS.decode(body)
    except msgspec.DecodeError:  # not a refusal we know: pass it on
        return InvalidRequest(body.decode(errors="replace"))
    return InvalidRequest(error.message, param=error.param)


def _write_atomically(path: Path, content: str) -> None:
    """Gateways sharing a data folder learn the same tokenizer at once: each writes its
    own temporary file and renames it, so none reads another's half-written file."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    temporary.write_text(content, encoding="utf-8")
    temporary.replace(path)
