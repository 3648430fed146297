"""A real server process for tests: started on a free localhost port, polled until healthy,
stopped with SIGTERM. Raw HTTP (for malformed requests) goes through http.client so that what is
sent is exactly what the test wrote.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 60.0
TINY_SERVER_FLAGS = ("--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override",
                     "256", "--seed", "0")


# How the server is started: the module the issue names, or the `specserve serve` CLI.
API_SERVER = ("specserve.entrypoints.openai.api_server",)
CLI_SERVE = ("specserve.entrypoints.cli", "serve")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m specserve.entrypoints.openai.api_server`` on 127.0.0.1:<free port>."""

    def __init__(self, args: list[str], api_key: str | None = None,
                 env: dict[str, str] | None = None, command: tuple[str, ...] = API_SERVER) -> None:
        self.api_key = api_key
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specserve-server-", suffix=".log",
                                               delete=False)
        cmd = [sys.executable, "-m", *command, "--host", "127.0.0.1", "--port", str(self.port),
               "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *args]
        full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=Path(__file__).parent.parent)
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 40) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)
        return self.proc.returncode

    # ---- clients -----------------------------------------------------------------------------
    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0,
                             timeout=REQUEST_TIMEOUT_S, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.AsyncOpenAI(base_url=self.url + "/v1", max_retries=0,
                                  timeout=REQUEST_TIMEOUT_S, **kwargs)

    def request(self, method: str, path: str, body: bytes | str | dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One raw HTTP request; returns (status, body)."""
        if isinstance(body, dict):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode()
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        if self.api_key:
            hdrs["Authorization"] = f"Bearer {self.api_key}"
        hdrs.update(headers or {})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value}, plus {'name': value} summed over labels."""
        status, body = self.request("GET", "/metrics")
        assert status == 200, body
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
            name = key.split("{", 1)[0]
            if name != key:
                out[name] = out.get(name, 0.0) + float(value)
        return out


def tiny_server_args(model: Path, *extra: str) -> list[str]:
    return ["--model", str(model), *TINY_SERVER_FLAGS, *extra]


def assert_openai_error(status: int, body: bytes, expected_status: int | None = None) -> dict:
    """The body is OpenAI's error JSON; returns its "error" object."""
    assert 400 <= status < 500, (status, body)
    if expected_status is not None:
        assert status == expected_status, (status, body)
    payload = json.loads(body)
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"}, payload
    assert isinstance(error["message"], str) and error["message"], payload
    return error
