"""backend/grammar.py without a model: what it needs imported, and what it refuses before
a grammar reaches llguidance's native code."""

from __future__ import annotations

import subprocess
import sys

# A meta-path finder that makes `import llguidance` fail, as on an image without it.
_NO_LLGUIDANCE = """
import sys
class NoLlguidance:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "llguidance":
            raise ImportError("llguidance is not installed here")
sys.meta_path.insert(0, NoLlguidance())
import backend.engine.engine, backend.engine.model_runner, backend.grammar
assert "llguidance" not in sys.modules
"""


def test_the_engine_imports_without_llguidance() -> None:
    """The GPU image has no llguidance; only compiling or masking a grammar needs it."""
    done = subprocess.run(
        [sys.executable, "-c", _NO_LLGUIDANCE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
