"""Pure parts of billing: backoff bounds, meter identifiers, money formatting, itl."""

from __future__ import annotations

import uuid

import pytest

from gateway.core.usage import RequestUsage
from gateway.settings import Settings, SettingsError
from tenants.billing.reports import format_micros
from tenants.billing.stripe_meters import Retry, event_identifier


def test_backoff_is_jittered_within_an_exponential_cap() -> None:
    retry = Retry(attempts=6, base_s=0.2, cap_s=1.0)
    for attempt, ceiling in enumerate([0.2, 0.4, 0.8, 1.0, 1.0]):
        delays = [retry.delay_s(attempt) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling / 2  # spread out, not a fixed wait
        assert len(set(delays)) > 100


def test_meter_identifiers_are_deterministic_and_fit_stripe() -> None:
    row_id = str(uuid.uuid4())
    assert event_identifier(row_id) == event_identifier(row_id) == f"tg-usage-{row_id}"
    assert len(event_identifier(row_id)) <= 100


def test_money_is_formatted_from_integers() -> None:
    assert format_micros(0) == "0.000000"
    assert format_micros(1) == "0.000001"
    assert format_micros(12_345_678_901) == "12345.678901"
    assert format_micros(-2_500_000) == "-2.500000"


def test_inter_token_latency_is_the_mean_gap_after_the_first_token() -> None:
    outcome = RequestUsage(ttft_ms=100.0, last_token_ms=190.0, stream_tokens=10)
    assert outcome.itl_ms == 10.0
    assert RequestUsage(ttft_ms=100.0, last_token_ms=100.0, stream_tokens=1).itl_ms is None
    assert RequestUsage().itl_ms is None


def test_billing_settings_from_the_environment() -> None:
    defaults = Settings.from_env({})
    assert defaults.stripe_api_key is None  # ledger only
    assert (defaults.export_interval_s, defaults.celery_queue) == (30, "tollgate")
    settings = Settings.from_env(
        {
            "TOLLGATE_STRIPE_API_KEY": " sk_test_x ",
            "TOLLGATE_STRIPE_BASE_URL": "http://127.0.0.1:12111/",
            "TOLLGATE_STRIPE_TIMEOUT_S": "3",
            "TOLLGATE_STRIPE_RETRY_BASE_MS": "50",
            "TOLLGATE_EXPORT_INTERVAL_S": "5",
            "TOLLGATE_CELERY_QUEUE": "billing",
        }
    )
    assert settings.stripe_api_key == "sk_test_x"
    assert settings.stripe_base_url == "http://127.0.0.1:12111"
    assert (settings.stripe_timeout_s, settings.stripe_retry_base_ms) == (3.0, 50)
    assert (settings.export_interval_s, settings.celery_queue) == (5, "billing")
    with pytest.raises(SettingsError, match="TOLLGATE_EXPORT_INTERVAL_S"):
        Settings.from_env({"TOLLGATE_EXPORT_INTERVAL_S": "0"})
