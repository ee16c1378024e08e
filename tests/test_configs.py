"""configs/ and --config: every preset is valid for every command and for `LLM`, flags override a file, a
bad file is one error naming its key and path, the accelerator presets fit their machines, and the CPU
presets answer a prompt."""

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import jax.numpy as jnp
import pytest

from jserve import load_config
from jserve.cli import build_parser, main
from jserve.config_file import parse_args
from jserve.engine.args import EngineArgs
from jserve.engine.config import DeviceLimits, GiB, resolve_engine_config
from jserve.loader.random_weights import MODEL_SHAPES
from jserve.parallel.partition import tensor_parallel_config

from server_utils import free_port, wait_until

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRESETS = sorted(CONFIGS.glob("*.yaml"))
COMMANDS = {"generate": ["generate", "a prompt"], "chat": ["chat"], "serve": ["serve"]}
QUESTION = "What is the capital of France?"


def parse(*argv: str):
    return parse_args(build_parser(), list(argv))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_there_are_presets():
    assert {"cpu.yaml", "cpu-fast.yaml"} <= {p.name for p in PRESETS}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_sets_its_values_for_every_command(preset, command):
    """A preset holds engine settings only, so it serves all three commands and `LLM`."""
    assert preset.read_text().startswith("#"), "a preset starts with a comment saying what it is for"
    args = parse(*COMMANDS[command], "--config", str(preset))
    settings = load_config(preset)
    assert settings and {name: getattr(args, name) for name in settings} == settings
    EngineArgs.from_cli_args(args)
    EngineArgs(**settings)  # LLM(**load_config(path)) takes every key: LLM's keywords are EngineArgs' fields


def test_flags_on_the_command_line_override_the_file(tmp_path):
    config = write(tmp_path, "model: from-file\nmax-num-seqs: 8\nquantization: int8\n"
                             "enable-prefix-caching: false\nstop: [a, b]\ntemperature: 0.5\n")  # fmt: skip
    args = parse("generate", "hi", "--config", config)
    assert (args.model, args.max_num_seqs, args.quantization, args.enable_prefix_caching, args.stop,
            args.temperature) == ("from-file", 8, "int8", False, ["a", "b"], 0.5)  # fmt: skip

    # Before or after --config, and even at the flag's default, the command line wins; a repeatable flag's
    # items replace the file's list.
    args = parse("generate", "hi", "--max-num-seqs", "3", "--config", config, "--quantization", "none",
                 "--enable-prefix-caching", "--stop", "c")  # fmt: skip
    assert (args.model, args.max_num_seqs, args.quantization, args.enable_prefix_caching, args.stop,
            args.temperature) == ("from-file", 3, "none", True, ["c"], 0.5)  # fmt: skip


def test_serve_takes_its_model_and_server_settings_from_the_file(tmp_path):
    config = write(tmp_path, "model: from-file\nport: 9001\nhost: 0.0.0.0\nmax-queue: 7\nshutdown-timeout: 5\n")
    args = parse("serve", "--config", config)
    assert (args.model, args.port, args.host, args.max_queue, args.shutdown_timeout) == (
        "from-file", 9001, "0.0.0.0", 7, 5.0)  # fmt: skip
    args = parse("serve", "from-cli", "--config", config, "--port", "9002")
    assert (args.model, args.port) == ("from-cli", 9002)


BAD_FILES = [
    # (file, command, what the error says besides the file's path)
    ("max-num-sequences: 4\n", "generate", ["'max-num-sequences' is not a setting of jserve generate"]),
    ("max_num_seqs: 4\n", "serve", ["'max_num_seqs'", "did you mean 'max-num-seqs'"]),
    ("no-enable-prefix-caching: true\n", "serve", ["'no-enable-prefix-caching'", "'enable-prefix-caching'"]),
    ("port: 9000\n", "generate", ["'port' is not a setting of jserve generate"]),
    ("temperature: 0.5\n", "serve", ["'temperature' is not a setting of jserve serve"]),
    ("config: other.yaml\n", "chat", ["'config' is not a setting of jserve chat"]),
    ("max-num-seqs: many\n", "chat", ["max-num-seqs: invalid int value 'many'"]),
    ("max-num-seqs: 1.5\n", "chat", ["max-num-seqs: invalid int value 1.5"]),
    ("max-num-seqs: true\n", "chat", ["max-num-seqs: expected a single value, got True"]),
    ("quantization: int4\n", "serve", ["quantization: 'int4' is not one of auto, none, int8, w8a8, gguf"]),
    ("enable-prefix-caching: maybe\n", "serve", ["enable-prefix-caching: expected true or false, got 'maybe'"]),
    ("stop: {a: 1}\n", "generate", ["stop: expected a single value"]),
    ("schedule-policy: lpm\nscheduling-policy: fcfs\n", "serve", ["'scheduling-policy' and 'schedule-policy'"]),
    ("- max-num-seqs: 4\n", "serve", ["expected `key: value` lines, got a list"]),
    ("max-num-seqs: [4\n", "serve", ["is not valid YAML"]),
]


@pytest.mark.parametrize("text, command, expected", BAD_FILES)
def test_a_bad_file_is_one_error_naming_the_key_and_the_file(tmp_path, capsys, text, command, expected):
    config = write(tmp_path, text)
    with pytest.raises(SystemExit) as exited:
        main([*COMMANDS[command], "--config", config])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"jserve {command}: error: ") and config in error, error
    for fragment in expected:
        assert fragment in error


def test_a_missing_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(tmp_path / "missing.yaml")])
    assert f"config file {tmp_path / 'missing.yaml'}: No such file or directory" in capsys.readouterr().err


