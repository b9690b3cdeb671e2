from __future__ import annotations

from tenants import keys
from tenants.pricing import Price


def test_generated_key_has_visible_prefix_and_verifies() -> None:
    secret, prefix = keys.generate_key()
    assert secret.startswith(prefix + "_")
    assert keys.key_prefix(secret) == prefix
    assert keys.matches(secret, keys.hash_key(secret))
    assert not keys.matches(secret + "x", keys.hash_key(secret))
    assert secret not in keys.hash_key(secret)


def test_keys_are_unique() -> None:
    assert len({keys.generate_key()[0] for _ in range(200)}) == 200


def test_malformed_keys_have_no_prefix() -> None:
    secret, _ = keys.generate_key()
    for bad in ["", "sk-abc", "tg-short_" + "x" * 40, secret.split("_")[0], "tg-ABCDEFGH_short"]:
        assert keys.key_prefix(bad) is None


def test_cost_is_integer_and_rounds_up() -> None:
    price = Price(
        input_micros_per_mtok=100_000,
        cached_input_micros_per_mtok=50_000,
        output_micros_per_mtok=400_000,
    )
    # 1M uncached input = 100_000 micros; output counts 4x.
    assert price.cost_micros(1_000_000, 0, 0) == 100_000
    assert price.cost_micros(1_000_000, 1_000_000, 0) == 50_000
    assert price.cost_micros(0, 0, 1_000_000) == 400_000
    assert price.cost_micros(1, 0, 0) == 1  # a fraction of a micro-unit is charged as one
    assert price.cost_micros(0, 0, 0) == 0
