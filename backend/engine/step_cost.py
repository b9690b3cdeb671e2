"""How long a step takes, learnt from the steps the engine runs: an online least-squares
fit of

    step seconds = overhead + a x prefill tokens + b x decode rows
                   + c x decode context + d x prefill pairs

where `decode context` counts the cached tokens the decode rows read (a row at position s
reads s + 1 keys) and `prefill pairs` the query-key pairs the prefill chunks attend (a
chunk of n tokens at position s: n x s + n (n + 1) / 2). The two attention terms are
apart because they cost differently: a decode row's keys are read from memory once per
query (memory-bound), a chunk's are reused by all of its queries (compute-bound, on this
project's CPU about 20x cheaper per pair); one shared term let a document's chunks over
their cached prefixes leak into the overhead and decode-row terms. A chunk of a few
tokens over cached keys (at most SHORT_QUERY_TOKENS: a verify row, a preempted request's
uncached tail) is attended as a decode row is, its keys read once, so its attention
counts as decode context: counted as pairs, a backlog whose only prefills were such
tails taught the pair term a price 1,000x too high (issue 32), and a 500-token prompt
looked seconds long. Every step adds one observation; older ones fade (a half-life in
steps), so the fit follows the machine (a busy CPU, a GPU that warms up). Before the
first step, a few warm-up steps of varied shapes (`warm_up_batches`) make sure the
scheduler never sizes a step blind. The scheduler inverts the fit: the most prefill
tokens a step may take and still end within a time target (backend/SCHEDULING.md)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from backend.config import SHORT_QUERY_TOKENS
from backend.engine.batch import ScheduledRequest, SchedulerOutput
from backend.engine.block_manager import BlockManager
from backend.sampling import SamplingParams

# Features are scaled to similar magnitudes (seconds per ~1,000 tokens, per ~100 rows,
# per ~100k keys read, per ~1M attended pairs), so the normal equations stay well
# conditioned.
_SCALES = (1.0, 1e-3, 1e-2, 1e-5, 1e-6)
# The ridge pulls each term toward the last fit, relative to what the steps say about it
# (and a little in absolute terms, for directions no recent step explored), not to 0.
_RIDGE_RELATIVE = 1e-4
_RIDGE_ABSOLUTE = 1e-9
_OUTLIER = 4.0  # an observation counts as at most this multiple of its prediction
_TERMS = ("overhead", "prefill_token", "decode_row", "decode_context_token", "prefill_pair")
_N = len(_TERMS)
Theta = tuple[float, ...]


@dataclass(frozen=True)
class StepShape:
    """What a step's time depends on."""

    prefill_tokens: int = 0
    decode_rows: int = 0
    decode_context: int = 0  # keys read once: by the decode rows and the short chunks
    prefill_pairs: int = 0  # query-key pairs the longer prefill chunks attend

    @classmethod
    def of_chunks(cls, chunks: Iterable[tuple[int, int]]) -> StepShape:
        """From (start, num_tokens) chunks; a one-token chunk counts as a decode row."""
        prefill = decode = context = pairs = 0
        for start, n in chunks:  # every step's rows: ints, no shape per chunk
            if n == 1:
                decode += 1
                context += start + 1
            else:
                keys, attended = chunk_attention(start, n)
                prefill += n
                context += keys
                pairs += attended
        return cls(prefill, decode, context, pairs)

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        return cls.of_chunks((r.start_pos, len(r.token_ids)) for r in out.requests)

    def plus_prefill(self, start: int, n: int) -> StepShape:
        """This step with one more prefill chunk of n tokens at position `start`."""
        keys, pairs = chunk_attention(start, n)
        return StepShape(
            self.prefill_tokens + n,
            self.decode_rows,
            self.decode_context + keys,
            self.prefill_pairs + pairs,
        )

    def plus_decode(self, start: int) -> StepShape:
        """This step with one more decode row at position `start`."""
        return StepShape(
            self.prefill_tokens,
            self.decode_rows + 1,
            self.decode_context + start + 1,
            self.prefill_pairs,
        )

    def with_drafts(self, start: int, num_drafts: int) -> StepShape:
        """This step with its decode row at `start` carrying draft tokens: a chunk of
        1 + num_drafts tokens instead (speculative decoding)."""
        n = 1 + num_drafts
        keys, pairs = chunk_attention(start, n)
        return StepShape(
            self.prefill_tokens + n,
            self.decode_rows - 1,
            self.decode_context - (start + 1) + keys,
            self.prefill_pairs + pairs,
        )

    def features(self) -> Theta:
        raw = (1, self.prefill_tokens, self.decode_rows, self.decode_context, self.prefill_pairs)
        return tuple(x * scale for x, scale in zip(raw, _SCALES, strict=True))


