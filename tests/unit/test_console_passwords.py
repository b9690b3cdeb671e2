"""Console password hashing (scrypt) and the small parsers of console forms."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from litestar.datastructures import FormMultiDict

from gateway.console.actions import budget_micros, limits_from
from gateway.console.auth import decode_flash, encode_flash
from gateway.console.ledger import effective_from, price_from
from gateway.console.queries import percentile
from gateway.console.session import safe_next
from tenants.admins import (
    OWASP_COST,
    ScryptCost,
    hash_password,
    needs_rehash,
    scrypt_cost_for_tests,
    verify_password,
)
from tenants.errors import InvalidInputError
from tenants.pricing import Price


def test_password_hash_verifies_only_the_right_password() -> None:
    stored = hash_password("correct horse battery")
    assert verify_password("correct horse battery", stored)
    assert not verify_password("correct horse batterY", stored)


def test_the_real_cost_is_owasps_minimum_and_older_hashes_still_verify() -> None:
    """N=2^17, r=8, p=1 (128 MiB); the suite runs cheaper through its test-only setting."""
    assert ScryptCost(n=2**17, r=8, p=1) == OWASP_COST
    with scrypt_cost_for_tests(OWASP_COST):
        stored = hash_password("correct horse battery")
        assert stored.startswith("scrypt$131072$8$1$")
        assert not needs_rehash(stored)
        assert verify_password("correct horse battery", stored)
        with scrypt_cost_for_tests(ScryptCost(n=2**14, r=8, p=1)):  # the cost before
            older = hash_password("correct horse battery")
        assert needs_rehash(older)
        assert verify_password("correct horse battery", older)


def test_same_password_hashes_differently_each_time() -> None:
    assert hash_password("same password!") != hash_password("same password!")


@pytest.mark.parametrize("stored", ["", "bcrypt$x", "scrypt$1$2$3$!!$??", "plain"])
def test_malformed_hashes_never_verify(stored: str) -> None:
    assert not verify_password("anything", stored)


def test_budget_is_read_in_dollars_and_blank_is_unlimited() -> None:
    assert budget_micros(FormMultiDict({"monthly_budget": "25.50"})) == 25_500_000
    assert budget_micros(FormMultiDict({"monthly_budget": " "})) is None
    with pytest.raises(InvalidInputError):
        budget_micros(FormMultiDict({"monthly_budget": "ten"}))
    for bad in ("0.0000001", "-1", "NaN", "Infinity", "1e400"):
        with pytest.raises(InvalidInputError):
            budget_micros(FormMultiDict({"monthly_budget": bad}))


def test_prices_are_read_in_dollars_per_million_tokens() -> None:
    form = FormMultiDict({"input": "0.10", "cached_input": "0.05", "output": "0.4"})
    assert price_from(form) == Price(100_000, 50_000, 400_000)
    with pytest.raises(InvalidInputError):
        price_from(FormMultiDict({"input": "x", "cached_input": "0", "output": "0"}))
    assert effective_from("2026-12-01T00:00") == datetime(2026, 12, 1, tzinfo=UTC)
    with pytest.raises(InvalidInputError):
        effective_from("next tuesday")


def test_limits_reject_negative_or_fractional_numbers() -> None:
    assert limits_from(FormMultiDict({"rpm": "60", "tpm": ""})).rpm == 60
    for bad in ("-1", "1.5", "lots", "²", "99999999999"):
        with pytest.raises(InvalidInputError):
            limits_from(FormMultiDict({"rpm": bad}))


def test_flash_round_trips_and_rejects_unknown_kinds() -> None:
    assert decode_flash(encode_flash("error", "no such plan")) == ("error", "no such plan")
    assert decode_flash(encode_flash("evil", "x")) is None
    assert decode_flash("%%%") is None


@pytest.mark.parametrize(
    ("target", "expected"),
    [("/admin/usage?x=1", "/admin/usage?x=1"), ("https://evil", "/admin"), ("//evil", "/admin")],
)
def test_next_stays_inside_the_console(target: str, expected: str) -> None:
    assert safe_next(target) == expected


def test_nearest_rank_percentile() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 95)) == (50.0, 95.0)
    assert percentile([], 50) is None
