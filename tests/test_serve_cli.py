"""`jserve serve` as a process: 503 while loading, graceful drain on SIGTERM, exit codes."""

import json
import os
import signal
import subprocess
import sys

import httpx

from server_utils import free_port, wait_until
from tiny_models import tiny_kv_bytes


def start(model: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jserve", "serve", model, "--port", str(port), "--served-model-name", "tiny",
           "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
           "--kv-cache-memory", str(tiny_kv_bytes(64)), "--no-enable-prefix-caching"]  # fmt: skip
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_serve_reports_loading_then_drains_on_sigterm(tiny_llama_checkpoint):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start(str(tiny_llama_checkpoint[0]), port)
    statuses = []

    def health() -> bool:
        try:
            response = httpx.get(f"{base}/health")
        except httpx.TransportError:
            return proc.poll() is not None  # stop waiting if the server died
        statuses.append(response.json()["status"])
        return response.status_code == 200

    try:
        wait_until(health, timeout=300)
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


def test_serve_exits_non_zero_when_the_model_fails_to_load(tmp_path):
    proc = start(str(tmp_path / "missing.gguf"), free_port())
    assert proc.wait(timeout=120) == 1
    assert "failed to load" in proc.stdout.read()
