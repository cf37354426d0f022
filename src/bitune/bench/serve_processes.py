"""The server processes of ``bitune bench serve``: each server under test runs as its own process on 127.0.0.1,
started, awaited, stopped, and asked what CPU time it (its threads and children included) spent."""

from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BituneError


@dataclass
class Server:
    """One server process under test."""

    name: str
    command: list[str]
    model: str
    fields: Callable[[int], dict]
    """The request fields that ask it for exactly n generated tokens (besides model, prompt and stream)."""
    port: int = 0
    process: subprocess.Popen | None = None
    log: object = None
    results: list[dict] = field(default_factory=list)
    compile_s: float | None = None
    """The startup compile time ``bitune serve --compile`` printed (read from its log once it stopped)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no process listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server: Server, threads: int, logs: Path) -> None:
    """Start ``server`` on a free port with ``threads`` CPU threads, its output in ``logs/<name>.log``."""
    server.port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    server.log = open(logs / f"{server.name}.log", "w")
    server.process = subprocess.Popen([*server.command, "--port", str(server.port)], env=env, stdout=server.log,
                                      stderr=subprocess.STDOUT)


def wait_ready(server: Server, timeout: float = 600) -> None:
    """Return once ``server`` answers ``/v1/models``.

    Raises:
        BituneError: it exited first (naming its own error line), or did not answer within ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            server.log.flush()
            lines = [x.strip() for x in Path(server.log.name).read_text(errors="replace").splitlines() if x.strip()]
            why = next((x for x in reversed(lines) if " error: " in x), lines[-1] if lines else "no output")
            raise BituneError(f"server {server.name} exited with status {server.process.returncode}: {why}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise BituneError(f"server {server.name} did not start within {timeout:.0f} s")


def stop(server: Server) -> None:
    """Terminate ``server`` (killed after 30 s) and close its log."""
    if server.process is not None and server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()
    if server.log is not None:
        server.log.close()


def compile_seconds(log: Path) -> float | None:
    """The compile time a ``bitune serve --compile`` log states ("compiled in 12.3 s"), else None."""
    found = re.search(r"compiled in ([0-9.]+) s", log.read_text(errors="replace")) if log.is_file() else None
    return float(found.group(1)) if found else None


def cpu_seconds(process: subprocess.Popen) -> float:
    """User + system CPU seconds of a process so far: its threads, its live children and the children it has
    waited for."""
    import psutil

    proc = psutil.Process(process.pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:  # ended since the listing: its time is its parent's once waited for
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total
