"""A small stateful fake of the Stripe API, enough for the `stripe` SDK's meter export.

Serves on a free loopback port in a thread: customers, billing meters and meter events
(deduplicated by `identifier`; a repeated Idempotency-Key replays the saved response —
even a 500 — as Stripe's v1 API does). Faults are programmed per meter-event request —
429, 500, a hang past the client's timeout, or "committed, then the connection dropped" —
either as a script (the next requests, in order) or as seeded random rates.

Test-only endpoints: GET /_fake/totals (value per customer), POST /_fake/faults (JSON
{"script": [...], "rates": {...}}).
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

FAULTS = ("429", "500", "400", "hang", "drop_after_commit")


@dataclass
class Faults:
    script: list[str] = field(default_factory=list)  # applied to the next requests, in order
    rates: dict[str, float] = field(default_factory=dict)  # fault -> probability per request
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    def next(self) -> str | None:
        if self.script:
            return self.script.pop(0)
        draw = self.rng.random()
        for fault, rate in self.rates.items():
            if draw < rate:
                return fault
            draw -= rate
        return None


class FakeStripe:
    def __init__(self, hang_s: float = 1.0) -> None:
        self.hang_s = hang_s
        self.lock = threading.Lock()
        self.customers: dict[str, dict[str, Any]] = {}
        self.meters: dict[str, dict[str, Any]] = {}
        self.events: dict[str, dict[str, Any]] = {}  # identifier -> event
        self.totals: Counter[str] = Counter()  # customer -> summed value
        self.saved: dict[str, tuple[int, bytes]] = {}  # idempotency key -> response
        self.faults = Faults()
        self.injected: Counter[str] = Counter()
        self.meter_event_requests = 0
        # Once this many events are recorded, meter-event requests wait for `release`
        # (then drop): a test can catch a client mid-batch, deterministically.
        self.hold_after: int | None = None
        self.release = threading.Event()
        self.held = 0
        self._ids = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "not serving"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def program(self, script: Iterable[str] = (), rates: Mapping[str, float] | None = None) -> None:
        with self.lock:
            self.faults.script = list(script)
            self.faults.rates = dict(rates or {})

    def customer_totals(self) -> dict[str, int]:
        with self.lock:
            return dict(self.totals)

    def accepted(self) -> int:
        with self.lock:
            return len(self.events)

    @contextmanager
    def serving(self) -> Iterator[FakeStripe]:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        server.daemon_threads = True
        self._server = server
        thread = threading.Thread(target=server.serve_forever, name="fake-stripe", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

    # The API: each returns (status, body) or None to drop the connection unanswered.

    def handle(
        self, method: str, path: str, form: dict[str, str], idempotency_key: str | None
    ) -> tuple[int, dict[str, Any]] | None:
        if (method, path) == ("POST", "/v1/billing/meter_events"):
            return self._meter_event(form, idempotency_key)
        with self.lock:
            if idempotency_key is not None and idempotency_key in self.saved:
                status, body = self.saved[idempotency_key]
                return status, json.loads(body)
            result = self._route(method, path, form)
            if idempotency_key is not None and method == "POST":
                self.saved[idempotency_key] = (result[0], json.dumps(result[1]).encode())
            return result

    def _route(self, method: str, path: str, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        if (method, path) == ("POST", "/v1/customers"):
            customer: dict[str, Any] = {
                "id": f"cus_{next(self._ids)}",
                "object": "customer",
                "name": form.get("name"),
                "metadata": _nested(form, "metadata"),
            }
            self.customers[customer["id"]] = customer
            return 200, customer
        if (method, path) == ("POST", "/v1/billing/meters"):
            meter: dict[str, Any] = {
                "id": f"mtr_{next(self._ids)}",
                "object": "billing.meter",
                "display_name": form.get("display_name"),
                "event_name": form.get("event_name"),
                "status": "active",
                "default_aggregation": {"formula": form.get("default_aggregation[formula]")},
            }
            self.meters[meter["id"]] = meter
            return 200, meter
        if (method, path) == ("GET", "/v1/billing/meters"):
            data = list(self.meters.values())
            return 200, {"object": "list", "data": data, "has_more": False, "url": path}
        if (method, path) == ("GET", "/_fake/totals"):
            return 200, dict(self.totals)
        return 404, _error(f"Unrecognized request URL ({method}: {path})")

    def _meter_event(
        self, form: dict[str, str], idempotency_key: str | None
    ) -> tuple[int, dict[str, Any]] | None:
        if self._hold():
            self.release.wait(timeout=120)
            return None
        with self.lock:
            self.meter_event_requests += 1
            fault = self.faults.next()
            if fault is not None:
                self.injected[fault] += 1
            if fault == "429":  # shed before the idempotency layer: nothing saved
                return 429, _error("Too many concurrent requests", "rate_limit")
            if idempotency_key is not None and idempotency_key in self.saved:
                status, body = self.saved[idempotency_key]
                return status, json.loads(body)
            if fault == "500":
                result = 500, _error("An unknown error occurred", "api_error")
            elif fault == "400":
                result = 400, _error("Invalid request (injected)")
            elif fault == "hang":
                result = None
            else:
                result = self._record_event(form)
            if result is not None and idempotency_key is not None and result[0] != 400:
                # Like Stripe's v1 API: even a 500 is saved and replayed for this key, but
                # not a request that failed validation.
                self.saved[idempotency_key] = (result[0], json.dumps(result[1]).encode())
            if fault != "hang":
                return None if fault == "drop_after_commit" else result
        time.sleep(self.hang_s)  # past the client's timeout; nothing recorded
        return None

    def _hold(self) -> bool:
        with self.lock:
            if self.hold_after is None or self.release.is_set():
                return False
            if len(self.events) < self.hold_after:
                return False
            self.held += 1
            return True

    def _record_event(self, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        identifier = form.get("identifier") or f"auto_{next(self._ids)}"
        customer = form.get("payload[stripe_customer_id]")
        raw_value = form.get("payload[value]", "")
        if not form.get("event_name") or customer is None or not raw_value.isdigit():
            return 400, _error("event_name, payload[stripe_customer_id] and a whole value")
        if identifier in self.events:
            message = f"An event already exists with identifier {identifier}."
            return 400, _error(message, "invalid_request_error")
        event = {
            "object": "billing.meter_event",
            "event_name": form["event_name"],
            "identifier": identifier,
            "payload": {"stripe_customer_id": customer, "value": raw_value},
            "timestamp": int(form.get("timestamp") or time.time()),
            "created": int(time.time()),
            "livemode": False,
        }
        self.events[identifier] = event
        self.totals[customer] += int(raw_value)
        return 200, event


def _nested(form: Mapping[str, str], name: str) -> dict[str, str]:
    prefix = name + "["
    return {k[len(prefix) : -1]: v for k, v in form.items() if k.startswith(prefix)}


def _error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


def _handler(fake: FakeStripe) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the SDK reuses its connection
        disable_nagle_algorithm = True  # headers and body go out at once, no 40 ms stall

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode() if length else ""
            path = urlsplit(self.path).path
            if path == "/_fake/faults":
                spec = json.loads(raw or "{}")
                fake.program(spec.get("script", ()), spec.get("rates"))
                self._send(200, {"ok": True})
                return
            form = dict(parse_qsl(raw or urlsplit(self.path).query, keep_blank_values=True))
            result = fake.handle(method, path, form, self.headers.get("Idempotency-Key"))
            if result is None:
                self.close_connection = True  # no response at all: the client sees a drop
                return
            self._send(*result)

        def _send(self, status: int, body: Mapping[str, Any]) -> None:
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Request-Id", f"req_fake_{next(fake._ids)}")
            if status == 400 and "already exists" in json.dumps(body):
                self.send_header("Stripe-Should-Retry", "false")
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: thousands of requests per test

    return Handler
