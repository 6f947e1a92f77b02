"""Start `batonlm serve` in a subprocess on a free port, wait for /health, stop it (used by the
serving benchmarks and the tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from batonlm.process_tree import descendants


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self, *args: str, startup_timeout: float = 120.0, command: list[str] | None = None, new_session: bool = False
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.log_path = Path(tempfile.gettempdir()) / f"batonlm-server-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*(command or [sys.executable, "-m", "batonlm", "serve"]), "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session,
        )
        self._final_log: str | None = None  # the log's text once stopped (its file is removed then)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited during start-up ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become healthy:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        if self._final_log is not None:
            return self._final_log
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def descendants(self) -> list[int]:
        return descendants(self.proc.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._final_log is None:  # kept in memory: a start per test left hundreds of files in /tmp
            self._log.close()
            self._final_log = self.log_path.read_text()
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode


def requests_in_server(url: str, states: tuple[str, ...] = ("running", "waiting")) -> float:
    """Requests in `states` (running, waiting), summed over every scheduler (DP replicas report
    one each); 0 while the server does not answer."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    names = tuple(f"batonlm_num_requests_{s}" for s in states)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names))
