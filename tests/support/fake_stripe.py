"""A stateful fake of the Stripe API, as strict as Stripe for what the meter export uses.

Serves on a free loopback port in a thread, through the real `stripe` SDK. Rules, each
tested in tests/integration/test_fake_stripe.py:

- every request needs the secret key (`Authorization: Bearer …`), else 401;
- a meter event needs an active meter for its `event_name` and an existing, not deleted
  customer; its `timestamp` lies within the past 35 days and at most 5 minutes ahead;
  its value is a whole number in decimal digits only;
- an `identifier` is deduplicated for 24 hours after the event was recorded, no longer
  (a resend after that is counted again: `counted` shows it);
- an Idempotency-Key's answer is saved for 24 hours once the endpoint ran, 4xx and 5xx
  included, and replayed; a reused key with other parameters or on another endpoint gets
  400 `idempotency_error`; a key whose first request is still running gets 409
  `idempotency_key_in_use`; a request failing parameter validation saves nothing;
- one concurrent meter-event call per customer per meter: another gets 429 `rate_limit`;
- lists take `limit` (1..100, default 10) and `starting_after`.

The fake has its own clock (`advance`), so tests can move past both 24-hour windows.
Faults are programmed per meter-event request (a script, seeded random rates, or a script
per identifier: chosen rows) and per customer creation: 429, 500, 400, a hang past the
client's timeout, "recorded, then the connection dropped" (`drop_after_commit`) and
"recorded, then a 500" (`commit_then_500`).
"""

from __future__ import annotations

import hashlib
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

FAULTS = ("429", "500", "400", "hang", "drop_after_commit", "commit_then_500")
API_KEY = "sk_test_fake"
DAY_S = 86_400.0
IDENTIFIER_WINDOW_S = DAY_S
KEY_WINDOW_S = DAY_S
PAST_S = 35 * DAY_S
FUTURE_S = 300.0

Answer = tuple[int, dict[str, Any]]


@dataclass
class Faults:
    script: list[str] = field(default_factory=list)  # applied to the next requests, in order
    rates: dict[str, float] = field(default_factory=dict)  # fault -> probability per request
    rows: dict[str, list[str]] = field(default_factory=dict)  # identifier -> its own script
    customers: list[str] = field(default_factory=list)  # the next customer creations
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    def next(self, identifier: str) -> str | None:
        chosen = self.rows.get(identifier)
        if chosen:
            return chosen.pop(0)
        if self.script:
            return self.script.pop(0)
        draw = self.rng.random()
        for fault, rate in self.rates.items():
            if draw < rate:
                return fault
            draw -= rate
        return None


@dataclass
class Saved:
    endpoint: str
    fingerprint: str
    at: float
    answer: Answer | None = None  # None: the first request is still running


