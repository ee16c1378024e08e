"""Multi-host tensor parallelism, two processes on this machine: each gets two host CPU devices, they join
through jax.distributed (gloo collectives on CPU) and split a tiny model four ways. Process 0 generates;
process 1 is a plain `jserve generate` that follows it. The tokens must equal one device's."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from jserve import LLM, SamplingParams
from jserve.engine.args import EngineArgs

from tiny_models import save_tiny_checkpoint

LEADER = Path(__file__).with_name("multihost_worker.py")
SYSTEM = [(5 * j) % 300 + 7 for j in range(40)]
PROMPTS = [SYSTEM + [11, 12, 13], [9, 8, 7], SYSTEM + [21, 22], [(3 * j) % 250 + 4 for j in range(70)], [5] * 20]
ENGINE = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32,
          "kv_cache_memory": 1 << 20}  # fmt: skip


def flags(settings: dict) -> list[str]:
    return [arg for key, value in settings.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_split_one_model_and_match_one_device(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama")
    engine = flags({**ENGINE, "model": tmp_path, "tensor_parallel_size": 4})
    join = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2", "--process-id"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    follower = subprocess.Popen([sys.executable, "-m", "jserve", "generate", "unused: process 0 decides",
                                 *engine, *join, "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
    try:
        leader = subprocess.run([sys.executable, str(LEADER), json.dumps(PROMPTS), *engine, *join, "0"], env=env,
                                capture_output=True, text=True, timeout=600)  # fmt: skip
        follower_log = follower.communicate(timeout=120)[0]
    finally:
        follower.kill()  # only still running if the leader failed
    assert leader.returncode == 0, leader.stderr[-3000:]
    assert follower.returncode == 0, follower_log[-3000:]
    assert "Process 1 of 2: 2 local of 4 devices" in follower_log
    result = json.loads(leader.stdout.strip().splitlines()[-1])

    one = LLM.from_engine_args(EngineArgs(model=tmp_path, **ENGINE))
    expected = one.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert result["tokens"] == [o.outputs[0].token_ids for o in expected]
    assert result["cached"][2] > 0  # the shared system prompt hit the prefix cache across hosts too
