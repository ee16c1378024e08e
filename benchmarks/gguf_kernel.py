"""Projections with GGUF block-format weights (jserve's C++ kernel) against float32 (XLA) and int8 (jserve's
VNNI kernel), in one run: one layer's projections of a model shape, at several token counts.

`smollm2-135m`: its q/k/v, gate/up and down weights (3.2M weights, which stay in cache between calls, so
this measures the kernels' arithmetic); `llama3-8b`: its gate/up and down (176M weights, streamed from
memory at every call, as in a real step). Weights are random blocks (any bytes are valid), medians of
`--repeats` calls.

    python benchmarks/gguf_kernel.py --shape smollm2-135m --tokens 1 16 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jserve import cpu_kernels
from jserve.loader.gguf_blocks import GgufBlocks, fuse_blocks
from jserve.models.quantization import int8_matmul, quantize_rows, tile, tiles_weights

G = GGMLQuantizationType
# One layer's projections (outputs, inputs).
SHAPES = {
    "smollm2-135m": [(576 + 2 * 192, 576), (2 * 1536, 576), (576, 1536)],
    "llama3-8b": [(2 * 14336, 4096), (4096, 14336)],
}
FORMATS = {"q4_0": G.Q4_0, "q4_1": G.Q4_1, "q5_0": G.Q5_0, "q5_1": G.Q5_1, "q8_0": G.Q8_0, "q4_k": G.Q4_K,
           "q5_k": G.Q5_K, "q6_k": G.Q6_K}  # fmt: skip
SCALE_OFFSETS = {G.Q4_0: [0], G.Q4_1: [0, 2], G.Q5_0: [0], G.Q5_1: [0, 2], G.Q8_0: [0], G.Q4_K: [0, 2], G.Q5_K: [0, 2],
                 G.Q6_K: [208]}  # fmt: skip


def random_blocks(rng, ggml_type, rows: int, depth: int) -> tuple[jax.Array, tuple]:
    """A weight of random blocks in the kernel's layout, and its segments."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, depth // block, size), dtype=np.uint8)
    for at in SCALE_OFFSETS[ggml_type]:
        scales = (rng.standard_normal((rows, depth // block)) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, depth // block, 2)
    flat, segments = fuse_blocks([GgufBlocks(int(ggml_type), raw.reshape(rows, -1), depth)])
    return jnp.asarray(flat), segments


def median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="smollm2-135m")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    # K-quants' super-blocks of 256 need inputs that divide into them (SmolLM2's 576 does not)
    formats = [
        name
        for name, t in FORMATS.items()
        if name in args.formats and all(d % GGML_QUANT_SIZES[t][0] == 0 for _, d in SHAPES[args.shape])
    ]
    kinds = ["float32", *formats] + (["int8"] if tiles_weights() else [])
    totals = {(kind, n): 0.0 for kind in kinds for n in args.tokens}
    for outputs, depth in SHAPES[args.shape]:
        weight = jnp.asarray(rng.standard_normal((outputs, depth)).astype(np.float32) * 0.02)
        q, scale = quantize_rows(weight)
        tiled = tile(q)
        blocks = {name: random_blocks(rng, t, outputs, depth) for name, t in FORMATS.items() if name in kinds}
        calls = {
            # the model's own product (no transposed copy of the weight)
            "float32": (jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))), weight),
            "int8": (jax.jit(lambda x, w, s=scale: int8_matmul(x, w, s)), tiled),
        }
        for name, (w, segments) in blocks.items():
            calls[name] = (jax.jit(partial(cpu_kernels.gguf_linear, segments=segments)), w)
        for n in args.tokens:
            x = jnp.asarray(rng.standard_normal((n, depth)).astype(np.float32))
            for kind in kinds:
                fn, w = calls[kind]
                totals[kind, n] += median_ms(fn, x, w, repeats=args.repeats)
        del weight, q, tiled, blocks, calls
    print(f"{args.shape}: one layer's projections, ms (medians of {args.repeats}); ratio to float32")
    print(f"{'tokens':>6} " + " ".join(f"{kind:>16}" for kind in kinds))
    for n in args.tokens:
        base = totals["float32", n]
        print(f"{n:6d} " + " ".join(f"{totals[kind, n]:8.3f} ({totals[kind, n] / base:4.2f}x)" for kind in kinds))


if __name__ == "__main__":
    main()
