"""The README's main job, run as a user would: `jserve generate` on the default model."""

import subprocess
import sys


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jserve", *args], capture_output=True, text=True, timeout=600)


def test_generate_answers_with_the_default_model(smollm2_gguf_path):
    done = run_cli("generate", "What is the capital of France?", "--max-tokens", "16")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "The capital of France is Paris."
    assert "Compiled" in done.stderr and "KV cache:" in done.stderr  # the log says what the engine decided


def test_bad_model_path_is_one_clear_error(tmp_path):
    done = run_cli("generate", "hi", "--model", str(tmp_path / "missing"))
    assert done.returncode == 1
    assert "does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_chat_keeps_the_conversation(smollm2_gguf_path):
    done = subprocess.run(
        [sys.executable, "-m", "jserve", "chat", "--max-tokens", "24", "--max-model-len", "512",
         "--max-num-batched-tokens", "64", "--max-num-seqs", "4"],
        input="What is the capital of France?\nAnd of Italy?\n",
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    replies = [line for line in done.stdout.splitlines() if line.strip()]
    assert "Paris" in replies[0]
    assert "Rome" in done.stdout  # the second turn saw the first


def test_generate_with_a_lora_adapter(tiny_llama_checkpoint, tmp_path):
    """`--lora PATH` replies with the adapter's tokens (transformers + PEFT's), decoded."""
    from tiny_adapters import save_tiny_adapter
    from tiny_models import reference_greedy, tiny_engine_args, tiny_tokenizer

    folder, base = tiny_llama_checkpoint
    adapter = save_tiny_adapter(tmp_path / "adapter", base, seed=1)
    prompt = "The quick brown fox"
    tokenizer = tiny_tokenizer()
    expected = tokenizer.decode(reference_greedy(adapter, tokenizer.encode(prompt), 12))
    args = tiny_engine_args(folder)
    done = run_cli("generate", prompt, "--model", str(folder), "--raw", "--max-tokens", "12", "--dtype", "float32",
                   "--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                   "--lora", str(tmp_path / "adapter"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected.strip()
    assert "LoRA adapter cli loaded" in done.stderr
