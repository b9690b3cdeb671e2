"""The interpreter suite: Triton kernels run on the CPU under TRITON_INTERPRET=1.

Triton reads the variable when a kernel is decorated (when its module is imported), not
when triton itself is imported, so it is set here, before any test module imports
backend.kernels; nothing outside backend.kernels imports those modules at import time."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

_loaded = [name for name in sys.modules if name.startswith("backend.kernels.")]
if _loaded:
    raise RuntimeError(
        f"{_loaded} were imported before TRITON_INTERPRET=1 was set; their kernels are "
        "compiled for a GPU and cannot run on CPU tensors"
    )
