"""`tollgate` with a resolver the test controls: dns:// backend names resolve to the
addresses listed for them in the JSON file TOLLGATE_TEST_HOSTS ({"name": ["127.0.0.2"]}),
read at every lookup, so a test can add and remove replicas of a running gateway.

    python -m tests.infra.resolving_tollgate serve --port 8001
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from gateway.cli import commands as cli
from gateway.dispatch import discovery


async def hosts_file_resolver(host: str, port: int) -> list[str]:
    hosts = json.loads(Path(os.environ["TOLLGATE_TEST_HOSTS"]).read_text())
    if host not in hosts:
        raise socket.gaierror(socket.EAI_NONAME, f"{host} is not in TOLLGATE_TEST_HOSTS")
    return list(hosts[host])


def write_hosts(path: Path, hosts: dict[str, list[str]]) -> None:
    """Replace the file at once: a lookup never reads half of it."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(hosts))
    partial.replace(path)


if __name__ == "__main__":
    discovery.system_resolver = hosts_file_resolver
    sys.exit(cli.main(sys.argv[1:]))
