"""The online step-cost fit: what it learns from steps, how it follows a machine that
changes, how the scheduler inverts it, and the warm-up shapes that make it never blind."""

from __future__ import annotations

import random

import pytest

from backend.engine.step_cost import StepCostModel, StepShape, warm_up_shapes

# A machine: 3 ms per step, 0.5 ms per prefill token, 1 ms per decode row, 2 ms per
# thousand keys a decode row reads and 0.1 ms per thousand pairs a prefill attends (a
# decode row's keys cost 20x a chunk's pairs, as on this project's CPU).
TRUE = (3e-3, 5e-4, 1e-3, 2e-6, 1e-7)


def true_time(shape: StepShape, scale: float = 1.0) -> float:
    overhead, per_token, per_row, per_key, per_pair = TRUE
    return scale * (
        overhead
        + per_token * shape.prefill_tokens
        + per_row * shape.decode_rows
        + per_key * shape.decode_context
        + per_pair * shape.prefill_pairs
    )


def random_shapes(seed: int, count: int) -> list[StepShape]:
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        chunks = [(rng.randrange(0, 1500), 1) for _ in range(rng.randrange(0, 40))]
        if rng.random() < 0.7:
            chunks.append((rng.randrange(0, 4000), rng.randrange(2, 1024)))
        shapes.append(StepShape.of_chunks(chunks or [(0, 2)]))
    return shapes


def test_the_fit_recovers_the_terms_of_a_linear_machine() -> None:
    model = StepCostModel()
    for shape in random_shapes(0, 200):
        model.observe(shape, true_time(shape))
    terms = model.coefficients
    for name, expected in zip(terms, TRUE, strict=True):
        assert terms[name] == pytest.approx(expected, rel=0.02), name
    for shape in random_shapes(1, 50):
        assert model.predict(shape) == pytest.approx(true_time(shape), rel=0.02)


def test_the_fit_follows_a_machine_that_slows_down() -> None:
    model = StepCostModel(half_life_steps=32)
    shapes = random_shapes(2, 600)
    for shape in shapes[:300]:
        model.observe(shape, true_time(shape))
    for shape in shapes[300:]:
        model.observe(shape, true_time(shape, scale=2.0))  # other work took half the CPU
    probe = StepShape(512, 8, 8_000, 400_000)
    assert model.predict(probe) == pytest.approx(true_time(probe, scale=2.0), rel=0.05)
    assert model.relative_error < 0.1  # it caught up: recent predictions are close


def test_terms_stay_non_negative_and_one_hiccup_moves_little() -> None:
    model = StepCostModel()
    for shape in random_shapes(3, 100):
        model.observe(shape, true_time(shape))
    # Decode rows never vary here: the fit must not trade them for a negative term.
    flat = StepCostModel()
    for n in range(2, 400, 7):
        flat.observe(StepShape(n, 4, 400, n * n), 0.002 + 0.001 * n)
    assert all(v >= 0 for v in flat.coefficients.values())
    probe = StepShape(256, 4, 400, 50_000)
    before = model.predict(probe)
    model.observe(probe, 100 * before)  # a step stalled by something else
    assert model.predict(probe) < 1.5 * before
    assert model.last_actual_s == pytest.approx(100 * before)  # reported as measured


def test_the_inversion_gives_the_most_tokens_within_the_limit() -> None:
    model = StepCostModel()
    for shape in random_shapes(4, 200):
        model.observe(shape, true_time(shape))
    decode = StepShape.of_chunks([(100, 1)] * 10)
    limit = 0.080
    n = model.max_prefill_tokens(limit, decode, 0, 32, 2048)

    def predicted(tokens: int) -> float:
        return model.predict(StepShape.of_chunks([(100, 1)] * 10 + [(0, tokens)]))

    assert predicted(n) <= limit < predicted(n + 1)
    assert 100 < n < 200  # about (80 - 3 - 10 - 2) ms / 0.5 ms per token
    assert model.max_prefill_tokens(0.001, decode, 0, 32, 2048) == 32  # the floor
    assert model.max_prefill_tokens(10.0, decode, 0, 32, 2048) == 2048  # all of it
    # Deeper into a long prompt, each token attends to more: fewer fit.
    assert model.max_prefill_tokens(limit, decode, 100_000, 32, 2048) < n
    assert StepCostModel().max_prefill_tokens(limit, decode, 0, 32, 2048) == 2048  # blind


