"""`jserve serve` as a process: 503 while loading, graceful drain on SIGTERM, exit codes."""

import json
import os
import re
import signal
import subprocess
import sys

import httpx

from server_utils import free_port, wait_until
from tiny_models import tiny_kv_bytes


def start(model: str, port: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jserve", "serve", model, "--port", str(port), "--served-model-name", "tiny",
           "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
           "--kv-cache-memory", str(tiny_kv_bytes(64)), "--no-enable-prefix-caching", *flags]  # fmt: skip
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_ready(proc: subprocess.Popen, base: str) -> list[str]:
    """The /health statuses seen until the server is ready."""
    statuses = []

    def health() -> bool:
        try:
            response = httpx.get(f"{base}/health")
        except httpx.TransportError:
            return proc.poll() is not None  # stop waiting if the server died
        statuses.append(response.json()["status"])
        return response.status_code == 200

    wait_until(health, timeout=300)
    return statuses


def test_serve_reports_loading_then_drains_on_sigterm(tiny_llama_checkpoint):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start(str(tiny_llama_checkpoint[0]), port)
    try:
        statuses = wait_ready(proc, base)
        assert proc.poll() is None, proc.stdout.read()
        assert statuses[0] == "loading" and statuses[-1] == "ready"

        body = {"model": "tiny", "prompt": "drain me", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)  # in flight: it must still finish in full
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 200
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert "Draining" in log, log
    # Once loaded, the process froze what start-up built out of the garbage collector's scans.
    assert re.search(r"Froze [1-9]\d* start-up objects", log), log


def test_a_stream_the_shutdown_timeout_cuts_ends_with_an_error_event(tiny_llama_checkpoint):
    """Not cut like a dropped connection: the engine ends what is in flight just before uvicorn would cancel
    it, so the client reads an error event and [DONE], and can tell a shutdown from a network fault."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # No time to finish: uvicorn cancels what is left within 0.2 s of the signal (a stream this long takes
    # longer), and the engine, whose margin is more than that, ends it at once.
    proc = start(str(tiny_llama_checkpoint[0]), port, "--shutdown-timeout", "0")
    try:
        wait_ready(proc, base)
        assert proc.poll() is None, proc.stdout.read()
        body = {"model": "tiny", "prompt": "cut me", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]  # a cut connection raises here
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert "shut down" in error["message"] and error["type"] == "server_error"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_exits_non_zero_when_the_model_fails_to_load(tmp_path):
    proc = start(str(tmp_path / "missing.gguf"), free_port())
    assert proc.wait(timeout=120) == 1
    assert "failed to load" in proc.stdout.read()
