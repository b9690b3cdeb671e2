"""Shared by the deployment tests: the TOLLGATE_* variables the code reads, and
subprocesses."""

from __future__ import annotations

import re
import subprocess
import threading
from functools import cache
from pathlib import Path

from gateway.settings import engine_knobs
from tests.e2e.processes import Process

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"


@cache
def known_env_vars() -> frozenset[str]:
    """Every TOLLGATE_* name the product's code reads (a quoted literal in its source)."""
    names: set[str] = set()
    for package in ("gateway", "backend", "tenants"):
        for path in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r"[\"'](TOLLGATE_[A-Z0-9_]+)[\"']", path.read_text()))
    # Engine knobs are read by name from EngineConfig's fields (gateway/settings/engine_knobs.py).
    names.update(knob.env for knob in engine_knobs.knobs())
    names.update(alias for aliases in engine_knobs.ALIASES.values() for alias in aliases)
    return frozenset(names)


def spawn(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> Process:
    """A subprocess with its output read as tests.e2e.processes does, for commands other
    than this environment's `tollgate` (a wheel's, `python -m ...`, `celery`). `env` is
    the whole environment."""
    popen = subprocess.Popen(
        argv,
        env={**env, "PYTHONUNBUFFERED": "1"},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    process = Process(popen)
    threading.Thread(target=_read_lines, args=(process,), daemon=True).start()
    return process


def _read_lines(process: Process) -> None:
    assert process.popen.stdout is not None
    for line in process.popen.stdout:
        process.lines.put(line)