class FakeStripe:
    def __init__(self, hang_s: float = 1.0, api_key: str = API_KEY) -> None:
        self.hang_s = hang_s
        self.api_key = api_key
        self.lock = threading.Lock()
        self.offset_s = 0.0  # the fake clock: real time plus this
        self.customers: dict[str, dict[str, Any]] = {}
        self.meters: dict[str, dict[str, Any]] = {}
        self.events: dict[str, dict[str, Any]] = {}  # identifier -> its latest event
        self.recorded_at: dict[str, float] = {}  # identifier -> when (fake clock) recorded
        self.counted: Counter[str] = Counter()  # identifier -> times counted (1 = right)
        self.totals: Counter[str] = Counter()  # customer -> summed value
        self.saved: dict[str, Saved] = {}  # idempotency key -> its first request
        self.busy_customers: set[tuple[str, str]] = set()  # (customer, event name) in flight
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

    def now(self) -> float:
        return time.time() + self.offset_s

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.offset_s += seconds

    def program(
        self,
        script: Iterable[str] = (),
        rates: Mapping[str, float] | None = None,
        rows: Mapping[str, Iterable[str]] | None = None,
        customers: Iterable[str] = (),
    ) -> None:
        with self.lock:
            self.faults.script = list(script)
            self.faults.rates = dict(rates or {})
            self.faults.rows = {k: list(v) for k, v in (rows or {}).items()}
            self.faults.customers = list(customers)

    def hold_at(self, recorded: int) -> None:
        """Hold meter-event requests once `recorded` identifiers are in (see hold_after)."""
        with self.lock:
            self.release = threading.Event()
            self.hold_after = recorded
            self.held = 0

    def customer_totals(self) -> dict[str, int]:
        with self.lock:
            return dict(self.totals)

    def accepted(self) -> int:
        """Identifiers recorded at least once."""
        with self.lock:
            return len(self.counted)

    def doubled(self) -> dict[str, int]:
        """Identifiers counted more than once: a double count."""
        with self.lock:
            return {k: n for k, n in self.counted.items() if n > 1}

    def add_meter(self, event_name: str, status: str = "active") -> dict[str, Any]:
        with self.lock:
            meter = self._new_meter({"event_name": event_name, "display_name": event_name})
            meter["status"] = status
            return meter

    def add_customer(self, deleted: bool = False) -> str:
        with self.lock:
            customer = self._new_customer({"name": "existing"})
            customer["deleted"] = deleted
            return str(customer["id"])

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
            self.release.set()
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

    # The API: each returns (status, body), or None to drop the connection unanswered.

    def handle(
        self,
        method: str,
        path: str,
        form: dict[str, str],
        headers: Mapping[str, str],
    ) -> Answer | None:
        if headers.get("Authorization") != f"Bearer {self.api_key}":
            return 401, _error("Invalid API Key provided", "invalid_request_error")
        key = headers.get("Idempotency-Key") if method in ("POST", "DELETE") else None
        endpoint = f"{method} {path}"
        fingerprint = hashlib.sha256(json.dumps(sorted(form.items())).encode()).hexdigest()
        with self.lock:
            if key is not None:
                replay = self._replay(key, endpoint, fingerprint)
                if replay is not None:
                    return replay
        if endpoint == "POST /v1/billing/meter_events":
            return self._meter_event(form, key, endpoint, fingerprint)
        with self.lock:
            if endpoint == "POST /v1/customers" and self.faults.customers:
                fault = self.faults.customers.pop(0)
                self.injected[f"customer:{fault}"] += 1
                if fault == "429":
                    return 429, _error("Too many requests", "invalid_request_error", "rate_limit")
                if fault == "hang":
                    return None  # nothing created
                answer: Answer = (500, _error("An unknown error occurred", "api_error"))
                if fault == "400":
                    answer = (400, _error("Invalid request (injected)"))
                self._save(key, endpoint, fingerprint, answer)
                return answer
            answer = self._route(method, path, form)
            if "validation" not in answer[1].get("error", {}):
                self._save(key, endpoint, fingerprint, answer)
            return answer

    def _replay(self, key: str, endpoint: str, fingerprint: str) -> Answer | None:
        saved = self.saved.get(key)
        if saved is not None and self.now() - saved.at >= KEY_WINDOW_S:
            del self.saved[key]  # pruned: the key starts afresh
            saved = None
        if saved is None:
            return None
        if (saved.endpoint, saved.fingerprint) != (endpoint, fingerprint):
            message = (
                "Keys for idempotent requests can only be used with the same parameters "
                "they were first used with."
            )
            return 400, _error(message, "idempotency_error")
        if saved.answer is None:
            message = "There is currently another in-progress request using this key."
            return 409, _error(message, "invalid_request_error", "idempotency_key_in_use")
        return saved.answer[0], json.loads(json.dumps(saved.answer[1]))

    def _save(self, key: str | None, endpoint: str, fingerprint: str, answer: Answer) -> None:
        if key is not None:
            self.saved[key] = Saved(endpoint, fingerprint, self.now(), answer)

    def _route(self, method: str, path: str, form: dict[str, str]) -> Answer:
        parts = path.strip("/").split("/")
        if (method, path) == ("POST", "/v1/customers"):
            return 200, self._new_customer(form)
        if method == "DELETE" and parts[:2] == ["v1", "customers"] and len(parts) == 3:
            customer = self.customers.get(parts[2])
            if customer is None or customer.get("deleted"):
                return 404, _error(f"No such customer: '{parts[2]}'", code="resource_missing")
            customer["deleted"] = True
            return 200, {"id": parts[2], "object": "customer", "deleted": True}
        if (method, path) == ("POST", "/v1/billing/meters"):
            return self._create_meter(form)
        if method == "POST" and parts[:3] == ["v1", "billing", "meters"] and len(parts) == 5:
            return self._set_meter_status(parts[3], parts[4])
        if (method, path) == ("GET", "/v1/billing/meters"):
            meters = list(self.meters.values())
            if form.get("status"):
                meters = [m for m in meters if m["status"] == form["status"]]
            return _page(meters, form, path)
        if (method, path) == ("GET", "/v1/customers"):
            return _page([c for c in self.customers.values() if not c["deleted"]], form, path)
        return 404, _error(f"Unrecognized request URL ({method}: {path})")

    def _new_customer(self, form: Mapping[str, str]) -> dict[str, Any]:
        customer: dict[str, Any] = {
            "id": f"cus_{next(self._ids)}",
            "object": "customer",
            "name": form.get("name"),
            "metadata": _nested(form, "metadata"),
            "deleted": False,
        }
        self.customers[customer["id"]] = customer
        return customer

    def _new_meter(self, form: Mapping[str, str]) -> dict[str, Any]:
        meter: dict[str, Any] = {
            "id": f"mtr_{next(self._ids)}",
            "object": "billing.meter",
            "display_name": form.get("display_name"),
            "event_name": form.get("event_name"),
            "status": "active",
            "default_aggregation": {"formula": form.get("default_aggregation[formula]", "sum")},
        }
        self.meters[meter["id"]] = meter
        return meter

    def _create_meter(self, form: Mapping[str, str]) -> Answer:
        name = form.get("event_name") or ""
        if not name or len(name) > 100 or not form.get("display_name"):
            return 400, _validation("display_name and an event_name of 1-100 characters")
        if any(m["event_name"] == name for m in self.meters.values()):
            return 400, _error(f"A meter with event_name {name!r} already exists.")
        return 200, self._new_meter(form)

    def _set_meter_status(self, meter_id: str, action: str) -> Answer:
        meter = self.meters.get(meter_id)
        if meter is None or action not in ("deactivate", "reactivate"):
            return 404, _error(f"No such billing meter: '{meter_id}'", code="resource_missing")
        meter["status"] = "inactive" if action == "deactivate" else "active"
        return 200, meter

    def _meter_event(
        self, form: dict[str, str], key: str | None, endpoint: str, fingerprint: str
    ) -> Answer | None:
        if self._hold():
            self.release.wait(timeout=120)
            return None
        identifier = form.get("identifier") or f"auto_{next(self._ids)}"
        with self.lock:
            self.meter_event_requests += 1
            fault = self.faults.next(identifier)
            if fault is not None:
                self.injected[fault] += 1
            if fault == "429":  # shed before the idempotency layer: nothing saved
                return 429, _error("Too many requests", "invalid_request_error", "rate_limit")
            invalid = _invalid_event(form)
            if invalid is not None:
                return 400, _validation(invalid)  # validation: nothing saved
            busy = (form["payload[stripe_customer_id]"], form["event_name"])
            if busy in self.busy_customers:
                message = "Too many concurrent requests for this customer and meter."
                return 429, _error(message, "invalid_request_error", "rate_limit")
            if key is not None:
                self.saved[key] = Saved(endpoint, fingerprint, self.now())  # in progress
            self.busy_customers.add(busy)
        answer: Answer | None
        try:
            if fault == "hang":
                time.sleep(self.hang_s)  # past the client's timeout; nothing recorded
                answer = None
            else:
                with self.lock:
                    answer = self._execute_event(form, identifier, fault)
        finally:
            with self.lock:
                self.busy_customers.discard(busy)
                if key is not None:
                    if answer is None:
                        self.saved.pop(key, None)  # never finished: nothing to replay
                    else:
                        self.saved[key].answer = answer
        return None if fault in ("hang", "drop_after_commit") else answer

    def _execute_event(self, form: dict[str, str], identifier: str, fault: str | None) -> Answer:
        if fault == "500":
            return 500, _error("An unknown error occurred", "api_error")
        if fault == "400":
            return 400, _error("Invalid request (injected)")
        answer = self._record_event(form, identifier)
        if fault == "commit_then_500" and answer[0] == 200:
            return 500, _error("An unknown error occurred", "api_error")
        return answer

    def _record_event(self, form: dict[str, str], identifier: str) -> Answer:
        now = self.now()
        name, customer = form["event_name"], form["payload[stripe_customer_id]"]
        meters = self.meters.values()
        if not any(m["event_name"] == name and m["status"] == "active" for m in meters):
            return 400, _error(f"No active meter was found for event_name {name!r}.")
        found = self.customers.get(customer)
        if found is None or found["deleted"]:
            return 400, _error(f"No such customer: '{customer}'", code="resource_missing")
        timestamp = int(form.get("timestamp") or now)
        if not now - PAST_S <= timestamp <= now + FUTURE_S:
            message = "Timestamp must be within the past 35 days and at most 5 minutes ahead."
            return 400, _error(message, code="timestamp_out_of_range")
        recorded = self.recorded_at.get(identifier)
        if recorded is not None and now - recorded < IDENTIFIER_WINDOW_S:
            message = f"An event already exists with identifier {identifier}."
            return 400, _error(message, code="duplicate_meter_event")
        event = {
            "object": "billing.meter_event",
            "event_name": name,
            "identifier": identifier,
            "payload": {"stripe_customer_id": customer, "value": form["payload[value]"]},
            "timestamp": timestamp,
            "created": int(now),
            "livemode": False,
        }
        self.events[identifier] = event
        self.recorded_at[identifier] = now
        self.counted[identifier] += 1
        self.totals[customer] += int(form["payload[value]"])
        return 200, event

    def _hold(self) -> bool:
        with self.lock:
            if self.hold_after is None or self.release.is_set():
                return False
            if len(self.counted) < self.hold_after:
                return False
            self.held += 1
            return True


