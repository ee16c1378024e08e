"""Paged-attention kernels on this machine's device: decode bandwidth and prefill throughput, each backend
against the plain-JAX reference in the same run.

Decode: `--seqs` sequences with one new token and `--context` tokens each; reports GB/s of K/V read
(every context token's K and V, once). Prefill: the same sequences each with a `--chunk`-token chunk
ending at `--context`; reports TFLOP/s counting only unmasked (causal) query-key pairs.

    python benchmarks/attention_kernels.py --shape llama3-8b --seqs 64 --context 2048 --chunk 512 \
        --backends pallas pallas-mosaic-gpu reference                                  # GPU: Triton, Mosaic
    python benchmarks/attention_kernels.py --shape smollm2-135m --dtype float32 --backends cpu reference \
        --seqs 64 --context 200 --chunk 128                                            # CPU

`--tune SECONDS` then searches the Triton kernel's launch settings (K/V block, warps, pipelining stages,
splits per SM for decode; query block, K/V block, warps, stages for prefill) on the same two workloads, one
setting at a time from the defaults, for at most that long; it prints every try and the best against the
defaults, and `--tuned-json` writes the best as an entry of `pallas_kernels/gpu/tuned.json`, which the
kernel then runs on GPUs of this kind for this attention shape. On a CPU the search runs in interpret mode
(its times mean nothing: it checks the search itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

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
from pallas_kernels import gpu
from pallas_kernels.gpu.launch import AttentionShape, DecodeLaunch, PrefillLaunch, tuned_entry

# (query heads, kv heads, head_dim) of one layer
SHAPES = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128), "smollm2-135m": (9, 3, 64)}


def decode_bytes(args) -> int:
    """K/V bytes a decode step reads: every context token's K and V, once."""
    _, kv_heads, dim = SHAPES[args.shape]
    return args.seqs * args.context * kv_heads * dim * 2 * jnp.dtype(args.dtype).itemsize


def prefill_flops(args) -> int:
    """Causal pairs of a chunk ending at `context` (each query sees the cached prefix plus itself and earlier),
    4 flops per pair and head dimension (QK^T and PV, 2 per multiply-add)."""
    heads, _, dim = SHAPES[args.shape]
    pairs = args.seqs * sum(args.context - args.chunk + i + 1 for i in range(args.chunk))
    return 4 * pairs * heads * dim


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

    def run():
        nonlocal pages
        out, pages = layer(q, new_kv, pages, meta)
        return out

    return median_seconds(run, repeats)


def median_seconds(run: Callable[[], jax.Array], repeats: int) -> float:
    """Median wall seconds of run() with its result waited for, after one untimed call (compilation)."""
    run().block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run().block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# What --tune tries, one setting at a time (K/V blocks in keys, as pages of the run's page size).
BLOCK_KEYS = (32, 64, 128, 256)
DECODE_CHOICES = dict(num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4), programs_per_core=(1, 2, 4, 8))
PREFILL_CHOICES = dict(block_q=(16, 32, 64, 128), num_warps=(4, 8), num_stages=(1, 2, 3))


def coordinate_search(start, choices: dict[str, tuple], cost: Callable, deadline: float):
    """From `start` (a frozen dataclass), try each field's values with the others at the best so far, keeping
    any faster; repeat until a round finds nothing faster or the deadline passes. cost(setting) -> seconds
    (inf: it failed). Returns (best, {setting: cost} of every try)."""
    tried = {start: cost(start)}
    best, improved = start, True
    while improved and time.monotonic() < deadline:
        improved = False
        for name, values in choices.items():
            for value in values:
                candidate = dataclasses.replace(best, **{name: value})
                if candidate in tried or time.monotonic() >= deadline:
                    continue
                tried[candidate] = cost(candidate)
                if tried[candidate] < tried[best]:
                    best, improved = candidate, True
    return best, tried


