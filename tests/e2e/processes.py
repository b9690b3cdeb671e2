"""Start `tollgate` commands as subprocesses on loopback and wait until they say ready."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

STARTUP_TIMEOUT_S = 120
TOLLGATE = str(Path(sys.executable).parent / "tollgate")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Process:
    popen: subprocess.Popen[str]
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    output: list[str] = field(default_factory=list)

    def wait_for(self, marker: str, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """Read output until a line contains `marker`; return everything read so far."""
        deadline = time.monotonic() + timeout_s
        while not any(marker in line for line in self.output):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self._drain()  # what it printed before it exited, for the message
                raise AssertionError(f"no {marker!r} from {self.popen.args!r}:\n{self.text}")
            with contextlib.suppress(queue.Empty):
                self.output.append(self.lines.get(timeout=1))
        return self.text

    def _drain(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self.output.append(self.lines.get(timeout=0.5))

    @property
    def text(self) -> str:
        return "".join(self.output)

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def start(args: list[str], env: dict[str, str]) -> Process:
    popen = subprocess.Popen(
        [TOLLGATE, *args],
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    process = Process(popen)
    threading.Thread(target=_pump, args=(popen, process.lines), daemon=True).start()
    return process


def _pump(popen: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert popen.stdout is not None
    for line in popen.stdout:
        lines.put(line)


@contextlib.contextmanager
def running(*processes: Process) -> Iterator[None]:
    """Stop every process on the way out, whatever happened."""
    try:
        yield
    finally:
        for process in processes:
            process.stop()
