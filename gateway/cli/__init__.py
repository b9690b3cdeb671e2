"""The `tollgate` command's entry point. `tollgate backend serve` (an engine replica) starts
without importing the gateway's database, quota and billing modules, which would cost it
~1.5 s at every start and restart; every other command is gateway/cli/commands.py's."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["backend", "serve"]:
        from gateway.cli.backend import main as serve_replica

        return serve_replica(args[2:])
    from gateway.cli.commands import main as gateway_command

    return gateway_command(args)


if __name__ == "__main__":
    sys.exit(main())