def _invalid_event(form: Mapping[str, str]) -> str | None:
    """Parameter validation, before the endpoint runs."""
    value = form.get("payload[value]", "")
    if not form.get("event_name") or not form.get("payload[stripe_customer_id]"):
        return "event_name and payload[stripe_customer_id] are required"
    if not (value.isascii() and value.isdigit()):
        return f"payload[value] must be a whole number in decimal digits, not {value!r}"
    identifier = form.get("identifier", "")
    if len(identifier) > 100:
        return "identifier must be at most 100 characters"
    timestamp = form.get("timestamp", "0")
    if not (timestamp.isascii() and timestamp.isdigit()):
        return "timestamp must be an integer"
    return None


def _page(items: list[dict[str, Any]], form: Mapping[str, str], path: str) -> Answer:
    raw = form.get("limit", "10")
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        return 400, _validation("limit must be an integer between 1 and 100")
    after = form.get("starting_after")
    ids = [item["id"] for item in items]
    if after is not None and after not in ids:
        return 400, _validation(f"starting_after: no such object {after!r}")
    start = ids.index(after) + 1 if after is not None else 0
    data = items[start : start + int(raw)]
    has_more = start + int(raw) < len(items)
    return 200, {"object": "list", "data": data, "has_more": has_more, "url": path}


