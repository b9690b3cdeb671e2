"""Speculative decoding: greedy tokens identical with and without drafts, the sampled
distribution preserved by rejection sampling (chi-square), rollback of rejected slots
under preemption and prefix caching, the adaptive pause, and the metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import speculative
from backend.engine.batch import ScheduledRequest, SchedulerOutput
from backend.engine.block_manager import BlockManager
from backend.engine.engine import Engine
from backend.engine.request import Request, fan_out
from backend.engine.speculative import MIN_ACCEPTANCE, SpecState, Speculator, ngram_drafts
from backend.engine.step_cost import StepCostModel
from backend.errors import CheckpointError
from backend.layers.rejection import greedy_verify, rejection_sample
from backend.requests import EngineRequest
from backend.sampling import SamplingParams
from tests.engine.engine_support import (
    build_checkpoint,
    make_engine,
    run_to_completion,
    tokens_of,
)
from tests.engine.test_engine_oracle import oracle_prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BASE = {"block_size": 16, "num_kv_blocks": 512, "max_model_len": 1024}


def chi2_critical(df: int) -> float:
    """The chi-square quantile at 0.999 (Wilson-Hilferty: within 3% at df 1, closer above): a
    correct sampler fails one run in a thousand, and these runs are seeded, so never."""
    z, h = 3.0902, 2 / (9 * df)
    return float(df * (1 - h + z * h**0.5) ** 3)


def chi_square(counts: Counter[int], probs: list[float], draws: int) -> tuple[float, int]:
    """The statistic over the categories of positive probability, and its degrees of
    freedom; a draw of a zero-probability category is an outright failure."""
    assert all(probs[t] > 0 for t in counts), f"drew a token of probability 0: {counts}"
    cells = [t for t, p in enumerate(probs) if p > 0]
    stat = sum((counts[t] - draws * probs[t]) ** 2 / (draws * probs[t]) for t in cells)
    return stat, len(cells) - 1


def spec_engine(path: Path, **overrides: object) -> Engine:
    """An engine that runs every draft proposed (the step-cost weighing would make which
    ones run depend on this machine's timings)."""
    engine = make_engine(path, **overrides)
    engine.scheduler.weigh_drafts = False
    return engine


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(prompt, params, str(i)))
    return {k: tokens_of(v) for k, v in run_to_completion(engine).items()}


def echo_proposer(reference: dict[str, list[int]], wrong_every: int = 0) -> object:
    """Drafts that are the reference continuation (every `wrong_every`-th one changed):
    every draft accepted, or a rejection at a known place."""

    def propose(req: Request, state: SpecState, k: int) -> list[int]:
        done = len(req.output_token_ids)
        drafts = reference[req.request_id][done : done + k]
        if wrong_every and drafts and done % wrong_every == 0:
            drafts[-1] = (drafts[-1] + 1) % 300
        return drafts

    return propose


# -- the accept/reject function ------------------------------------------------------


def test_one_hot_drafts_keep_the_target_distribution() -> None:
    """n-gram drafts (q one-hot): the first token out is distributed as p_1, whether the
    draft is likely, unlikely or impossible under p_1."""
    p1 = torch.tensor([0.05, 0.4, 0.25, 0.0, 0.2, 0.1])
    p2 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.2, 0.1])
    draws = 20_000
    torch.manual_seed(0)
    for draft in (1, 5, 3):  # likely, unlikely, impossible
        target = torch.stack([p1, p2]).expand(draws, 2, 6).contiguous()
        drafts = torch.full((draws, 1), draft)
        accepted, token = rejection_sample(
            target, drafts, torch.ones(draws, dtype=torch.long), None, [None] * draws
        )
        first = torch.where(accepted > 0, drafts[:, 0], token)
        stat, df = chi_square(Counter(first.tolist()), p1.tolist(), draws)
        assert stat < chi2_critical(df), (draft, stat)
        # After an accepted draft the bonus token is a draw from p_2.
        bonus = token[accepted == 1]
        if draft == 3:
            assert len(bonus) == 0
            continue
        stat, df = chi_square(Counter(bonus.tolist()), p2.tolist(), len(bonus))
        assert stat < chi2_critical(df), (draft, stat)


