"""Choosing a target in a pool: prefix affinity by weighted rendezvous hashing, unless the
preferred target is clearly busier for its weight."""

from __future__ import annotations

from collections import Counter

from gateway.dispatch.routing import AFFINITY_SLACK, Replica, affinity_key, pick

KEYS = [affinity_key("tenant", [i, 7, 7]) for i in range(4000)]


def _shares(replicas: list[Replica]) -> dict[str, float]:
    chosen = Counter(r.url for key in KEYS if (r := pick(replicas, key)) is not None)
    return {url: count / len(KEYS) for url, count in chosen.items()}


def test_weights_set_each_targets_share_of_the_keys() -> None:
    shares = _shares([Replica("http://a", weight=3), Replica("http://b", weight=1)])
    assert 0.70 <= shares["http://a"] <= 0.80

    even = _shares([Replica("http://a"), Replica("http://b")])
    assert 0.45 <= even["http://a"] <= 0.55


def test_only_the_keys_of_a_removed_target_move() -> None:
    pool = [Replica("http://a"), Replica("http://b", weight=2), Replica("http://c")]
    before = {key: pick(pool, key) for key in KEYS}
    after = {key: pick(pool, key, exclude={"http://c"}) for key in KEYS}
    moved = [key for key in KEYS if before[key] is not after[key]]
    assert moved and all(before[key] is pool[2] for key in moved)


def test_a_busier_target_loses_its_keys_beyond_the_slack_for_its_weight() -> None:
    a, b = Replica("http://a"), Replica("http://b")
    key = next(k for k in KEYS if pick([a, b], k) is a)
    a.waiting = int(AFFINITY_SLACK)
    assert pick([a, b], key) is a  # within the slack: the cached prefix wins
    a.waiting += 1
    assert pick([a, b], key) is b
    a.weight = 2  # twice the capacity: the same queue is half the pressure
    assert pick([a, b], key) is a


def test_unhealthy_and_excluded_targets_are_never_picked() -> None:
    a, b = Replica("http://a", healthy=False), Replica("http://b")
    assert all(pick([a, b], key) is b for key in KEYS[:50])
    assert pick([a, b], KEYS[0], exclude={"http://b"}) is None


def test_an_adapters_requests_go_where_it_is_loaded_unless_that_is_too_busy() -> None:
    a, b, c = Replica("http://a"), Replica("http://b"), Replica("http://c")
    pool = [a, b, c]
    b.adapters = frozenset({"ft"})
    assert all(pick(pool, key, adapter="ft") is b for key in KEYS[:200])
    # Nowhere loaded: one home for the adapter, whatever the prompt (it loads there once).
    homes = {_url(pick(pool, key, adapter="elsewhere")) for key in KEYS[:200]}
    assert len(homes) == 1
    # The holder too busy: any replica, by the prompt's affinity.
    b.waiting = int(AFFINITY_SLACK) + 1
    spread = {_url(pick(pool, key, adapter="ft")) for key in KEYS[:200]}
    assert spread == {"http://a", "http://c"}
    assert pick(pool, KEYS[0], exclude={"http://a", "http://c"}, adapter="ft") is b


def _url(replica: Replica | None) -> str | None:
    return None if replica is None else replica.url
