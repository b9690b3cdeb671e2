"""A deterministic simulator of the scheduling policy: the real Scheduler and BlockManager
under a virtual clock, a roofline cost model of each step, and an open-loop arrival
trace. `python -m backend.sim --help`; see backend/SCHEDULING.md."""

from backend.sim.cost import H100, H200, LLAMA3_8B, CostModel, GpuSpec, ModelSpec
from backend.sim.report import Report, summarize
from backend.sim.simulator import RequestRecord, SimResult, Simulator
from backend.sim.trace import Arrival, Stream, make_trace

__all__ = [
    "H100",
    "H200",
    "LLAMA3_8B",
    "Arrival",
    "CostModel",
    "GpuSpec",
    "ModelSpec",
    "Report",
    "RequestRecord",
    "SimResult",
    "Simulator",
    "Stream",
    "make_trace",
    "summarize",
]
