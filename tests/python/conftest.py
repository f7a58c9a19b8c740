"""Fixtures for the server tests: start the real release binary on a free port with the real model.

Env: METRALE_MODEL (path of the model; the tests skip, saying so, when it is unset),
METRALE_SERVER_BIN (default: target/release/metrale-server of this repo).
The server runs with --api-key so that the 401 path is exercised; every client sends the key.
"""

import os
import pathlib
import socket
import subprocess
import time

import httpx
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
CTX_SIZE = 1024
PARALLEL = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc, port, log_path, health_seen):
        self.proc = proc
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.health_seen = health_seen  # every (status, body) /health answered before 200

    def log(self) -> str:
        return pathlib.Path(self.log_path).read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def openai(self, api_key=API_KEY, timeout=300, max_retries=0):
        """The official client on this server (no retries unless asked: a test sees every answer)."""
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=max_retries,
                             timeout=timeout)


def model_path() -> str:
    model = os.environ.get("METRALE_MODEL")
    if not model:
        pytest.skip("METRALE_MODEL is not set (run `cargo xtask fetch-model smollm2-135m` and export its path)")
    return model


def server_binary() -> str:
    binary = os.environ.get("METRALE_SERVER_BIN", str(REPO / "target/release/metrale-server"))
    if not os.path.isfile(binary):
        pytest.fail(f"server binary {binary} not found: cargo build --release -p metrale-server")
    return binary


def start_server(log_path, args, preexec_fn=None, model=None, binary=None) -> Server:
    """Start the binary (default: METRALE_SERVER_BIN) with the model (default: METRALE_MODEL) and
    `args` on a free port; return once /health is 200."""
    port = free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [binary or server_binary(), "--model", model or model_path(), "--port", str(port), *args],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=preexec_fn,
    )
    log.close()
    health_seen = []
    deadline = time.time() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{pathlib.Path(log_path).read_text()}")
        if time.time() > deadline:
            stop_server(proc)
            pytest.fail(f"server not healthy after 180 s:\n{pathlib.Path(log_path).read_text()}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            if r.status_code == 200:
                break
            health_seen.append((r.status_code, r.json()))
        except httpx.TransportError:
            pass
        time.sleep(0.01)
    return Server(proc, port, log_path, health_seen)


def stop_server(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    s = start_server(log_path, ["--ctx-size", str(CTX_SIZE), "--parallel", str(PARALLEL), "--api-key", API_KEY,
                               "--embeddings"])
    try:
        yield s
    finally:
        stop_server(s.proc)


@pytest.fixture(scope="session")
def client(server):
    return server.openai()


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as c:
        yield c
