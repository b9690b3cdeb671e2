"""`tollgate backend serve`: one engine replica behind the internal HTTP API. Its own
parser, so that gateway/cli/__init__.py can start a replica without the imports of
gateway/cli/commands.py, which lists the same command, with the same flags, in `tollgate --help`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.settings import Settings, SettingsError, engine_knobs, gateway_engine_defaults

HELP = "run the engine behind the internal HTTP API (TOLLGATE_BACKEND_SECRET)"


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: built-in)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    engine_knobs.add_flags(parser, gateway_engine_defaults())


def run(settings: Settings, args: argparse.Namespace) -> int:
    from gateway.cli.serve import serve_backend

    model = args.model or settings.model_path
    engine = engine_knobs.from_flags(settings.engine, args)
    return serve_backend(
        settings.with_overrides(host=args.host, port=args.port, model_path=model, engine=engine)
    )


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tollgate backend serve", description=HELP)
    add_flags(parser)
    args = parser.parse_args(argv)
    try:
        return run(Settings.from_env(), args)
    except (SettingsError, engine_knobs.KnobError) as exc:
        print(f"tollgate: {exc}", file=sys.stderr)
        return 2