def test_draft_model_proposals_keep_the_target_distribution() -> None:
    """Drafts drawn from a draft model's q (Leviathan et al.): the first two tokens out are
    distributed as p_1 and p_2 (the target does not depend on context here)."""
    p = torch.tensor([[0.1, 0.5, 0.2, 0.0, 0.2], [0.25, 0.25, 0.1, 0.3, 0.1], [0.2] * 5])
    q = torch.tensor([[0.4, 0.1, 0.1, 0.3, 0.1], [0.1, 0.6, 0.1, 0.1, 0.1]])
    draws = 30_000
    gen = torch.Generator().manual_seed(1)
    drafts = torch.stack([torch.multinomial(q[j], draws, True, generator=gen) for j in (0, 1)], 1)
    torch.manual_seed(1)
    accepted, token = rejection_sample(
        p.expand(draws, 3, 5).contiguous(),
        drafts,
        torch.full((draws,), 2),
        q.expand(draws, 2, 5).contiguous(),
        [None] * draws,
    )
    first = torch.where(accepted > 0, drafts[:, 0], token)
    stat, df = chi_square(Counter(first.tolist()), p[0].tolist(), draws)
    assert stat < chi2_critical(df), stat
    went_on = accepted > 0
    second = torch.where(accepted[went_on] > 1, drafts[went_on, 1], token[went_on])
    stat, df = chi_square(Counter(second.tolist()), p[1].tolist(), len(second))
    assert stat < chi2_critical(df), stat


def test_greedy_rows_accept_exactly_the_argmax_run() -> None:
    probs = torch.zeros(3, 4, 10)
    argmax = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 9, 9]])
    probs.scatter_(-1, argmax[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 3], [5, 0, 7], [1, 0, 9]])
    accepted, token = rejection_sample(
        probs, drafts, torch.tensor([3, 3, 2]), None, [None, torch.Generator(), None]
    )
    assert accepted.tolist() == [3, 1, 0]
    assert token.tolist() == [4, 6, 0]
    accepted, token = greedy_verify(argmax, drafts, torch.tensor([3, 3, 2]))
    assert accepted.tolist() == [3, 1, 0]
    assert token.tolist() == [4, 6, 0]


def _request(request_id: str, prompt: list[int], max_len: int) -> Request:
    (req,) = fan_out(EngineRequest(prompt, GREEDY, request_id), prompt, max_len)
    return req


def test_ngram_lookup_takes_the_latest_longest_match() -> None:
    req = _request("r", [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2], 64)
    state = SpecState()
    assert ngram_drafts(req, state, 3) == [3, 7, 8]  # "1 2" last seen before 3 7 8
    req.output_token_ids += [3, 7]
    assert ngram_drafts(req, state, 2) == [8, 5]  # "2 3 7" (the index caught up)
    assert ngram_drafts(_request("s", [4, 5, 6], 9), SpecState(), 4) == []


# -- the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> tuple[list[list[int]], dict[str, list[int]]]:
    """The oracle prompts (a few long ones dropped for time) and their greedy tokens
    without speculation (test_engine_oracle checks those against transformers)."""
    engine = make_engine(llama_dir, **BASE)
    prompts = oracle_prompts(engine.model_config.vocab_size)[:14]
    return prompts, run(engine, prompts, GREEDY)


def test_greedy_tokens_equal_without_speculation_ngram(
    llama_dir: Path, reference: tuple[list[list[int]], dict[str, list[int]]]
) -> None:
    prompts, expected = reference
    # Each prompt followed by its own continuation's start: the lookup finds drafts.
    quoting = [p + expected[str(i)][:8] + p[-6:] for i, p in enumerate(prompts)]
    engine = spec_engine(llama_dir, **BASE, speculative_method="ngram")
    assert run(engine, prompts, GREEDY) == expected
    plain = run(make_engine(llama_dir, **BASE), quoting, GREEDY)
    engine = spec_engine(llama_dir, **BASE, speculative_method="ngram")
    assert run(engine, quoting, GREEDY) == plain
    assert engine.stats().spec_decode_num_drafts > 0


