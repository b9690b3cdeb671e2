"""A batch line's engine class (gateway.batches.execute.batch_priority): below every
interactive class, one class closer to the batch floor per aging interval as the window
closes, at the floor exactly at the deadline; and, aged by the engine while it waits,
never in an interactive class before its deadline."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import cast

import pytest

from backend import EngineConfig
from backend.engine.policy import Ranking
from backend.engine.request import Request
from gateway.batches.execute import batch_priority

DAY_S = 24 * 3600.0


@pytest.mark.parametrize(
    "config",
    [EngineConfig(), EngineConfig(aging_interval_s=2.0, batch_priority=9)],
    ids=["defaults", "aging-2s-floor-9"],
)
def test_a_line_ages_one_class_an_interval_to_the_floor_at_its_deadline(
    config: EngineConfig,
) -> None:
    aging, floor = config.aging_interval_s, config.batch_priority
    assert aging is not None
    assert batch_priority(config, 0.0) == floor  # the deadline: the floor, exactly
    assert batch_priority(config, -30.0) == floor  # past it: never above the floor
    for intervals in range(1, 50):
        left = intervals * aging
        assert batch_priority(config, left) == floor + intervals
        # Anywhere in the interval before: one class more, never the next class down.
        assert batch_priority(config, left - aging / 2) == floor + intervals
        assert batch_priority(config, left + aging / 2) == floor + intervals + 1
    # A whole 24-hour window: every class below the floor, one per interval.
    assert batch_priority(config, DAY_S) == floor + round(DAY_S / aging)
    assert all(batch_priority(config, s) > floor for s in (0.001, 1.0, DAY_S))


def test_without_engine_aging_lines_rank_as_if_aged_every_five_seconds() -> None:
    config = EngineConfig(aging_interval_s=None)
    assert batch_priority(config, 0.0) == config.batch_priority
    assert batch_priority(config, 12.0) == config.batch_priority + 3  # ceil(12 / 5)


@pytest.mark.parametrize("left_s", [0.5, 5.0, 7.5, 60.0, 3600.0, 3601.0, DAY_S])
def test_aged_by_the_engine_a_line_stays_a_batch_line_until_its_deadline(left_s: float) -> None:
    """Started `left_s` before its deadline and waiting in the engine from then on (the
    engine raises it a class per interval): in the batch class, never an interactive
    one, until the deadline, and at the floor within an interval of it (at the
    deadline itself when `left_s` is a whole number of intervals)."""
    config = EngineConfig()
    aging, floor = config.aging_interval_s, config.batch_priority
    assert aging is not None
    ranking = Ranking(aging)
    line = cast(Request, SimpleNamespace(priority=batch_priority(config, left_s), arrival_time=0.0))
    waits = [left_s * i / 400 for i in range(401)]
    assert all(ranking.effective(line, now=w) >= floor for w in waits)
    at_floor = aging * math.ceil(left_s / aging)  # the first moment it is at the floor
    assert left_s <= at_floor < left_s + aging
    assert ranking.effective(line, now=at_floor) == floor
    assert ranking.effective(line, now=at_floor - aging / 100) == floor + 1
