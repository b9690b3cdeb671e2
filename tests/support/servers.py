"""A PostgreSQL cluster and a redis-server of a test's own, on free loopback ports, so a
test can restart them without disturbing the shared ones."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

PG_BIN = Path(os.environ.get("TOLLGATE_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
READY_TIMEOUT_S = 60.0


def _as_postgres(command: list[str]) -> list[str]:
    """initdb and pg_ctl refuse to run as root: run them as the postgres user then."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


class OwnPostgres:
    """A throwaway cluster (trust auth, no fsync) in a temp folder; `restart` is a fast
    shutdown, which ends every connection, then a start on the same port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.folder = Path(tempfile.mkdtemp(prefix="tollgate-pg-"))
        self.data = self.folder / "data"
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.folder, user.pw_uid, user.pw_gid)
        self._run(PG_BIN / "initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "-E", "UTF8", "--no-sync")  # fmt: skip

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1"
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            " -c max_connections=200"
        )
        log = str(self.folder / "postgres.log")
        self._run(PG_BIN / "pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w",
                  "-t", str(int(READY_TIMEOUT_S)), "start")  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self._run(PG_BIN / "pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def remove(self) -> None:
        """Stop the server if it runs, and delete the cluster."""
        if (self.data / "postmaster.pid").exists():
            self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)

    def _run(self, *command: str | Path) -> None:
        done = subprocess.run(
            _as_postgres([str(part) for part in command]),
            capture_output=True,
            text=True,
            timeout=READY_TIMEOUT_S + 10,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, command))} failed: {done.stderr.strip()}")


class OwnRedis:
    """redis-server as a cache that keeps nothing: a restart comes back empty."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--daemonize", "no"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        self._wait_ready()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        ping = ["redis-cli", "-p", str(self.port), "ping"]
        while subprocess.run(ping, capture_output=True, text=True).stdout.strip() != "PONG":
            assert self.process is not None and self.process.poll() is None, "redis exited"
            assert time.monotonic() < deadline, "redis-server did not answer PING"
            time.sleep(0.05)  # polling a server coming up, bounded by the deadline
