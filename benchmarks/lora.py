"""What serving LoRA adapters costs: output tokens/s of 16 requests decoded together (greedy, ignore_eos) on an
engine without adapters, against one with --enable-lora --max-loras 4 --max-lora-rank 16 whose requests use no
adapter, one adapter, or four distinct ones (rank 16 on all seven projections, random weights written here as
PEFT folders). Same process, the configurations interleaved in every repeat; medians of --repeats and each
one's ratio to the engine without adapters.

    python benchmarks/lora.py --model default --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """A PEFT LoRA folder for `config` (a jserve ModelConfig) with random A and B on every projection."""
    rng = np.random.default_rng(seed)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}  # fmt: skip
    tensors = {}
    for layer in range(config.num_layers):
        for module, (rows, inputs) in shapes.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, inputs**-0.5, (rank, inputs)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.01, (rows, rank)).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(settings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default: SmolLM2-135M-Instruct (its GGUF)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for each engine's KV cache "
                        "(on an accelerator: two engines share the device's memory)")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args()

    from jserve import LLM, LoRARequest, SamplingParams

    model = None if args.model == "default" else args.model
    settings = dict(kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
    base = LLM(model, **settings)
    lora = LLM(model, **settings, enable_lora=True, max_loras=4, max_lora_rank=args.rank)
    vocab = base.engine.model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab - 100, args.prompt_tokens).tolist() for _ in range(args.concurrency)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(4):
            write_adapter(Path(tmp) / f"a{i}", lora.engine.model.placement.original, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        runs = {
            "no --enable-lora": (base, None),
            "0 adapters": (lora, None),
            "1 adapter": (lora, [adapters[0]] * args.concurrency),
            "4 adapters": (lora, [adapters[i % 4] for i in range(args.concurrency)]),
        }
        for llm, requests in runs.values():  # (adapters read and placed; first runs' one-off costs)
            llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, lora_request=requests)
        rates: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, (llm, requests) in runs.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
                seconds = time.perf_counter() - start
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
    print(f"{args.concurrency} requests of {args.prompt_tokens} prompt + {args.max_tokens} output tokens, "
          f"rank {args.rank}, medians of {args.repeats}")  # fmt: skip
    reference = statistics.median(rates["no --enable-lora"])
    for name, values in rates.items():
        median = statistics.median(values)
        runs_text = " / ".join(f"{v:.1f}" for v in values)
        print(f"{name:>17}: {median:7.1f} output tok/s ({median / reference:.2f}x)   runs {runs_text}")


if __name__ == "__main__":
    main()
