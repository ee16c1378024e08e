"""Paged-attention kernels on this machine's device: decode bandwidth and prefill throughput, each backend
against the plain-JAX reference in the same run.

Decode: `--seqs` sequences with one new token and `--context` tokens each; reports GB/s of K/V read
(every context token's K and V, once). Prefill: the same sequences each with a `--chunk`-token chunk
ending at `--context`; reports TFLOP/s counting only unmasked (causal) query-key pairs.

    python benchmarks/attention_kernels.py --shape llama3-8b --seqs 64 --context 2048 --chunk 512 \
        --backends pallas pallas-mosaic-gpu reference                                  # GPU: Triton, Mosaic
    python benchmarks/attention_kernels.py --shape smollm2-135m --dtype float32 --backends cpu reference \
        --seqs 64 --context 200 --chunk 128                                            # CPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jserve.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    KVPages,
    SequenceChunk,
    build_model_input,
    resolve_attention_backend,
)

# (query heads, kv heads, head_dim) of one layer
SHAPES = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128), "smollm2-135m": (9, 3, 64)}


def make_batch(args, new_tokens: int):
    heads, kv_heads, dim = SHAPES[args.shape]
    dtype = jnp.dtype(args.dtype)
    pages_per_seq = -(-args.context // args.page_size)
    num_pages = args.seqs * pages_per_seq
    rng = np.random.default_rng(0)
    tables = rng.permutation(num_pages).astype(np.int32).reshape(args.seqs, pages_per_seq)
    chunks = [SequenceChunk(np.zeros(new_tokens, np.int32), args.context - new_tokens, t) for t in tables]
    tokens = args.seqs * new_tokens
    batch = build_model_input(chunks, args.page_size, tokens, args.seqs, pages_per_seq)
    key = jax.random.key(0)
    pages = KVPages(
        *(jax.random.normal(k, (num_pages, args.page_size, kv_heads, dim), dtype) for k in jax.random.split(key))
    )
    new_kv = jax.random.normal(key, (2, tokens, kv_heads, dim), dtype)
    q = jax.random.normal(key, (tokens, heads, dim), dtype)
    return q, new_kv, pages, jax.device_put(batch.attention)


def time_backend(backend: AttentionBackend, q, new_kv, pages, meta, repeats: int) -> float:
    """Median seconds of one layer's write + attention, the pages donated (written in place, as in the engine)."""
    dim = q.shape[-1]

    @partial(jax.jit, donate_argnums=2)
    def layer(q, new_kv, pages, meta):
        return backend(q, new_kv[0], new_kv[1], pages, meta, scale=dim**-0.5)

    pages = jax.tree.map(jnp.copy, pages)  # the caller's pages stay valid for the next backend
    out, pages = layer(q, new_kv, pages, meta)
    out.block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out, pages = layer(q, new_kv, pages, meta)
        out.block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="llama3-8b")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens per sequence")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--backends", nargs="+", default=["pallas", "reference"], choices=[b for b in ATTENTION_BACKENDS if b != "auto"]
    )
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    heads, kv_heads, dim = SHAPES[args.shape]
    itemsize = jnp.dtype(args.dtype).itemsize
    print(
        f"device: {jax.devices()[0].device_kind}; {args.shape} layer ({heads} q / {kv_heads} kv heads, d={dim}), "
        f"{args.dtype}, {args.seqs} seqs x {args.context} context, page {args.page_size}"
    )

    decode = make_batch(args, 1)
    prefill = make_batch(args, args.chunk)
    kv_bytes = args.seqs * args.context * kv_heads * dim * 2 * itemsize
    # Causal pairs of a chunk ending at `context`: each query sees the cached prefix plus itself and earlier.
    pairs = args.seqs * sum(args.context - args.chunk + i + 1 for i in range(args.chunk))
    flops = 4 * pairs * heads * dim  # QK^T and PV, 2 flops per multiply-add
    results = {}
    for name in args.backends:
        backend = resolve_attention_backend(name)
        if backend.interpret:
            print(f"{name}: skipped (interpret mode on this platform measures nothing useful)")
            continue
        d = time_backend(backend, *decode, args.repeats)
        p = time_backend(backend, *prefill, args.repeats)
        results[name] = (d, p)
        print(
            f"{name:>9} ({backend.kernel}): decode {d * 1e6:8.1f} us = {kv_bytes / d / 1e9:7.1f} GB/s of KV | "
            f"prefill {p * 1e3:7.2f} ms = {flops / p / 1e12:6.2f} TFLOP/s"
        )
    if "reference" in results:
        rd, rp = results["reference"]
        for name, (d, p) in results.items():
            if name != "reference":
                print(f"{name} vs reference: decode {rd / d:.2f}x faster, prefill {rp / p:.2f}x faster")


if __name__ == "__main__":
    main()