def test_warm_up_shapes_fit_any_pool_and_budget_and_show_every_term() -> None:
    for budget in (1, 16, 64, 2048, 8192):
        for capacity in (16, 20, 100, 1000, 10**6):
            shapes = warm_up_shapes(budget, capacity)
            for chunks in shapes:
                assert sum(n for _, n in chunks) <= max(budget, 1)
                assert sum(start + n for start, n in chunks) <= capacity
            model = StepCostModel()
            for chunks in shapes:
                model.observe(StepShape.of_chunks(chunks), 0.01)
            assert model.ready
    seen = [StepShape.of_chunks(c) for c in warm_up_shapes(2048, 10**6)]
    assert {s.prefill_tokens > 0 for s in seen} == {True, False}
    assert len({s.decode_rows for s in seen}) >= 3
    assert len({s.decode_context for s in seen if s.decode_rows}) >= 4
    assert any(s.prefill_pairs > s.prefill_tokens**2 for s in seen)  # a chunk past a prefix
    assert len({s.features() for s in seen}) == len(seen)


def test_decode_reads_and_chunk_attention_are_told_apart() -> None:
    """A document's chunks over long cached prefixes next to a few decode rows, steps that
    all look alike: with one shared attention term the fit would put the chunks' cheap
    pairs and the rows' expensive keys on one price and mispredict both kinds of step."""
    model = StepCostModel()
    for chunks in warm_up_shapes(2048, 10**6):
        shape = StepShape.of_chunks(chunks)
        model.observe(shape, true_time(shape))
    rng = random.Random(5)
    for _ in range(300):  # the flood: chunks of 100-200 tokens past 0-1,800 cached ones
        chunks = [(rng.randrange(0, 1800), rng.randrange(100, 200)), *[(1800, 1)] * 2]
        shape = StepShape.of_chunks(chunks)
        model.observe(shape, true_time(shape))
    long_decodes = StepShape.of_chunks([(1800, 1)] * 8)
    big_chunk = StepShape.of_chunks([(0, 1024)])
    for probe in (long_decodes, big_chunk):
        assert model.predict(probe) == pytest.approx(true_time(probe), rel=0.05)


def machine_time(chunks: list[tuple[int, int]]) -> float:
    """TRUE's machine, timed by what its attention does rather than by StepShape: a
    decode row, and a chunk of a few tokens over cached keys (a verify row, a preempted
    request's uncached tail), read their keys once (memory-bound); a longer chunk
    attends its pairs (compute-bound)."""
    overhead, per_token, per_row, per_key, per_pair = TRUE
    seconds = overhead
    for start, n in chunks:
        if n == 1:
            seconds += per_row + per_key * (start + 1)
        elif start > 0 and n <= 16:
            seconds += per_token * n + per_key * (start + n)
        else:
            seconds += per_token * n + per_pair * (n * start + n * (n + 1) // 2)
    return seconds


def test_a_backlog_of_streams_does_not_teach_the_fit_that_prompts_are_dear() -> None:
    """Issue 32: a server that ran a backlog of 32 long streams for minutes, whose only
    prefills were the few tokens a preempted stream recomputes past its cached blocks,
    predicted seconds for recomputing a 500-token request (its pair term grew 1,000-fold,
    fitted to those short chunks' key reads), so no tenant short of its share of the
    slots ever took one. A short chunk's keys are read as a decode row's are."""
    model = StepCostModel()
    rng = random.Random(7)  # up to 20% slower, as on a shared machine
    for chunks in warm_up_shapes(2048, 10**6):
        model.observe(StepShape.of_chunks(chunks), machine_time(chunks) * rng.uniform(1, 1.2))
    for step in range(6000):  # ~4 minutes of the backlog: 32 streams growing to 1,800
        context = 100 + step % 1700
        chunks = [(context, 1)] * (32 if step % 6 else 3)
        if step % 40 == 0:
            chunks.append((context + 50, 3))  # a preempted stream's uncached tail
        model.observe(StepShape.of_chunks(chunks), machine_time(chunks) * rng.uniform(1, 1.2))
    for chunks in ([(0, 542)], [(0, 1024)], [(1800, 3)], [(1800, 1)] * 32):
        truth = machine_time(chunks) * 1.1
        assert model.predict(StepShape.of_chunks(chunks)) == pytest.approx(truth, rel=0.25)
