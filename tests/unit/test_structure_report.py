"""scripts/structure_report.py on a small tree made for it: a route that reaches the
composition root, a service that imports Litestar, tenants/ importing the gateway, and
two service folders that import each other (one of them inside a function, the other
relative)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "structure_report.py"

TREE = {
    "backend/__init__.py": "",
    "tenants/__init__.py": "",
    "tenants/models.py": "from gateway.core import errors\n",
    "gateway/__init__.py": "",
    "gateway/runtime.py": "from gateway.api import routes\n",
    "gateway/api/__init__.py": "",
    "gateway/api/routes.py": "from gateway.runtime import Runtime\nfrom gateway import admission\n",
    "gateway/admission/__init__.py": "",
    "gateway/admission/quota.py": "from litestar import Request\nfrom ..metering import recorder\n",
    "gateway/metering/__init__.py": "",
    "gateway/metering/recorder.py": "def settle():\n    from gateway.admission.quota import x\n",
    "gateway/core/__init__.py": "",
    "gateway/core/errors.py": "",
    "gateway/nowhere/__init__.py": "",
}


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--check", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_violations_and_a_cycle_are_reported_and_fail(tmp_path: Path) -> None:
    result = check(write(tmp_path, TREE))
    assert result.returncode == 1, result.stdout
    out = result.stdout
    assert "layer violations: 4" in out
    assert "gateway.api.routes:1 imports gateway.runtime: routes must not import root" in out
    assert "gateway.admission.quota:1 imports litestar: services must not import litestar" in out
    assert "tenants.models:1 imports gateway.core.errors: tenants must not import services" in out
    assert "gateway.nowhere: a gateway folder in no layer" in out
    assert "cycles between the gateway's folders (function-level imports included): 2" in out
    assert "  gateway <-> gateway.api\n" in out  # the route's import of the root closes one
    assert "  gateway.admission <-> gateway.metering\n" in out
    # the relative import and the one inside a function, both named
    assert "gateway.admission.quota:2 imports gateway.metering.recorder" in out
    assert "gateway.metering.recorder:2 imports gateway.admission.quota" in out


def test_a_tree_in_layers_passes(tmp_path: Path) -> None:
    clean = {
        name: text
        for name, text in TREE.items()
        if not name.startswith(("gateway/nowhere", "tenants/models"))
    }
    clean["gateway/api/routes.py"] = "from gateway.admission import quota\n"
    clean["gateway/admission/quota.py"] = "from gateway.core.errors import ApiError\n"
    result = check(write(tmp_path, clean))
    assert result.returncode == 0, result.stdout
    assert "layer violations: 0" in result.stdout
    assert "cycles between the gateway's folders (function-level imports included): 0" in (
        result.stdout
    )


def test_the_real_tree_keeps_its_layers() -> None:
    result = check(SCRIPT.parents[1])
    assert result.returncode == 0, result.stdout