def chunk_pairs(start: int, n: int) -> int:
    """Query-key pairs of a causal chunk of n tokens at position `start`."""
    return n * start + n * (n + 1) // 2


def chunk_attention(start: int, n: int) -> tuple[int, int]:
    """(keys read once, query-key pairs) of a chunk of n tokens at position `start`: a
    short chunk over cached keys reads them as a decode row does; the rest attend pairs."""
    if start > 0 and n <= SHORT_QUERY_TOKENS:
        return start + n, 0
    return 0, chunk_pairs(start, n)


class StepCostModel:
    """The online fit. Not thread-safe: the step thread observes and predicts; other
    threads read `snapshot()`-style attributes (floats, replaced whole)."""

    def __init__(self, half_life_steps: float = 256.0) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._xtx = [[0.0] * _N for _ in range(_N)]
        self._xty = [0.0] * _N
        self._theta: Theta = (0.0,) * _N  # in scaled units
        self.num_observations = 0
        self.last_predicted_s = 0.0  # of the last observed step, before it ran
        self.last_actual_s = 0.0
        self.relative_error = 0.0  # moving average of |predicted - actual| / actual

    @classmethod
    def fixed(cls, coefficients: dict[str, float]) -> StepCostModel:
        """A model with these terms (seconds per unit, as `coefficients` reports them,
        e.g. a real engine's EngineStats.step_cost_s): the simulator's cost calibrated
        from an engine."""
        model = cls()
        model._theta = tuple(
            coefficients.get(term, 0.0) / scale for term, scale in zip(_TERMS, _SCALES, strict=True)
        )
        model.num_observations = 4  # as good as warmed up
        return model

    @property
    def ready(self) -> bool:
        """Enough varied steps seen to trust an inversion (warm-up provides them)."""
        return self.num_observations >= 4

    @property
    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each term."""
        per_unit = [t * s for t, s in zip(self._theta, _SCALES, strict=True)]
        return dict(zip(_TERMS, per_unit, strict=True))

    def predict(self, shape: StepShape) -> float:
        return max(0.0, sum(t * x for t, x in zip(self._theta, shape.features(), strict=True)))

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """The simulator's cost interface (backend.sim.cost.CostModel has the same)."""
        return self.predict(StepShape.of_chunks(chunks))

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not seconds > 0 or not math.isfinite(seconds):
            return
        predicted = self.predict(shape)
        if self.ready:
            self.last_predicted_s, self.last_actual_s = predicted, seconds
            error = abs(predicted - seconds) / seconds
            self.relative_error = 0.9 * self.relative_error + 0.1 * error
            # One step of a machine hiccup must not double every prediction.
            seconds = min(seconds, _OUTLIER * predicted) if predicted > 0 else seconds
        x = shape.features()
        d = self._decay
        for i in range(_N):
            self._xty[i] = d * self._xty[i] + x[i] * seconds
            row = self._xtx[i]
            for j in range(_N):
                row[j] = d * row[j] + x[i] * x[j]
        self.num_observations += 1
        self._theta = self._solve()

    def max_prefill_tokens(
        self, limit_s: float, decode: StepShape, prefill_start: int, low: int, high: int
    ) -> int:
        """The most prefill tokens in [low, high] that, next to the step's decode rows,
        keep the predicted step time within `limit_s`; `prefill_start` is where the
        prefill chunks begin (their attention grows with it)."""
        if not self.ready or high <= low:
            return high  # blind (never after warm-up), or nothing to choose

        def fits(n: int) -> bool:
            return self.predict(decode.plus_prefill(prefill_start, n)) <= limit_s

        if fits(high):
            return high
        lo, hi = low, high  # the answer is in [lo, hi); fits(lo) may be False: the floor
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def _solve(self) -> Theta:
        """Ridge least squares with non-negative coefficients: a term that fits negative
        (collinear features, noise) is dropped and the rest refitted."""
        active = [True] * _N
        while True:
            idx = [i for i in range(_N) if active[i]]
            ridge = [_RIDGE_RELATIVE * self._xtx[i][i] + _RIDGE_ABSOLUTE for i in range(_N)]
            a = [[self._xtx[i][j] + (ridge[i] if i == j else 0.0) for j in idx] for i in idx]
            b = [self._xty[i] + ridge[i] * self._theta[i] for i in idx]
            solved = _gauss(a, b)
            theta = [0.0] * _N
            for k, i in enumerate(idx):
                theta[i] = solved[k]
            negative = [i for i in idx if theta[i] < 0]
            if not negative:
                return tuple(theta)
            active[min(negative, key=lambda i: theta[i])] = False


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b (a small symmetric positive definite system), partial pivoting."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        if abs(m[r][r]) < 1e-300:
            continue
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


