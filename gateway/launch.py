"""The entry point an install made before the CLI became a package names; pyproject.toml's
`tollgate` script is gateway.cli:main now (drop this file once every venv is reinstalled)."""

from gateway.cli import main

__all__ = ["main"]
