"""Capacity planning from the seeds' five formulas (weights, KV bytes per token, the
decode step floor, max concurrency, TTFT from the prefill rate), on the simulator's one
roofline cost model (backend/sim/cost.py). `tollgate capacity --help`; README
"Capacity planning"."""