def _nested(form: Mapping[str, str], name: str) -> dict[str, str]:
    prefix = name + "["
    return {k[len(prefix) : -1]: v for k, v in form.items() if k.startswith(prefix)}


def _error(
    message: str, kind: str = "invalid_request_error", code: str | None = None
) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": kind}
    if code is not None:
        error["code"] = code
    return {"error": error}


def _validation(message: str) -> dict[str, Any]:
    body = _error(message, code="parameter_invalid")
    body["error"]["validation"] = True  # the fake's own mark: such an answer is not saved
    return body


def _handler(fake: FakeStripe) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the SDK reuses its connection
        disable_nagle_algorithm = True  # headers and body go out at once, no 40 ms stall

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode() if length else ""
            path = urlsplit(self.path).path
            form = dict(parse_qsl(raw or urlsplit(self.path).query, keep_blank_values=True))
            headers = {name.title(): value for name, value in self.headers.items()}
            result = fake.handle(method, path, form, headers)
            if result is None:
                self.close_connection = True  # no response at all: the client sees a drop
                return
            self._send(*result)

        def _send(self, status: int, body: Mapping[str, Any]) -> None:
            error = body.get("error") or {}
            if isinstance(error, dict) and error.pop("validation", None):
                body = {"error": error}
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Request-Id", f"req_fake_{next(fake._ids)}")
            if status == 400 and error.get("code") == "duplicate_meter_event":
                self.send_header("Stripe-Should-Retry", "false")
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: thousands of requests per test

    return Handler