def test_an_empty_file_sets_nothing(tmp_path):
    args = vars(parse("serve", "--config", write(tmp_path, "# nothing yet\n")))
    assert args | {"config": None} == vars(parse("serve"))
    assert load_config(write(tmp_path, "")) == {}


def test_a_bad_file_from_the_command_line_exits_without_a_traceback(tmp_path):
    config = write(tmp_path, "max-num-seqs: 4\nbogus: 1\n")
    done = subprocess.run([sys.executable, "-m", "jserve", "generate", "hi", "--config", config],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == f"jserve generate: error: {config}: 'bogus' is not a setting of jserve generate"


def test_load_config_returns_llm_keywords_and_leaves_out_the_rest(tmp_path):
    config = write(tmp_path, "model: some/model\nmax-num-seqs: 8\nenable-prefix-caching: false\nport: 9000\n"
                             "host: 0.0.0.0\nmax-queue: 4\napi-key: secret\nserved-model-name: m\ntemperature: 0.5\n"
                             "distributed: true\n")  # fmt: skip
    assert load_config(config) == {"model": "some/model", "max_num_seqs": 8, "enable_prefix_caching": False}


def test_load_config_refuses_an_unknown_key_or_a_bad_value(tmp_path):
    with pytest.raises(ValueError, match=r"config\.yaml: 'max-batch' is not a setting of jserve serve, generate"):
        load_config(write(tmp_path, "max-batch: 4\n"))
    with pytest.raises(ValueError, match=r"config\.yaml: kv-cache-dtype: 'float16' is not one of"):
        load_config(write(tmp_path, "kv-cache-dtype: float16\n"))


LLAMA_8B = MODEL_SHAPES["llama3-8b"]
LLAMA_70B = dataclasses.replace(
    LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, sliding_windows=(None,) * 80
)
H100_ALLOCATOR = 0.75 * 80 * GiB  # JAX's GPU allocator takes 75 % of the memory by default
V5E_HBM = 15.75 * GiB  # of a v5e chip's 16 GiB, what the TPU runtime leaves


def bfloat16_weights_per_device(m, tp: int) -> int:
    """Each layer and the LM head split tp ways, the embedding whole on every device (parallel/partition.py)."""
    layer = m.hidden_size * ((2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim + 3 * m.intermediate_size)
    return 2 * (m.num_layers * layer // tp + m.vocab_size * m.hidden_size * (tp + 1) // tp)


# preset: (its model's shape, its device's platform and memory)
ACCELERATOR_PRESETS = {
    "llama3-8b-h100.yaml": (LLAMA_8B, "gpu", H100_ALLOCATOR),
    "llama3-70b-tp8.yaml": (LLAMA_70B, "gpu", H100_ALLOCATOR),
    "tpu-v5e.yaml": (LLAMA_8B, "tpu", V5E_HBM),
}


@pytest.mark.parametrize("name", ACCELERATOR_PRESETS)
def test_an_accelerator_preset_passes_the_start_up_checks_of_its_machine(name):
    """The engine's own checks with the target's limits: the model splits over the devices, the kernel takes
    the shapes (TPU: its SMEM), and the KV cache left beside the weights holds max-model-len."""
    shape, platform, memory = ACCELERATOR_PRESETS[name]
    settings = load_config(CONFIGS / name)
    tp = settings.get("tensor_parallel_size", 1)
    built = tensor_parallel_config(shape, tp)
    limits = DeviceLimits(platform, int(memory) - bfloat16_weights_per_device(shape, tp), smem_bytes=1 << 20)
    config = resolve_engine_config(EngineArgs(**settings), built, jnp.bfloat16, limits=limits)
    assert config.attention_backend == settings["attention_backend"]
    assert config.num_pages * config.page_size >= 4 * config.max_model_len  # room for several long requests


def start_server(*args: str) -> subprocess.Popen:
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "jserve", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip


# The command line shrinks the presets' budget and context so that they start quickly (and so also
# checks that flags override the file).
SMALL = ["--max-num-batched-tokens", "64", "--max-model-len", "512"]


def run_generate(preset: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jserve", "generate", "--config", str(CONFIGS / preset), QUESTION, "--max-tokens",
         "16", *SMALL], capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_the_cpu_preset_answers(smollm2_gguf_path):
    done = run_generate("cpu.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "The capital of France is Paris."
    assert "(token buckets 1, 16, 32, 64)" in done.stderr  # the command line's budget, not the file's 512
    assert re.search(r"of float32, [\d.]+ GiB; max concurrency at max_model_len 512", done.stderr)


def test_the_fast_cpu_preset_answers(smollm2_gguf_path):
    done = run_generate("cpu-fast.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()  # w8a8 parts from float32's greedy reply here: a reply, not necessarily "Paris"
    assert re.search(r"of bfloat16, [\d.]+ GiB; max concurrency at max_model_len 512", done.stderr)


def test_serve_runs_a_preset_with_server_keys_added(smollm2_gguf_path, tmp_path):
    port = free_port()
    config = write(tmp_path, (CONFIGS / "cpu.yaml").read_text() + f"port: {port}\nserved-model-name: smol\n")
    proc = start_server("--config", config, *SMALL)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/health").status_code == 200
        except httpx.TransportError:
            return proc.poll() is not None  # stop waiting if the server died

    try:
        wait_until(ready, timeout=300)
        assert proc.poll() is None, proc.stdout.read()
        body = {"model": "smol", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 16,
                "temperature": 0}  # fmt: skip
        response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
