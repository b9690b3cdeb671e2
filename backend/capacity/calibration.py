"""A calibration: the efficiency factors `tollgate capacity check` measured on an engine
and how far the roofline was from the measured step times, saved as JSON for `plan`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backend.capacity.errors import CapacityInputError
from backend.capacity.planner import Efficiency


@dataclass(frozen=True)
class Point:
    kind: str  # "decode" | "prefill"
    batch: int
    tokens: int  # context (decode) or prompt length (prefill)
    floor_s: float  # the roofline at the peak figures (mfu = mbu = 1, no overhead)
    predicted_s: float  # with the fitted factors
    measured_s: float


@dataclass(frozen=True)
class Calibration:
    device: str  # "cpu (calibrated peaks)", "NVIDIA H200", ...
    model: str
    peak_flops: float  # FLOP/s the roofline used
    hbm_bandwidth: float  # bytes/s
    mfu: float
    mbu: float
    step_overhead_s: float
    measured_at: str  # ISO 8601, UTC
    points: list[Point] = field(default_factory=list)
    seq_overhead_s: float = 0.0  # per scheduled request per step

    @property
    def mean_abs_error(self) -> float:
        """Mean |predicted - measured| / measured over the points, with the fitted factors."""
        errors = [abs(p.predicted_s - p.measured_s) / p.measured_s for p in self.points]
        return sum(errors) / len(errors) if errors else 0.0

    @property
    def floor_error(self) -> float:
        """The same for the bare roofline: how far the peak-figure model was off."""
        errors = [abs(p.floor_s - p.measured_s) / p.measured_s for p in self.points]
        return sum(errors) / len(errors) if errors else 0.0

    def efficiency(self) -> Efficiency:
        return Efficiency(
            self.mfu,
            self.mbu,
            self.step_overhead_s,
            f"measured by `tollgate capacity check` on {self.device} ({self.model}, "
            f"{self.measured_at}): mfu {self.mfu:.3g}, mbu {self.mbu:.3g}, overhead "
            f"{self.step_overhead_s * 1000:.3g} ms a step and "
            f"{self.seq_overhead_s * 1000:.3g} ms a request; the bare roofline was "
            f"{self.floor_error:.0%} off the measured step times, the calibrated one "
            f"{self.mean_abs_error:.0%}",
            self.seq_overhead_s,
        )

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            points = [Point(**p) for p in data.pop("points", [])]
            return cls(**data, points=points)
        except (OSError, ValueError, TypeError) as exc:
            raise CapacityInputError(
                "--calibration", f"--calibration {path}: not a saved calibration ({exc})"
            ) from None
