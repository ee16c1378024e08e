"""A mixture of experts' grouped matmul on this machine's device: each way of computing it, in the same run.

One expert projection (gate and up, fused: [experts, 2 x moe_intermediate, hidden]) over the (token, expert)
rows of `--tokens` tokens, each routed to `num_experts_per_tok` experts drawn at random. Reports ms, GB/s of
what the projection must read (the weights of the experts some row chose, the rows, the output written) and
TFLOP/s (2 x rows x in x out), and each backend's time against XLA's `ragged_dot` (which XLA:GPU computes as
one dense GEMM over every row and every expert):

    python benchmarks/grouped_matmul.py --shape qwen3-30b-a3b --tokens 1 256 2048      # GPU: pallas, ragged
    python benchmarks/grouped_matmul.py --shape smollm2-135m-moe --dtype float32 --tokens 1 64 \
        --backends tiled ragged pallas                                                 # CPU (pallas interpreted)

Backends: `pallas` (pallas_kernels/gpu/grouped_matmul.py; interpreted off GPUs: its times then mean nothing),
`gated` (the same kernel storing SiLU(gate) * up, half the output: an expert MLP's first half as the step runs it),
`ragged` (jax.lax.ragged_dot), `tiled` (jserve's walk in tiles: the CPU's form). `--int8` gives the experts
int8 weights with a scale per output (pallas and tiled only). `--tune SECONDS` then searches the Pallas
kernel's launch settings (GroupedLaunch: row tile, output and input blocks, warps, pipelining stages) at
each token count, one setting at a time from the defaults, sharing that long among them, and prints the best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from attention_kernels import coordinate_search, median_seconds

from jserve.loader.random_weights import MODEL_SHAPES
from jserve.models import grouped_matmul as model_grouped_matmul
from pallas_kernels.gpu import grouped_matmul as kernel


def backends(interpret: bool) -> dict:
    """name -> fn(x, w, group_sizes, scale) of each way of computing the projection."""
    return {
        "pallas": partial(kernel.grouped_matmul, interpret=interpret),
        "gated": partial(kernel.grouped_matmul, gated="silu", interpret=interpret),
        "ragged": lambda x, w, sizes, scale: jax.lax.ragged_dot_general(x, w, sizes, model_grouped_matmul._DIMENSIONS),
        "tiled": partial(model_grouped_matmul._tiled, activation_group=0),
    }


def routed_group_sizes(tokens: int, experts: int, top_k: int, rng) -> np.ndarray:
    """Rows per expert when each token picks top_k distinct experts uniformly."""
    chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    return np.bincount(chosen.reshape(-1), minlength=experts).astype(np.int32)


def projection_bytes(sizes: np.ndarray, w: jax.Array, rows: int, dtype) -> int:
    """What the projection must move: the weights of the experts some row chose, the rows in, the output out."""
    _, out_features, in_features = w.shape
    weights = int((sizes > 0).sum()) * out_features * in_features * w.dtype.itemsize
    return weights + rows * (in_features + out_features) * jnp.dtype(dtype).itemsize


# What --tune tries, one setting at a time.
LAUNCH_CHOICES = dict(block_m=(16, 32, 64, 128), block_n=(16, 32, 64, 128), block_k=(32, 64, 128, 256),
                      num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4))  # fmt: skip


def tune(operands, launch_seconds, tokens_list, budget_s: float) -> None:
    """Search the kernel's launch settings at each token count, an equal share of the budget each.
    operands(tokens) -> (x, w, sizes, scale, bytes moved); launch_seconds(launch, x, w, sizes, scale) -> s."""
    end = time.monotonic() + budget_s
    for i, tokens in enumerate(tokens_list):
        deadline = time.monotonic() + (end - time.monotonic()) / (len(tokens_list) - i)
        search_launch(tokens, operands(tokens), launch_seconds, deadline)


def search_launch(tokens: int, operands, launch_seconds, deadline: float) -> None:
    *call, moved = operands

    def cost(launch: kernel.GroupedLaunch) -> float:
        try:
            seconds = launch_seconds(launch, *call)
        except Exception as err:  # a setting Triton cannot compile (shared memory, registers) is no candidate
            print(f"   failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}", flush=True)
            return float("inf")
        fields = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(launch).items())
        print(f"tokens {tokens:5d} {fields}: {seconds * 1e6:9.1f} us = {moved / seconds / 1e9:7.1f} GB/s", flush=True)
        return seconds

    best, tried = coordinate_search(kernel.GroupedLaunch(), LAUNCH_CHOICES, cost, deadline)
    default = tried[kernel.GroupedLaunch()]
    print(f"best at {tokens} tokens: {best}, {default / tried[best]:.2f}x the defaults ({len(tried)} tried)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shape", choices=[n for n, c in MODEL_SHAPES.items() if c.num_experts], default="qwen3-30b-a3b"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 2048])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--backends", nargs="+", default=["pallas", "ragged"], choices=list(backends(False)))
    parser.add_argument("--int8", action="store_true", help="int8 expert weights, a float32 scale per output")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tune", type=float, default=0, metavar="SECONDS", help="then search pallas' launch settings")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    config = MODEL_SHAPES[args.shape]
    experts, top_k = config.num_experts, config.num_experts_per_tok
    in_features, out_features = config.hidden_size, 2 * config.moe_intermediate_size
    interpret = jax.default_backend() != "gpu"
    fns = backends(interpret)
    dtype = jnp.dtype(args.dtype)
    key = jax.random.key(0)
    if args.int8:
        w = jax.random.randint(key, (experts, out_features, in_features), -127, 128).astype(jnp.int8)
        scale = jnp.full((experts, out_features), 1e-3, jnp.float32)
    else:
        w, scale = (0.02 * jax.random.normal(key, (experts, out_features, in_features))).astype(dtype), None
    print(f"{args.shape}: {experts} experts, top {top_k}, weights [{experts}, {out_features}, {in_features}] "
          f"{'int8' if args.int8 else args.dtype} on {jax.devices()[0].device_kind}"
          f"{' (pallas interpreted)' if interpret and 'pallas' in args.backends else ''}")  # fmt: skip
    print(f"{'tokens':>6} {'rows':>6} {'backend':>8} {'ms':>9} {'GB/s':>8} {'TFLOP/s':>8} {'vs ragged':>10}")
    rng, results = np.random.default_rng(0), []

    def operands(tokens: int):
        rows = tokens * top_k
        sizes = routed_group_sizes(tokens, experts, top_k, rng)
        x = jax.random.normal(jax.random.key(tokens), (rows, in_features)).astype(dtype)
        return x, w, jnp.asarray(sizes), scale, projection_bytes(sizes, w, rows, dtype)

    for tokens in args.tokens:
        x, _, sizes, _, moved = operands(tokens)
        rows, flops = x.shape[0], 2 * x.shape[0] * in_features * out_features
        timings = {}
        for name in args.backends:
            if name == "ragged" and args.int8:
                print(f"{tokens:6d} {rows:6d} {name:>8}   (no int8 form)")
                continue
            run = partial(jax.jit(partial(fns[name], scale=scale)), x, w, sizes)
            timings[name] = median_seconds(run, args.repeats)
        for name, seconds in timings.items():
            traffic = moved - (name == "gated") * rows * out_features // 2 * dtype.itemsize  # (half the output)
            ratio = f"{timings['ragged'] / seconds:9.2f}x" if "ragged" in timings else ""
            print(f"{tokens:6d} {rows:6d} {name:>8} {seconds * 1e3:9.3f} {traffic / seconds / 1e9:8.1f} "
                  f"{flops / seconds / 1e12:8.2f} {ratio:>10}")  # fmt: skip
            results.append(dict(tokens=tokens, rows=rows, backend=name, ms=seconds * 1e3, bytes=traffic, flops=flops))
    if args.tune:

        def launch_seconds(launch, x, w, sizes, scale) -> float:
            run = jax.jit(partial(kernel.grouped_matmul, launch=launch, interpret=interpret))
            return median_seconds(partial(run, x, w, sizes, scale), args.repeats)

        tune(operands, launch_seconds, args.tokens, args.tune)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
