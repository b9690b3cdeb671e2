"""The fake Stripe is as strict as Stripe: one test per rule, through the real `stripe` SDK
(so the SDK's view of each answer is what the relay sees)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import stripe

from tests.conftest import eventually
from tests.support.fake_stripe import API_KEY, DAY_S, FakeStripe

EVENT = "fake_rules_usage"
START = time.time()  # one timestamp for every event: a retry's parameters stay the same


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    with FakeStripe(hang_s=3.0).serving() as server:
        yield server


def client(fake: FakeStripe, key: str = API_KEY, timeout_s: float = 5.0) -> stripe.StripeClient:
    return stripe.StripeClient(
        key,
        base_addresses={"api": fake.url},
        max_network_retries=0,
        http_client=stripe.RequestsClient(timeout=timeout_s),
    )


@pytest.fixture
def customer(fake: FakeStripe) -> str:
    fake.add_meter(EVENT)
    return fake.add_customer()


def send(
    api: stripe.StripeClient,
    customer: str,
    identifier: str,
    value: str = "5",
    key: str | None = None,
    timestamp: float | None = None,
    event_name: str = EVENT,
) -> Any:
    params: dict[str, Any] = {
        "event_name": event_name,
        "identifier": identifier,
        "payload": {"stripe_customer_id": customer, "value": value},
        "timestamp": int(START if timestamp is None else timestamp),
    }
    options: dict[str, Any] = {"idempotency_key": key} if key else {}
    return api.v1.billing.meter_events.create(params, options)  # type: ignore[arg-type]


def error_code(exc: stripe.StripeError) -> str | None:
    body: Any = exc.json_body or {}
    code = (body.get("error") or {}).get("code")
    return None if code is None else str(code)


def test_requests_need_the_secret_key(fake: FakeStripe, customer: str) -> None:
    with pytest.raises(stripe.AuthenticationError):
        send(client(fake, key="sk_test_wrong"), customer, "a")
    with pytest.raises(stripe.AuthenticationError):
        client(fake, key="sk_test_wrong").v1.billing.meters.list()
    assert fake.accepted() == 0
    send(client(fake), customer, "a")
    assert fake.accepted() == 1


def test_an_event_needs_an_active_meter_for_its_name(fake: FakeStripe) -> None:
    api = client(fake)
    cus = fake.add_customer()
    with pytest.raises(stripe.InvalidRequestError, match="No active meter"):
        send(api, cus, "a")
    meter = fake.add_meter(EVENT, status="inactive")
    with pytest.raises(stripe.InvalidRequestError, match="No active meter"):
        send(api, cus, "b")
    api.v1.billing.meters.reactivate(meter["id"])
    send(api, cus, "c")
    assert fake.customer_totals() == {cus: 5}


def test_an_event_needs_an_existing_customer_not_deleted(fake: FakeStripe) -> None:
    api = client(fake)
    fake.add_meter(EVENT)
    with pytest.raises(stripe.InvalidRequestError, match="No such customer"):
        send(api, "cus_nobody", "a")
    deleted = fake.add_customer()
    api.v1.customers.delete(deleted)
    with pytest.raises(stripe.InvalidRequestError, match="No such customer"):
        send(api, deleted, "b")
    assert fake.accepted() == 0


def test_the_timestamp_lies_in_the_past_35_days_or_5_minutes_ahead(
    fake: FakeStripe, customer: str
) -> None:
    api = client(fake)
    now = fake.now()
    for offset, ok in [(-36 * DAY_S, False), (-34 * DAY_S, True), (600, False), (60, True)]:
        identifier = f"t{offset}"
        if ok:
            send(api, customer, identifier, timestamp=now + offset)
        else:
            with pytest.raises(stripe.InvalidRequestError) as caught:
                send(api, customer, identifier, timestamp=now + offset)
            assert error_code(caught.value) == "timestamp_out_of_range"
    assert fake.accepted() == 2
    fake.advance(2 * DAY_S)  # the fake's clock decides, not the caller's
    with pytest.raises(stripe.InvalidRequestError):
        send(api, customer, "late", timestamp=now - 34 * DAY_S)


def test_an_identifier_is_deduplicated_for_24_hours_only(fake: FakeStripe, customer: str) -> None:
    api = client(fake)
    send(api, customer, "same")
    fake.advance(DAY_S - 60)
    with pytest.raises(stripe.InvalidRequestError, match="already exists with identifier") as e:
        send(api, customer, "same")
    assert e.value.headers and e.value.headers.get("Stripe-Should-Retry") == "false"
    fake.advance(120)  # past the window: Stripe counts it again
    send(api, customer, "same")
    assert fake.doubled() == {"same": 2}
    assert fake.customer_totals() == {customer: 10}


def test_a_reused_key_with_other_parameters_or_endpoint_is_an_idempotency_error(
    fake: FakeStripe, customer: str
) -> None:
    api = client(fake)
    send(api, customer, "a", key="K")
    with pytest.raises(stripe.IdempotencyError):
        send(api, customer, "a", value="6", key="K")
    with pytest.raises(stripe.IdempotencyError):
        api.v1.customers.create({"name": "x"}, {"idempotency_key": "K"})
    assert fake.customer_totals() == {customer: 5}


def test_a_saved_answer_is_replayed_4xx_and_5xx_included_for_24_hours(
    fake: FakeStripe, customer: str
) -> None:
    api = client(fake)
    [meter] = fake.meters.values()
    api.v1.billing.meters.deactivate(meter["id"])
    with pytest.raises(stripe.InvalidRequestError, match="No active meter"):
        send(api, customer, "a", key="K400")
    api.v1.billing.meters.reactivate(meter["id"])
    with pytest.raises(stripe.InvalidRequestError, match="No active meter"):
        send(api, customer, "a", key="K400")  # the cause is fixed, the saved 400 is not
    fake.program(script=["500"])
    with pytest.raises(stripe.APIError):
        send(api, customer, "b", key="K500")
    with pytest.raises(stripe.APIError):
        send(api, customer, "b", key="K500")  # no fault programmed now: the replay
    assert fake.accepted() == 0
    fake.advance(DAY_S + 1)  # keys pruned: each runs afresh
    send(api, customer, "a", key="K400")
    send(api, customer, "b", key="K500")
    assert fake.accepted() == 2


def test_a_request_failing_validation_saves_nothing(fake: FakeStripe, customer: str) -> None:
    api = client(fake)
    with pytest.raises(stripe.InvalidRequestError):
        send(api, customer, "a", value="1.5", key="K")
    send(api, customer, "a", value="2", key="K")  # other parameters, yet no idempotency error
    assert fake.customer_totals() == {customer: 2}


def test_a_key_whose_request_is_running_gets_409_in_use(fake: FakeStripe, customer: str) -> None:
    fake.program(script=["hang"])
    with pytest.raises(stripe.APIConnectionError):
        send(client(fake, timeout_s=0.3), customer, "a", key="K")
    with pytest.raises(stripe.APIError) as caught:  # the server is still on the first one
        send(client(fake), customer, "a", key="K")
    assert caught.value.http_status == 409
    assert error_code(caught.value) == "idempotency_key_in_use"


def test_one_concurrent_call_per_customer_per_meter(fake: FakeStripe, customer: str) -> None:
    other = fake.add_customer()
    fake.program(script=["hang"])
    with pytest.raises(stripe.APIConnectionError):
        send(client(fake, timeout_s=0.3), customer, "a")
    api = client(fake)
    with pytest.raises(stripe.RateLimitError) as caught:
        send(api, customer, "b")
    assert error_code(caught.value) == "rate_limit"
    send(api, other, "c")  # another customer is not held up
    assert fake.customer_totals() == {other: 5}


async def test_concurrent_calls_for_one_customer(fake: FakeStripe, customer: str) -> None:
    """The rule holds under real concurrency, not only after a client timeout."""
    fake.program(script=["hang"])
    slow = asyncio.create_task(asyncio.to_thread(send, client(fake), customer, "slow"))
    await eventually(lambda: fake.busy_customers)  # the fake is inside the first call
    with pytest.raises(stripe.RateLimitError):
        await asyncio.to_thread(send, client(fake), customer, "fast")
    with pytest.raises(stripe.APIConnectionError):  # the hang ends in a dropped connection
        await slow
    assert fake.accepted() == 0


def test_lists_take_a_limit_and_pages(fake: FakeStripe) -> None:
    api = client(fake)
    for index in range(5):
        fake.add_meter(f"m{index}")
    for bad in (0, 101):
        with pytest.raises(stripe.InvalidRequestError, match="limit"):
            api.v1.billing.meters.list({"limit": bad})
    page = api.v1.billing.meters.list({"limit": 2})
    assert [m.event_name for m in page.data] == ["m0", "m1"] and page.has_more
    assert len(api.v1.billing.meters.list().data) == 5  # default 10
    names = [m.event_name for m in api.v1.billing.meters.list({"limit": 2}).auto_paging_iter()]
    assert names == [f"m{i}" for i in range(5)]


@pytest.mark.parametrize("value", ["1.5", "-1", "1e3", " 1", "", "\u0661\u0662"])
def test_values_are_whole_numbers_in_decimal_digits(
    fake: FakeStripe, customer: str, value: str
) -> None:
    with pytest.raises(stripe.InvalidRequestError, match="whole number"):
        send(client(fake), customer, "a", value=value)
    send(client(fake), customer, "b", value="12")
    assert fake.customer_totals() == {customer: 12}
