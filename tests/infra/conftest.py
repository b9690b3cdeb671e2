"""What the deployment files may name: the TOLLGATE_* variables the code reads."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"


@cache
def known_env_vars() -> frozenset[str]:
    """Every TOLLGATE_* name the product's code reads (a quoted literal in its source)."""
    names: set[str] = set()
    for package in ("gateway", "backend", "tenants"):
        for path in (ROOT / package).rglob("*.py"):
            names.update(re.findall(r"[\"'](TOLLGATE_[A-Z0-9_]+)[\"']", path.read_text()))
    return frozenset(names)