def tune(args, decode, prefill, budget_s: float) -> dict:
    """Search the Triton kernel's decode and prefill launch settings (half the budget each) on this device;
    returns the best as a tuned.json entry."""
    heads, kv_heads, dim = SHAPES[args.shape]
    interpret = jax.default_backend() != "gpu"
    device = jax.devices()[0]
    cores = getattr(device, "core_count", None) or 132
    pages = tuple(sorted({max(1, keys // args.page_size) for keys in BLOCK_KEYS}))

    def seconds(batch, **launch) -> float:
        q, _, kv, meta = batch
        kernel = partial(gpu.ragged_paged_attention, scale=dim**-0.5, interpret=interpret, num_cores=cores, **launch)
        run = jax.jit(kernel)
        call = (q, kv.k, kv.v, meta.context_lens, meta.page_tables, meta.query_start_loc)
        try:
            return median_seconds(lambda: run(*call), args.repeats)
        except Exception as err:  # a setting Triton cannot compile (shared memory, registers) is no candidate
            print(f"   failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}", flush=True)
            return float("inf")

    def decode_cost(launch: DecodeLaunch) -> float:
        t = seconds(decode, decode=launch)
        print(f"decode  {_fields(launch)}: {t * 1e6:9.1f} us = {decode_bytes(args) / t / 1e9:7.1f} GB/s", flush=True)
        return t

    def prefill_cost(launch: PrefillLaunch) -> float:
        t = seconds(prefill, prefill=launch)
        print(f"prefill {_fields(launch)}: {t * 1e3:9.3f} ms = {prefill_flops(args) / t / 1e12:6.2f} TFLOP/s",
              flush=True)  # fmt: skip
        return t

    start = time.monotonic()
    default_pages = max(1, 64 // args.page_size)  # (the kernel's default K/V block: 64 keys)
    decode_start = DecodeLaunch(pages_per_block=default_pages)
    prefill_start = PrefillLaunch(pages_per_block=default_pages)
    best_d, tried_d = coordinate_search(decode_start, {"pages_per_block": pages, **DECODE_CHOICES}, decode_cost,
                                        start + budget_s / 2)  # fmt: skip
    best_p, tried_p = coordinate_search(prefill_start, {"pages_per_block": pages, **PREFILL_CHOICES}, prefill_cost,
                                        start + budget_s)  # fmt: skip
    searches = (("decode", best_d, tried_d, decode_start), ("prefill", best_p, tried_p, prefill_start))
    for what, best, tried, first in searches:
        print(f"{what}: best {_fields(best)}, {tried[first] / tried[best]:.2f}x the defaults ({len(tried)} tried)")
    shape = AttentionShape(device.device_kind, args.dtype, dim, heads // kv_heads, args.page_size)
    return tuned_entry(shape, best_d, best_p, decode_us=round(tried_d[best_d] * 1e6, 1),
                       decode_default_us=round(tried_d[decode_start] * 1e6, 1),
                       prefill_ms=round(tried_p[best_p] * 1e3, 3),
                       prefill_default_ms=round(tried_p[prefill_start] * 1e3, 3),
                       workload=f"{args.seqs} seqs x {args.context} context, chunk {args.chunk}")  # fmt: skip


def _fields(setting) -> str:
    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(setting).items())


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
    parser.add_argument("--tune", type=float, default=0, metavar="SECONDS", help="search the Triton kernel's launch "
                        "settings for at most this long (see above)")  # fmt: skip
    parser.add_argument("--tuned-json", default=None, help="write the best settings here, as tuned.json holds them")
    args = parser.parse_args()
    heads, kv_heads, dim = SHAPES[args.shape]
    print(
        f"device: {jax.devices()[0].device_kind}; {args.shape} layer ({heads} q / {kv_heads} kv heads, d={dim}), "
        f"{args.dtype}, {args.seqs} seqs x {args.context} context, page {args.page_size}"
    )

    decode = make_batch(args, 1)
    prefill = make_batch(args, args.chunk)
    kv_bytes, flops = decode_bytes(args), prefill_flops(args)
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
    if args.tune:
        entry = tune(args, decode, prefill, args.tune)
        if args.tuned_json:
            Path(args.tuned_json).write_text(json.dumps([entry], indent=1) + "\n")


if __name__ == "__main__":
    main()
