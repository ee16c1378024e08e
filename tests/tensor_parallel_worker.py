"""Runs in a subprocess with several host CPU devices (XLA_FLAGS must be set before jax is imported):
one model at several tensor-parallel sizes; prints JSON with greedy tokens, prompt logits and per-device bytes,
and what the model holds unsharded (its weights' bytes and KV heads, loaded without a mesh).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python tests/tensor_parallel_worker.py MODEL QUANT SPEC TP [TP ...] [--expert-parallel]

SPEC: "none", "ngram" for n-gram speculative decoding, or "draft" for the model as its own draft model.
--expert-parallel: a mixture of experts splits its experts over the devices.
--update-from FOLDER: then serve the weights of the checkpoint in FOLDER (LLM.update_weights) and decode again.
--embed: serve the model as an embedder (mean pooling, normalized) instead, and embed the prompts.
--lora A,B: serve the LoRA adapters in folders A and B, and decode the prompts with A, B, none and A.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file

from jserve import LLM, LoRARequest, SamplingParams
from jserve.attention.kv_cache import kv_cache_bytes_per_token
from jserve.loader import load_model
from jserve.spec_decode import Speculator

from tiny_models import jserve_prompt_logits

PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((9, 37, 64, 21))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def bytes_per_device(tree) -> list[int]:
    sizes = [0] * jax.device_count()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            sizes[shard.device.id] += shard.data.nbytes
    return sizes


def main() -> None:
    model = None if sys.argv[1] == "default" else sys.argv[1]  # "default": SmolLM2-135M
    quantization = sys.argv[2]
    speculative = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "draft": {"model": sys.argv[1], "num_speculative_tokens": 3},
    }.get(sys.argv[3])
    # Every step keeps its drafts, whatever the start-up timings of a busy machine say (the test counts them).
    Speculator.worthwhile = lambda self, sequences: sequences
    expert_parallel = "--expert-parallel" in sys.argv
    update_from = sys.argv[sys.argv.index("--update-from") + 1] if "--update-from" in sys.argv else None
    sizes = [int(s) for s in sys.argv[4:] if s.isdigit()]
    if "--embed" in sys.argv:
        json.dump({tp: embed(model, tp) for tp in sizes}, sys.stdout)
        return
    if "--lora" in sys.argv:
        folders = sys.argv[sys.argv.index("--lora") + 1].split(",")
        json.dump({tp: with_adapters(model, tp, folders) for tp in sizes}, sys.stdout)
        return
    unsharded = unsharded_sizes(model, quantization)
    results = {}
    for tp in sizes:
        llm = LLM(
            model,
            dtype="float32",
            tensor_parallel_size=tp,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            kv_cache_memory=(48 << 20) // tp,  # per device: the same pages at every size
            quantization=quantization,
            speculative_config=speculative,
            enable_expert_parallel=expert_parallel,
        )
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        results[tp] = {
            "tokens": [o.outputs[0].token_ids for o in outputs],
            "logits": jserve_prompt_logits(llm.engine.model, PROMPTS[1], llm.engine.runner.attention).tolist(),
            "weight_bytes": bytes_per_device(llm.engine.model.params),
            "kv_bytes": bytes_per_device(llm.engine.runner.kv_cache),
            "num_kv_heads": llm.engine.model.config.num_kv_heads,
            "num_pages": llm.engine.config.num_pages,
            "page_size": llm.engine.config.page_size,
            "kv_shard_shape": list(llm.engine.runner.kv_cache.k.addressable_shards[0].data.shape),
            "draft_tokens": llm.engine.stats.spec_draft_tokens,
            "accepted_tokens": llm.engine.stats.spec_accepted_tokens,
            "unsharded": unsharded,
        }
        if update_from:
            llm.update_weights(update_from)
            outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            results[tp]["updated_tokens"] = [o.outputs[0].token_ids for o in outputs]
            if quantization == "none":  # handed out as the checkpoint holds them, KV heads once each
                files = load_file(Path(update_from) / "model.safetensors")
                weights = llm.get_weights()
                results[tp]["weights_as_files"] = sorted(weights) == sorted(files) and all(
                    np.array_equal(weights[name], files[name]) for name in files
                )
    json.dump(results, sys.stdout)


def unsharded_sizes(model: str | None, quantization: str) -> dict:
    """The model on one device as loaded (nothing compiled): what each device's share is measured against."""
    loaded = load_model(model, "float32", quantization=quantization, progress_bars=False)
    return {
        "weight_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(loaded.params)),
        "num_kv_heads": loaded.config.num_kv_heads,
        "kv_bytes_per_token": kv_cache_bytes_per_token(loaded.config, np.float32),
    }


def embed(model: str, tp: int) -> dict:
    """The prompts' vectors with mean pooling (which reads every token's state), in 32-token steps."""
    llm = LLM(model, task="embed", pooler_config={"pooling_type": "MEAN"}, dtype="float32", tensor_parallel_size=tp,
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
              kv_cache_memory=(48 << 20) // tp)  # fmt: skip
    vectors = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    return {"embeddings": vectors, "kv_bytes": bytes_per_device(llm.engine.runner.kv_cache)}


def with_adapters(model: str, tp: int, folders: list[str]) -> dict:
    """Each prompt's greedy tokens and sampled-token logprobs with adapters A, B, none, A (a batch mixing them)."""
    llm = LLM(model, dtype="float32", tensor_parallel_size=tp, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, kv_cache_memory=(48 << 20) // tp, enable_lora=True, max_loras=2)  # fmt: skip
    adapters = [LoRARequest(f"adapter{i}", i + 1, folder) for i, folder in enumerate(folders)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=[adapters[0], adapters[1], None, adapters[0]])
    completions = [o.outputs[0] for o in outs]
    return {
        "tokens": [c.token_ids for c in completions],
        "logprobs": [[entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True)] for c in completions],
        "kv_bytes": bytes_per_device(llm.engine.runner.kv_cache),
    }


if __name__ == "__main__":
    main()
