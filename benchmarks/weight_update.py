"""How long new weights take to serve and how many bytes they move: `LLM.update_weights` with the engine's own
arrays (nothing to copy), with host arrays by jserve's names (placed on the device), by Hugging Face names
(split projections fused again, then placed), from a `jserve convert` folder (read, then placed), against
making a new `LLM` from that folder (load and compile). Also what `LLM.sleep` gives back and what
`wake_up` costs.

Each update is timed until the new weights serve (their arrays ready on the device); "bytes moved" counts
the new weights' arrays that are not the arrays given. Medians of --repeats; one engine per model, float32.

    python benchmarks/weight_update.py --model default random:llama3.2-1b --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

# Llama 3.2 1B's shape (1.24B parameters, a tied head): the "~1B" model, random weights.
LLAMA_1B = dict(family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=131072, tie_word_embeddings=True)  # fmt: skip
SETTINGS = dict(dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64,
                kv_cache_memory=64 << 20)  # fmt: skip


def register_shapes() -> None:
    from jserve.config import ModelConfig
    from jserve.loader.random_weights import MODEL_SHAPES

    MODEL_SHAPES.setdefault("llama3.2-1b", ModelConfig(**LLAMA_1B))


def served(llm) -> list[jax.Array]:
    leaves = jax.tree.leaves(llm.engine.model.params)
    jax.block_until_ready(leaves)
    return leaves


def buffer(array) -> int:
    return array.unsafe_buffer_pointer() if isinstance(array, jax.Array) else array.ctypes.data


def timed_update(llm, weights, names: str, repeats: int) -> tuple[float, int]:
    """(median seconds until `weights` serve, bytes of the served arrays whose buffers are not those given)."""
    given = {buffer(a) for a in weights.values()} if isinstance(weights, dict) else set()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.update_weights(weights, names=names)
        leaves = served(llm)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), sum(a.nbytes for a in leaves if buffer(a) not in given)


def measure(model: str, repeats: int) -> list[tuple[str, float, int]]:
    from jserve import LLM

    llm = LLM(None if model == "default" else model, **SETTINGS)
    rows = []
    own = llm.get_weights(names="jserve")
    rows.append(("the engine's own arrays, jserve names", *timed_update(llm, own, "jserve", repeats)))
    host = {name: np.asarray(array).copy() for name, array in own.items()}  # (np.asarray alone: a view)
    del own
    rows.append(("host arrays, jserve names", *timed_update(llm, host, "jserve", repeats)))
    del host
    hf = llm.get_weights()
    rows.append(("host arrays, Hugging Face names", *timed_update(llm, hf, "hf", repeats)))
    del hf
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "checkpoint"
        llm.engine.model.save_orbax(folder)
        rows.append(("a jserve convert folder", *timed_update(llm, str(folder), "hf", repeats)))
        weight_bytes = sum(a.nbytes for a in served(llm))
        kv_bytes = sum(a.nbytes for a in jax.tree.leaves(llm.engine.runner.kv_cache))
        sleep, wake = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            llm.sleep()
            sleep.append(time.perf_counter() - start)
            start = time.perf_counter()
            llm.wake_up()
            jax.block_until_ready(llm.engine.runner.kv_cache)
            wake.append(time.perf_counter() - start)
        rows.append((f"sleep (frees {kv_bytes / 2**20:.0f} MiB of KV cache)", statistics.median(sleep), 0))
        rows.append(("wake_up (allocates it again)", statistics.median(wake), kv_bytes))
        del llm
        gc.collect()
        start = time.perf_counter()
        fresh = LLM(str(folder), **SETTINGS)
        served(fresh)
        rows.append(("a new LLM from the folder (load, compile)", time.perf_counter() - start, weight_bytes))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["default", "random:llama3.2-1b"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    register_shapes()
    for model in args.model:
        rows = measure(model, args.repeats)
        print(f"\n{model}, float32, {jax.devices()[0].platform}\n| update | seconds | bytes moved | GB/s |\n"
              "| --- | --- | --- | --- |")  # fmt: skip
        for name, seconds, moved in rows:
            rate = f"{moved / seconds / 1e9:.2f}" if moved else "—"
            print(f"| {name} | {seconds:.3f} | {moved / 2**20:.0f} MiB | {rate} |")


if __name__ == "__main__":
    main()
