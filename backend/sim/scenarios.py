"""The policy comparisons the tests assert and bench/scheduler_sim.py prints. Each returns
the engine config and the streams; `simulate` replays them."""

from __future__ import annotations

from dataclasses import replace

from backend.config import EngineConfig
from backend.sim.simulator import SimResult, Simulator
from backend.sim.trace import Stream, make_trace

# A latency-oriented engine: 512-token steps (vLLM's former chunked-prefill default).
BASE = EngineConfig(block_size=16, max_num_seqs=128, max_num_batched_tokens=512)
CHAT = Stream("chat", rate=8.0, prompt_tokens=(100, 300), output_tokens=(100, 300), end=30.0)
DOCUMENT = Stream(
    "document", rate=0.0, prompt_tokens=(6000, 8000), output_tokens=(20, 50), ttft_slo_s=10.0
)

STARVATION_INTERVAL_S = 1.0


def simulate(scenario: tuple[EngineConfig, list[Stream]], seed: int = 0) -> SimResult:
    config, streams = scenario
    return Simulator(config).run(make_trace(streams, seed))


def starvation(aging: bool, displace: bool = False) -> tuple[EngineConfig, list[Stream]]:
    """Priority-0 chat at about 1.3x what 16 slots serve, for 30 s; a trickle of priority-5
    requests alongside. Without aging the trickle waits for the flood to end. `displace`:
    the full queue sheds priority 5 for priority 0 (shed_least_urgent_first)."""
    config = replace(
        BASE,
        max_num_seqs=16,
        max_waiting_requests=48,
        aging_interval_s=STARVATION_INTERVAL_S if aging else None,
        shed_least_urgent_first=displace,
    )
    flood = Stream("chat", rate=16.0, prompt_tokens=(200, 400), output_tokens=(100, 150), end=30.0)
    low = replace(flood, name="batch", rate=0.5, priority=5, end=25.0)
    return config, [flood, low]


def document_burst(protection: bool, documents: bool = True) -> tuple[EngineConfig, list[Stream]]:
    """Steady chat; from t=10 s to 15 s a burst of 7k-token documents (3 per second).
    256-token steps: a full step costs little more than a chat's own prefill step, which
    is what keeps TTFT near its unloaded value once chats skip the documents' queue."""
    config = replace(BASE, max_num_batched_tokens=256)
    if not protection:  # no reserve, no long-prefill cap, no express lane
        config = replace(
            config,
            prefill_reserve_share=0.0,
            long_prefill_token_threshold=0,
            adaptive_step_budget=False,
        )
    burst = replace(DOCUMENT, rate=3.0 if documents else 0.0, start=10.0, end=15.0)
    return config, [CHAT, burst]


def flood(fair: bool) -> tuple[EngineConfig, list[Stream]]:
    """Two tenants of equal weight, both past their share; one sends 10x the requests."""
    config = replace(BASE, max_num_seqs=32, max_waiting_requests=100_000, tenant_fairness=fair)
    quiet = replace(CHAT, name="quiet", tenant="quiet", rate=30.0, end=6.0)
    loud = replace(quiet, name="loud", tenant="loud", rate=300.0)
    return config, [loud, quiet]


def inversion() -> tuple[EngineConfig, list[Stream]]:
    """max_num_seqs full of long priority-5 work; priority-0 requests arrive meanwhile."""
    config = replace(BASE, max_num_seqs=8)
    low = Stream(
        "batch", rate=20.0, prompt_tokens=(100, 200), output_tokens=(500, 800), end=1.0, priority=5
    )
    urgent = Stream(
        "urgent", rate=2.0, prompt_tokens=(50, 100), output_tokens=(10, 20), start=1.5, end=4.0
    )
    return config, [low, urgent]