def test_greedy_tokens_equal_with_every_draft_accepted_or_some_rejected(
    llama_dir: Path,
    reference: tuple[list[list[int]], dict[str, list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts, expected = reference
    for wrong_every in (0, 3):
        monkeypatch.setattr(speculative, "ngram_drafts", echo_proposer(expected, wrong_every))
        engine = spec_engine(llama_dir, **BASE, speculative_method="ngram")
        assert run(engine, prompts, GREEDY) == expected
        stats = engine.stats()
        assert stats.spec_decode_num_accepted_tokens > 0
        if wrong_every == 0:
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
            assert engine.num_steps < len(prompts) * GREEDY.max_tokens / 2
        else:
            assert stats.spec_decode_acceptance_rate < 1


def test_rollback_under_preemption_and_prefix_caching(
    llama_dir: Path,
    reference: tuple[list[list[int]], dict[str, list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool too small for the batch (preemptions) with the prefix cache on, drafts
    rejected every few tokens: the same tokens, and the block accounting exact after
    every step (run_to_completion checks it)."""
    prompts, expected = reference
    monkeypatch.setattr(speculative, "ngram_drafts", echo_proposer(expected, 2))
    engine = spec_engine(
        llama_dir,
        **{**BASE, "num_kv_blocks": 40, "max_model_len": 600},
        speculative_method="ngram",
        enable_prefix_caching=True,
    )
    assert run(engine, prompts, GREEDY) == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.kv_blocks_used == 0
    # Once more on a warm prefix cache.
    again = run(engine, prompts, GREEDY)
    assert again == expected
    assert engine.stats().prefix_cache_hits > stats.prefix_cache_hits


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer, half-width draft with the same tokenizer (and unrelated weights: its
    greedy drafts are nearly always rejected)."""
    folder = tmp_path_factory.mktemp("draft") / "small"
    return build_checkpoint(folder, "llama", num_hidden_layers=1, hidden_size=32)


def test_greedy_tokens_equal_without_speculation_draft_model(
    llama_dir: Path, small_draft: Path, reference: tuple[list[list[int]], dict[str, list[int]]]
) -> None:
    """With the target itself as the draft every draft is accepted; with an unrelated
    small draft nearly none: the tokens are the same either way."""
    prompts, expected = reference
    for draft, accepted in ((llama_dir, 1.0), (small_draft, None)):
        engine = spec_engine(
            llama_dir, **BASE, speculative_method="draft", speculative_model=str(draft)
        )
        assert run(engine, prompts, GREEDY) == expected
        stats = engine.stats()
        assert stats.spec_decode_num_drafts > 0
        assert " speculative=draft k=4 min_acceptance=" in engine.describe()
        assert " draft_kv_bytes=" in engine.describe()
        if accepted is not None:
            assert stats.spec_decode_acceptance_rate == accepted
            assert engine.num_steps < len(prompts) * GREEDY.max_tokens / 2


def force_pauses(engine: Engine, steps: int) -> list[tuple[int, int]]:
    """Pause every request for `steps` steps after each of its verifications (whatever
    its acceptance), so the draft's KV lags and catches up; returns the (start, tokens)
    of every catch-up row the draft runs."""
    spec, drafter = engine.speculator, engine.runner.drafter
    assert spec is not None and drafter is not None
    observe, missing = spec.observe, drafter._missing
    rows: list[tuple[int, int]] = []

    def pausing(request_id: str, num_drafts: int, num_accepted: int) -> None:
        observe(request_id, num_drafts, num_accepted)
        state = spec.states.get(request_id)
        if state is not None:
            state.paused_until = spec.step + steps

    def recorded(r: ScheduledRequest) -> tuple[int, list[int]]:
        start, tokens = missing(r)
        rows.append((start, len(tokens)))
        return start, tokens

    spec.observe = pausing  # type: ignore[method-assign]
    drafter._missing = recorded  # type: ignore[method-assign]
    return rows


def test_draft_model_catches_up_after_pauses_exactly(
    llama_dir: Path, reference: tuple[list[list[int]], dict[str, list[int]]]
) -> None:
    """Drafting paused for 3 steps after every verification: the draft's KV lags, and
    each resumed row catches up in one pass over the missed tokens. The target as its own
    draft still has every draft accepted (the caught-up KV is the KV it would have
    computed), and the tokens are the plain engine's."""
    prompts, expected = reference
    engine = spec_engine(
        llama_dir, **BASE, speculative_method="draft", speculative_model=str(llama_dir)
    )
    rows = force_pauses(engine, 3)
    assert run(engine, prompts, GREEDY) == expected
    stats = engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_acceptance_rate == 1.0
    # Resumed rows (not a request's first catch-up, from 0) cover the paused steps' tokens.
    resumed = [n for start, n in rows if start > 0]
    assert resumed and max(resumed) >= 4


def test_draft_model_rollback_under_preemption_and_prefix_caching(
    llama_dir: Path, reference: tuple[list[list[int]], dict[str, list[int]]]
) -> None:
    """The draft's cache shares the target's block tables: preemption, prefix-cache
    hits, pauses (the draft's KV lagging) and rejected slots leave both consistent: the
    same tokens, exact accounting, and the target as its own draft accepts every draft
    (a preempted request's draft KV is recomputed from its start)."""
    prompts, expected = reference
    for pause in (0, 2):
        engine = spec_engine(
            llama_dir,
            **{**BASE, "num_kv_blocks": 48, "max_model_len": 600},
            speculative_method="draft",
            speculative_model=str(llama_dir),
        )
        if pause:
            force_pauses(engine, pause)
        assert run(engine, prompts, GREEDY) == expected
        assert engine.stats().num_preemptions > 0
        assert run(engine, prompts, GREEDY) == expected  # on a warm prefix cache
        stats = engine.stats()
        assert stats.prefix_cache_hits > 0
        assert stats.spec_decode_acceptance_rate == 1.0


def test_the_draft_recomputes_from_the_start_after_a_preemption(
    llama_dir: Path, small_draft: Path
) -> None:
    """Where the draft's KV of a row starts: where it ended (a resumed row), and from 0
    for a request it never drafted for (a prefix-cache hit holds the target's KV only)
    and after a preemption (the blocks it wrote were freed)."""
    engine = make_engine(
        llama_dir, **BASE, speculative_method="draft", speculative_model=str(small_draft)
    )
    drafter = engine.runner.drafter
    assert drafter is not None
    prompt = list(range(5, 45))
    row = ScheduledRequest(
        "r", [7, -1, -1], 48, list(range(4)), GREEDY, True, prompt, [1] * 9, None, 2
    )
    assert drafter._missing(row) == (0, [*prompt, *[1] * 8, 7])  # a hit: from 0 all the same
    drafter._done["r"] = (0, 45)
    assert drafter._missing(row) == (45, [1, 1, 1, 7])  # drafted before: the lag only
    assert drafter._missing(replace(row, num_preemptions=1)) == (0, [*prompt, *[1] * 8, 7])
    drafter.forget(["r"])
    assert drafter._missing(replace(row, start_pos=40, output_token_ids=[])) == (0, [*prompt, 7])


def test_no_draft_pass_runs_in_a_step_without_drafts(
    llama_dir: Path, small_draft: Path, reference: tuple[list[list[int]], dict[str, list[int]]]
) -> None:
    """A draft whose drafts are rarely accepted pauses: the steps where no row drafts run
    no pass of the draft model at all (its KV lags until a probe), the steps with drafts
    run a catch-up and K - 1 draft steps; the tokens are the plain engine's."""
    prompts, _ = reference
    params = replace(GREEDY, max_tokens=40)
    plain = run(make_engine(llama_dir, **BASE), prompts[:4], params)
    engine = spec_engine(
        llama_dir, **BASE, speculative_method="draft", speculative_model=str(small_draft)
    )
    drafter = engine.runner.drafter
    assert drafter is not None
    launch = engine.runner.launch
    passes: dict[bool, list[int]] = {True: [], False: []}

    def counted(batch: SchedulerOutput, *args: Any, **kwargs: Any) -> Any:
        before = drafter.passes
        launched = launch(batch, *args, **kwargs)
        if batch.requests:
            passes[any(r.num_drafts for r in batch.requests)].append(drafter.passes - before)
        return launched

    engine.runner.launch = counted  # type: ignore[method-assign]
    assert run(engine, prompts[:4], params) == plain
    assert len(passes[False]) > 2 * len(passes[True]) > 0  # mostly paused
    assert set(passes[False]) == {0}
    assert min(passes[True]) >= 1


def test_draft_model_sampling_keeps_the_distribution_end_to_end(
    llama_dir: Path, small_draft: Path
) -> None:
    """As the n-gram end-to-end test, with the small draft's q in the verification
    (never paused: every request's second token is verified)."""
    prompt = [5, 17, 42, 99, 7]
    params = SamplingParams(max_tokens=3, temperature=1.5, top_k=4, ignore_eos=True)

    def draw(**spec: object) -> Counter[tuple[int, int]]:
        engine = spec_engine(llama_dir, **BASE, max_num_seqs=64, **spec)
        if engine.speculator is not None:
            engine.speculator.min_acceptance = 0.0  # never paused
        torch.manual_seed(2)  # unseeded requests draw from torch's global generator
        for i in range(400):
            engine.add_request(EngineRequest(prompt, params, f"s{i}"))
        outs = run_to_completion(engine)
        assert (engine.stats().spec_decode_num_drafts == 400) == bool(spec)
        return Counter((tokens_of(v)[0], tokens_of(v)[1]) for v in outs.values())

    plain = draw()
    spec = draw(speculative_method="draft", speculative_model=str(small_draft))
    assert spec != plain
    stat, df = _two_sample(plain, spec)
    assert df >= 5
    assert stat < chi2_critical(df), (stat, df)


def test_a_draft_of_another_vocabulary_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    other = build_checkpoint(tmp_path / "other", "llama", vocab_size=300)
    with pytest.raises(CheckpointError, match="vocabulary"):
        spec_engine(llama_dir, **BASE, speculative_method="draft", speculative_model=str(other))


def test_trim_returns_the_slots_of_rejected_drafts() -> None:
    bm = BlockManager(8, 4)
    bm.allocate_slots("r", 5)  # two blocks
    bm.allocate_slots("r", 11)  # room for drafts: three
    assert len(bm.block_ids("r")) == 3
    bm.trim("r", 6)
    assert len(bm.block_ids("r")) == 2
    assert bm.num_free_blocks == 6
    bm.free("r")
    assert bm.num_free_blocks == 8


def test_sampled_tokens_keep_their_distribution_end_to_end(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second token of a sampled request (the first one verified against a draft),
    over 400 requests, with and without speculation: the same distribution (a two-sample
    chi-square over the tokens both runs drew). Unseeded: seeded rows never draft."""
    prompt = [5, 17, 42, 99, 7]
    params = SamplingParams(max_tokens=3, temperature=1.5, top_k=4, ignore_eos=True)
    draws = 400

    def draw(method: str) -> Counter[tuple[int, int]]:
        engine = spec_engine(llama_dir, **BASE, speculative_method=method, max_num_seqs=64)
        torch.manual_seed(2)  # unseeded requests draw from torch's global generator
        for i in range(draws):
            engine.add_request(EngineRequest(prompt, params, f"s{i}"))
        outs = run_to_completion(engine)
        if method != "off":  # every second token was verified against a draft
            assert engine.stats().spec_decode_num_drafts == draws
        return Counter((tokens_of(v)[0], tokens_of(v)[1]) for v in outs.values())

    plain = draw("off")
    # Always draft the plain run's most common second token: accepted with p(token).
    top = Counter(t[1] for t in plain.elements()).most_common(1)[0][0]
    monkeypatch.setattr(speculative, "ngram_drafts", lambda req, state, k: [top])
    spec = draw("ngram")
    assert spec != plain  # a different random stream, the same law
    stat, df = _two_sample(plain, spec)
    assert df >= 5
    assert stat < chi2_critical(df), (stat, df)


def _two_sample(a: Counter[tuple[int, int]], b: Counter[tuple[int, int]]) -> tuple[float, int]:
    """Chi-square of homogeneity over the cells with at least 10 draws in all."""
    na, nb = sum(a.values()), sum(b.values())
    cells = [c for c in a.keys() | b.keys() if a[c] + b[c] >= 10]
    stat = 0.0
    for c in cells:
        total = a[c] + b[c]
        for n, counts in ((na, a), (nb, b)):
            expected = total * n / (na + nb)
            stat += (counts[c] - expected) ** 2 / expected
    return stat, len(cells) - 1


def test_rows_the_verifier_cannot_take_decode_one_token_at_a_time(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(speculative, "ngram_drafts", lambda req, state, k: [3] * k)
    engine = spec_engine(llama_dir, **BASE, speculative_method="ngram")
    for name, params in (
        ("penalty", replace(GREEDY, repetition_penalty=1.3)),
        ("logprobs", replace(GREEDY, logprobs=2)),
        ("min_tokens", replace(GREEDY, min_tokens=16, ignore_eos=False)),
        ("seeded", SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)),
    ):
        engine.add_request(EngineRequest([5, 6, 7], params, name))
    run_to_completion(engine)
    assert engine.stats().spec_decode_num_drafts == 0


def test_a_draft_model_pauses_below_the_cost_of_its_drafts(
    llama_dir: Path, small_draft: Path
) -> None:
    """A draft token costs the draft's share of the target's parameters in target steps:
    below that acceptance drafting loses time, so the pause floor rises to it (n-gram
    drafts cost nothing: the floor stays MIN_ACCEPTANCE)."""
    engine = make_engine(llama_dir, speculative_method="draft", speculative_model=str(small_draft))
    assert engine.runner.drafter is not None
    ratio = speculative.draft_cost_ratio(engine.runner.drafter.model, engine.runner.model)
    assert MIN_ACCEPTANCE < ratio < 1
    assert engine.speculator is not None and engine.speculator.min_acceptance == ratio
    assert Speculator("ngram", 4).min_acceptance == MIN_ACCEPTANCE
    spec = Speculator("draft", 4, draft_cost=0.5)
    req = _request("r", [1, 2, 3], 64)
    req.num_computed_tokens = req.num_tokens - 1
    req.output_token_ids = []
    verified = 0
    for _ in range(40):  # 30% accepted: above MIN_ACCEPTANCE, below the cost
        spec.propose([req])
        if req.spec_token_ids:
            verified += 1
            spec.observe("r", 4, 1 if verified % 3 else 2)
    assert 3 <= verified <= 10  # paused after a few, then rare probes


def test_drafting_pauses_when_drafts_are_rarely_accepted() -> None:
    spec = Speculator("ngram", 4)
    req = _request("r", [1, 2, 1, 2, 1, 2], 64)
    req.num_computed_tokens = req.num_tokens - 1
    req.output_token_ids = []
    drafted = 0
    for _ in range(200):
        spec.propose([req])
        if req.spec_token_ids:
            drafted += 1
            spec.observe("r", len(req.spec_token_ids), 0)
    assert 4 <= drafted <= 20  # a few to notice, then rare probes
    state = spec.states["r"]
    assert state.acceptance < MIN_ACCEPTANCE + 0.2
    assert spec.counters.num_drafts == drafted
    # A new request starts from the engine's acceptance: when that is below the
    # threshold, paused at once.
    assert spec.acceptance < 1
    spec.acceptance = MIN_ACCEPTANCE / 2
    other = _request("s", [1, 2, 1, 2, 1, 2], 64)
    other.num_computed_tokens = other.num_tokens - 1
    spec.propose([other])
    assert other.spec_token_ids == []
    # For as long as the longest pause so far: where every probe fails, short requests
    # never probe.
    assert spec.pause >= 8 * speculative.FIRST_PAUSE
    assert spec.states["s"].paused_until == spec.step + spec.pause
    # A row that accepts every draft brings new requests back to the first pause.
    spec.observe("r", 2, 2)
    third = _request("t", [1, 2, 1, 2, 1, 2], 64)
    third.num_computed_tokens = third.num_tokens - 1
    spec.propose([third])
    assert spec.states["t"].paused_until == spec.step + speculative.FIRST_PAUSE


@pytest.mark.parametrize("expensive", [True, False])
def test_drafts_run_only_where_the_step_cost_fit_predicts_a_gain(
    llama_dir: Path,
    reference: tuple[list[list[int]], dict[str, list[int]]],
    monkeypatch: pytest.MonkeyPatch,
    expensive: bool,
) -> None:
    """A fit where every extra token costs five times a step's overhead (a saturated
    device): even drafts all expected to pass bring fewer tokens than their time, so none
    run. A fit where tokens are nearly free (a GPU below its knee): they all run."""
    prompts, expected = reference
    monkeypatch.setattr(speculative, "ngram_drafts", echo_proposer(expected, 2))
    engine = make_engine(llama_dir, **BASE, speculative_method="ngram")
    per_token = 5e-2 if expensive else 1e-6
    fit = StepCostModel.fixed({"overhead": 1e-2, "prefill_token": per_token, "decode_row": 1e-2})
    monkeypatch.setattr(fit, "observe", lambda shape, seconds: None)
    engine.scheduler.step_cost = fit
    assert run(engine, prompts[:6], GREEDY) == {k: expected[k] for k in map(str, range(6))}
    stats = engine.stats()
    assert (stats.spec_decode_num_drafts == 0) == expensive
    if not expensive:
        assert stats.spec_decode_num_accepted_tokens > 0


def test_config_refuses_bad_speculative_settings() -> None:
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="draft")


def test_metrics_carry_the_spec_decode_counters(
    llama_dir: Path,
    reference: tuple[list[list[int]], dict[str, list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from backend.telemetry import EngineStatsCollector, ModelServerCollector

    prompts, expected = reference
    monkeypatch.setattr(speculative, "ngram_drafts", echo_proposer(expected, 3))
    engine = spec_engine(llama_dir, **BASE, speculative_method="ngram")
    run(engine, prompts[:4], GREEDY)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(engine.stats))
    registry.register(ModelServerCollector(engine.stats, "m"))
    text = generate_latest(registry).decode()
    stats = engine.stats()
    for name, value in (
        ("vllm:spec_decode_num_drafts_total", stats.spec_decode_num_drafts),
        ("vllm:spec_decode_num_draft_tokens_total", stats.spec_decode_num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens_total", stats.spec_decode_num_accepted_tokens),
    ):
        assert value > 0
        assert f'{name}{{model_name="m"}} {float(value)}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text
    assert f"tollgate_engine_spec_decode_acceptance_ratio {stats.spec_decode_acceptance_rate}" in (
        text
    )
    assert "tollgate_engine_spec_decode_tokens_per_step" in text
    plain = make_engine(llama_dir, **BASE)
    registry = CollectorRegistry()
    registry.register(ModelServerCollector(plain.stats, "m"))
    assert "spec_decode" not in generate_latest(registry).decode()
