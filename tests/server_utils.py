"""Start a real jserve server (uvicorn on 127.0.0.1, a free port) in a background thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
import uvicorn

from jserve.engine.args import EngineArgs
from jserve.server import ServerSettings, build_app
from jserve.server.async_engine import AsyncEngine

from tiny_models import VOCAB_SIZE, assert_engine_idle

MODEL = "tiny"  # the served model name the server tests use

# A minimal chat template for the tiny checkpoints, whose tokenizer has none.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def prompt_ids(seed: int, length: int = 12) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB_SIZE, length).tolist()


def assert_error(response: httpx.Response, status: int, param: str | None = None, text: str = "") -> dict:
    """An error response in OpenAI's shape, with this status (and param, and text in its message)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    assert text in error["message"], error
    return error


@dataclass
class ServerHandle:
    base_url: str
    engine: AsyncEngine
    server: uvicorn.Server

    def metric(self, name: str) -> float:
        """A metric's value summed over its label sets, read from /metrics."""
        text = httpx.get(f"{self.base_url}/metrics").text
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(f"jserve:{name}{{") or line.startswith(f"jserve:{name} "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"metric jserve:{name} not in /metrics"
        return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {predicate}")
        time.sleep(interval)


def assert_server_idle(handle: ServerHandle, timeout: float = 30.0) -> None:
    """Nothing in flight (once aborts have landed), every KV page back in the pool, and every HTTP call's
    bookkeeping gone."""
    wait_until(lambda: not handle.engine.engine.has_unfinished_requests(), timeout)
    assert_engine_idle(handle.engine)
    assert not handle.engine.submissions


@contextlib.contextmanager
def running_server(args: EngineArgs, settings: ServerSettings, load_timeout: float = 300.0):
    app = build_app(args, settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    handle = ServerHandle(f"http://127.0.0.1:{port}", app.state.engine, server)

    def ready() -> bool:
        try:
            return httpx.get(f"{handle.base_url}/health").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, load_timeout, interval=0.1)
        yield handle
    finally:
        server.should_exit = True
        thread.join(timeout=60)