WARM_UP_RUNS = 3  # each warm-up shape is timed this many times; the fastest counts
WARMUP_ID = "\0warm-up"  # never a caller's id: those contain no NUL


def warm_up_shapes(max_batched_tokens: int, capacity: int) -> list[list[tuple[int, int]]]:
    """Chunks (start, num_tokens) of the warm-up steps: whole prefills of several sizes, a
    chunk over a cached prefix, decode batches of several widths and contexts, and a
    mix, all within `capacity` KV slots and the step budget, so every term of the fit is
    seen before the first real step."""
    cap = max(1, min(max_batched_tokens, capacity))
    shapes: list[list[tuple[int, int]]] = []
    for n in (16, 64, 256, 512):
        shapes.append([(0, min(n, cap))])
    chunk = min(128, cap)
    shapes.append([(max(0, min(512, capacity - chunk)), chunk)])
    for rows, context in ((1, 512), (8, 128), (32, 32), (8, 1024)):
        rows = max(1, min(rows, capacity // (context + 1), max_batched_tokens))
        context = max(0, min(context, capacity // rows - 1))
        shapes.append([(context, 1)] * rows)
    mix = min(128, cap // 2)
    context = min(64, max(0, capacity - mix - 1))
    rows = max(1, min(8, (capacity - mix) // (context + 1), max_batched_tokens - mix))
    shapes.append([(0, mix), *[(context, 1)] * rows] if mix > 1 else [(0, 1)])
    return shapes


def warm_up_batches(
    shapes: list[list[tuple[int, int]]],
    allocate: Callable[[str, int], list[int] | None],
    vocab_size: int,
) -> Iterator[SchedulerOutput]:
    """One SchedulerOutput per shape, on the block table `allocate(request_id,
    num_tokens)` returns (None: the pool is short, the shape is skipped; the caller frees
    the `WARMUP_ID`-prefixed ids after each batch). Every row samples greedily, so the lm
    head's cost is in the measurement too."""
    greedy = SamplingParams(max_tokens=1, temperature=0)
    for shape in shapes:
        requests = []
        prefill = decode = 0
        for i, (start, n) in enumerate(shape):
            rid = f"{WARMUP_ID}{i}"
            blocks = allocate(rid, start + n)
            if blocks is None:
                break
            ids = [(start + k) % vocab_size for k in range(n)]
            requests.append(ScheduledRequest(rid, ids, start, blocks, greedy, True, ids, []))
            if n == 1:
                decode += 1
            else:
                prefill += n
        else:
            yield SchedulerOutput(requests, [], prefill, decode)


def warm_up(
    model: StepCostModel,
    shapes: list[list[tuple[int, int]]],
    execute: Callable[[SchedulerOutput], object],
    block_manager: BlockManager,
    vocab_size: int,
) -> None:
    """Run and time each warm-up shape on scratch blocks (`execute`: the model runner's),
    teaching `model`; nothing else sees them: no request, no counter, no prefix-cache
    entry (the blocks are freed unregistered)."""
    taken: set[str] = set()

    def allocate(request_id: str, num_tokens: int) -> list[int] | None:
        if block_manager.allocate_slots(request_id, num_tokens) is None:
            return None
        taken.add(request_id)
        return list(block_manager.block_ids(request_id))

    def free() -> None:
        for request_id in taken:
            block_manager.free(request_id)
        taken.clear()

    for i, batch in enumerate(warm_up_batches(shapes, allocate, vocab_size)):
        if i == 0:
            execute(batch)  # the first pass pays one-time costs
        model.observe(StepShape.of(batch), _fastest_of(WARM_UP_RUNS, execute, batch))
        free()
    free()  # a shape the pool could not hold


def _fastest_of(
    runs: int, execute: Callable[[SchedulerOutput], object], batch: SchedulerOutput
) -> float:
    """The shortest of `runs` timings: a busy machine only ever adds time, and one slow
    run could fit the per-token terms to zero (prefill would look free)."""
    fastest = math.inf
    for _ in range(runs):
        started = time.perf_counter()
        execute(batch)
        fastest = min(fastest, time.perf_counter() - started)
    return fastest
